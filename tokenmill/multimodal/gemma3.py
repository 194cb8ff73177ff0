"""How Gemma 3 writes an image into the prompt, as transformers' ``Gemma3Processor`` does.

The chat template writes ``<start_of_image>`` once per image; the processor replaces it by
``"\\n\\n<start_of_image>" + mm_tokens_per_image x "<image_soft_token>" +
"<end_of_image>\\n\\n"``, and, with pan-and-scan, by ``"Here is the original image "``
+ that sequence + ``" and here are some crops to help you see better "`` + one such
sequence per crop (joined by spaces). The soft tokens of each sequence are one image's
placeholders: the original, then each crop, each ``mm_tokens_per_image`` long.

transformers replaces text and then tokenizes the prompt; tokenmill expands token ids.
The two agree because added tokens (``<start_of_image>``, ``<end_of_image>``, the chat's
special tokens) split the text into pieces that are tokenized apart: at each junction, the
prompt's text and the replacement's text that meet there, up to the added tokens on either
side, are tokenized again together: the newlines around an image sequence (Gemma's
tokenizer writes a run of newlines as one token: ``"\\n"`` + ``"\\n\\n"`` ->
``"\\n\\n\\n"``), and with pan-and-scan the prompt's text before ``"Here is the original
image"`` (``"this "`` + ``"Here"`` -> ``"this"`` + ``" Here"``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# Gemma3Processor's pan-and-scan defaults (the released preprocessor_config.json files leave
# these keys null).
PAN_AND_SCAN_DEFAULTS = {
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}


def gemma3_processor_kwargs(image_processor: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of Gemma 3's image processor calls: ``kwargs``
    (``--mm-processor-kwargs``) over the processor's own settings over Gemma3Processor's
    pan-and-scan defaults (used where the processor's settings are null). An integer
    ``pan_and_scan_min_ratio_to_activate`` is passed as the float the processor takes.

    Raises:
        ValueError: a crop size or crop count that is not a positive integer (the
            processor divides by the crop count, and by the crop size).
    """
    defaults = {k: v for k, v in PAN_AND_SCAN_DEFAULTS.items()
                if getattr(image_processor, k, None) is None}  # fmt: skip
    merged = {**defaults, **kwargs}
    ratio = merged.get("pan_and_scan_min_ratio_to_activate")
    if isinstance(ratio, int) and not isinstance(ratio, bool):
        merged["pan_and_scan_min_ratio_to_activate"] = float(ratio)
    for key in ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops"):
        value = merged.get(key, getattr(image_processor, key, None))
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return merged


def gemma3_tokens_per_image(hf_config: Any) -> int:
    """Soft tokens of one image (or pan-and-scan crop): ``mm_tokens_per_image``, 256 where
    the config leaves it out (transformers' default)."""
    return int(hf_config.get("mm_tokens_per_image", 256))


class Gemma3ImageTokens:
    """Gemma 3's image sequences in token ids.

    Args:
        hf_config: the model's config (``boi_token_index``, ``eoi_token_index``,
            ``image_token_index``, ``mm_tokens_per_image``).
        tokenizer: returns the model's tokenizer (called on first use).
    """

    def __init__(self, hf_config: Any, tokenizer: Callable[[], Any]) -> None:
        self.boi_token_id = int(hf_config.get("boi_token_index", 255_999))
        self.eoi_token_id = int(hf_config.get("eoi_token_index", 256_000))
        token = hf_config.get("image_token_index", hf_config.get("image_token_id"))
        self.image_token_id = int(token if token is not None else 262_144)
        self.tokens_per_image = gemma3_tokens_per_image(hf_config)
        self._tokenizer = tokenizer
        self._replacements: dict[int, tuple[list[int], list[tuple[int, int]]]] = {}
        self._joins_cache: dict[int, bool] = {}

    def replacement(self, num_crops: int) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids that replace one ``<start_of_image>`` of an image with ``num_crops``
        pan-and-scan crops, and the ``(start, length)`` of each of its ``1 + num_crops``
        soft-token runs in them (the original image first)."""
        cached = self._replacements.get(num_crops)
        if cached is not None:
            return cached
        tok = self._tokenizer()
        boi, eoi, soft = tok.convert_ids_to_tokens(
            [self.boi_token_id, self.eoi_token_id, self.image_token_id]
        )
        sequence = f"\n\n{boi}{soft * self.tokens_per_image}{eoi}\n\n"
        text = sequence
        if num_crops:
            text = (f"Here is the original image {sequence} and here are some crops to help "
                    "you see better " + " ".join([sequence] * num_crops))  # fmt: skip
        ids = list(tok.encode(text, add_special_tokens=False))
        runs = []
        i = 0
        while i < len(ids):
            if ids[i] == self.image_token_id:
                start = i
                while i < len(ids) and ids[i] == self.image_token_id:
                    i += 1
                runs.append((start, i - start))
            else:
                i += 1
        if len(runs) != 1 + num_crops or any(n != self.tokens_per_image for _, n in runs):
            raise ValueError(
                f"the tokenizer does not write {soft!r} as one token (id {self.image_token_id})"
            )
        self._replacements[num_crops] = (ids, runs)
        return ids, runs

    def append(self, ids: list[int], more: Sequence[int]) -> None:
        """``ids.extend(more)``, the text that meets at the junction (the tokens up to an
        added token on either side) tokenized again together, as transformers' tokenizer
        sees it in one text."""
        left = len(ids)
        while left > 0 and self._joins(ids[left - 1]):
            left -= 1
        right = 0
        while right < len(more) and self._joins(more[right]):
            right += 1
        if left == len(ids) or right == 0:
            ids.extend(more)
            return
        tok = self._tokenizer()
        text = tok.decode(ids[left:] + list(more[:right]), clean_up_tokenization_spaces=False)
        del ids[left:]
        ids.extend(tok.encode(text, add_special_tokens=False))
        ids.extend(more[right:])

    def _joins(self, token_id: int) -> bool:
        """Whether the tokenizer may write the token's text together with the text beside
        it: any token but an added one (added tokens split the text), newline runs
        included."""
        joins = self._joins_cache.get(token_id)
        if joins is None:
            tok = self._tokenizer()
            added = getattr(tok, "added_tokens_decoder", None) or {}
            text = tok.decode([token_id])
            joins = self._joins_cache[token_id] = token_id not in added or (
                bool(text) and set(text) == {"\n"}
            )
        return joins

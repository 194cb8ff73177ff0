"""InputProcessor: a user's prompt and SamplingParams -> validated EngineCoreRequests.

Text prompts are tokenized here (with the tokenizer's default special tokens, e.g. a BOS,
as vLLM does), lengths and token ids are checked against the model, and parallel sampling
(``n > 1`` / ``best_of``) is fanned out into child requests (see parallel_sampling.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.core.engine_io import EngineCoreRequest
from tokenmill.engine.parallel_sampling import child_request_id, make_child_params, needs_fan_out
from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.embeds import is_embeds
from tokenmill.multimodal.inputs import MultiModalFeature, without_data
from tokenmill.multimodal.media import MediaError
from tokenmill.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    BeamSearchParams,
    SamplingParams,
    SamplingParamsError,
)
from tokenmill.tokenizer import encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tokenmill.config import ModelConfig, SchedulerConfig

# A prompt: text, token ids, or a dict with "prompt" (text) or "prompt_token_ids"
# (optionally "cache_salt", and "multi_modal_data": {"image": a PIL image or a list of them}).
PromptType = str | list[int] | dict[str, Any]


class InvalidRequestError(ValueError):
    """A request cannot be served as given; ``param`` names the offending field, if one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ProcessedRequest:
    """A validated request, ready to be registered with the OutputProcessor and the core.

    Attributes:
        request_id: the user-facing id.
        prompt: the prompt text, or None when token ids were given.
        prompt_token_ids: the prompt's token ids.
        params: the request's sampling parameters (a copy of the user's, with EOS ids set).
        engine_requests: what to submit to the core: one request, or ``best_of`` children
            with ids ``f"{i}_{request_id}"``.
        arrival_time: ``time.time()`` when the request was accepted (seconds).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    engine_requests: list[EngineCoreRequest]
    arrival_time: float


def whole_image_budget(scheduler_config: SchedulerConfig) -> int | None:
    """The most placeholder tokens one image may take under ``scheduler_config``: the step
    budget where images are never split over chunks (``disable_chunked_mm_input``), else
    None (an image larger than a step is split)."""
    if scheduler_config.disable_chunked_mm_input:
        return scheduler_config.max_num_batched_tokens
    return None


def truncate_prompt(
    prompt_ids: list[int], k: int, max_model_len: int, max_tokens: int | None
) -> list[int]:
    """The prompt's last ``k`` tokens (vLLM's ``truncate_prompt_tokens``, left truncation);
    ``k = -1`` keeps as many as leave room for ``max_tokens`` (for one token when None).
    A prompt of at most ``k`` tokens is returned as it is.

    Raises:
        InvalidRequestError: ``k`` other than -1 or 1..max_model_len - 1.
    """
    if k == -1:
        k = max(1, max_model_len - max(1, max_tokens or 1))
    elif not 1 <= k < max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens must be -1 or between 1 and {max_model_len - 1} (the "
            f"model's context, {max_model_len} tokens, minus one to generate), got {k}.",
            "truncate_prompt_tokens",
        )
    return prompt_ids[-k:] if len(prompt_ids) > k else prompt_ids


class InputProcessor:
    """Turns prompts into EngineCoreRequests, rejecting what the model cannot serve.

    Args:
        model_config: the served model (vocabulary size, context length, EOS ids).
        tokenizer: the model's tokenizer.
        max_logprobs: the most logprobs a request may ask for per position (-1: no limit).
        max_num_seqs: the most sequences the engine runs at once (a beam search's width
            may not exceed it); None: no limit.
        pipeline_parallel_size: the engine's pipeline stages (beam search needs one).
        speculative: the engine runs speculative decoding (beam search is refused then).
        max_image_tokens: the most placeholder tokens one image may take, where the
            scheduler never splits an image over two chunks (``whole_image_budget``); an
            image needing more is a 400. None: no such bound.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: PreTrainedTokenizerBase,
        max_logprobs: int,
        max_num_seqs: int | None = None,
        pipeline_parallel_size: int = 1,
        speculative: bool = False,
        max_image_tokens: int | None = None,
    ) -> None:
        self.model_config = model_config
        self.max_image_tokens = max_image_tokens
        self.speculative = speculative
        self.pipeline_parallel_size = pipeline_parallel_size
        self.max_num_seqs = max_num_seqs
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs
        self.vocab_size = model_config.vocab_size
        self.max_model_len = model_config.max_model_len
        self.eos_token_ids = self._resolve_eos_ids()
        self.mm_processor = None
        mm = model_config.multimodal_config
        if mm is not None:
            from tokenmill.config import ConfigError
            from tokenmill.multimodal.config import MultiModalConfigError
            from tokenmill.multimodal.processor import MultiModalProcessor

            try:
                self.mm_processor = MultiModalProcessor(
                    model_config.model, model_config.hf_config, mm.limit_per_prompt,
                    mm.processor_kwargs, tokenizer,
                )  # fmt: skip
            except MultiModalConfigError as e:  # e.g. a tokenizer without the layout's tokens
                raise ConfigError(str(e)) from None
            self.mm_processor.preload()

    def process_multimodal(
        self,
        prompt_ids: list[int],
        mm_data: Any,
        param: str = "multi_modal_data",
        load: Callable[[Any], Any] | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Expand a prompt's image placeholders and process its images with the model's
        image processor, one image at a time, stopping once the prompt reaches the context
        length (CPU work: callers on an event loop run it in a thread).

        Args:
            prompt_ids: the prompt with one placeholder token per image.
            mm_data: ``{"image": image or [images]}`` (``PIL.Image.Image``, or what
                ``load`` turns into one).
            param: the request field named in errors.
            load: loads each image just before it is processed (see
                ``MultiModalProcessor.process``).

        Raises:
            InvalidRequestError: the model takes no images, another modality, or a bad
                image (see ``MultiModalProcessor.process``).
        """
        if not isinstance(mm_data, dict) or set(mm_data) - {"image"}:
            raise InvalidRequestError(
                "multi_modal_data must be a dict with an 'image' key (a PIL image or a list "
                "of them).",
                param,
            )
        images = mm_data.get("image")
        images = [] if images is None else images
        embeds = is_embeds(images) or (isinstance(images, (list, tuple))
                                       and any(is_embeds(x) for x in images))  # fmt: skip
        if not embeds:
            images = list(images) if isinstance(images, (list, tuple)) else [images]
        if self.mm_processor is None:
            if not embeds and not images:
                return prompt_ids, []
            raise InvalidRequestError(
                f"The model {self.model_config.served_model_name} does not take images.", param
            )
        try:
            if embeds:
                images = self.mm_processor.split_embeds(images)
            return self.mm_processor.process(prompt_ids, images, self.max_model_len, load)
        except MediaError as e:
            raise InvalidRequestError(f"Invalid image input: {e}.", param) from None

    def _check_mm_features(self, prompt_ids: list[int], features: Any) -> list[MultiModalFeature]:
        """Processed images given with a prompt (``mm_features``: one, or a list), as a list
        checked against the prompt: the engine reads each one's placeholder range of it.

        Raises:
            InvalidRequestError: the model takes no images, or the features are not
                ``MultiModalFeature`` objects whose ranges cover exactly the prompt's image
                placeholders, in order.
        """
        if self.mm_processor is None:
            raise InvalidRequestError(
                f"The model {self.model_config.served_model_name} does not take images.",
                "mm_features",
            )
        image_id = self.mm_processor.image_token_id
        # Tokens an image's range may hold: its image tokens, and for some layouts the row
        # breaks the model fills itself (Mistral 3's [IMG_BREAK] / [IMG_END]).
        allowed = self.mm_processor.feature_token_ids
        features = list(features) if isinstance(features, (list, tuple)) else [features]
        end = 0
        inside = 0
        for f in features:
            if not isinstance(f, MultiModalFeature) or f.modality != "image":
                raise InvalidRequestError(
                    "mm_features must be a list of image MultiModalFeature objects, got "
                    f"{type(f).__name__}.",
                    "mm_features",
                )
            if not (isinstance(f.offset, int) and isinstance(f.length, int)
                    and end <= f.offset and f.length > 0 and f.end <= len(prompt_ids)
                    and all(t in allowed for t in prompt_ids[f.offset : f.end])):  # fmt: skip
                raise InvalidRequestError(
                    f"mm_features: the image at offset {f.offset!r} (length {f.length!r}) "
                    "does not cover image placeholder tokens of the prompt, after the "
                    "previous image.",
                    "mm_features",
                )
            end = f.end
            inside += prompt_ids[f.offset : f.end].count(image_id)
        if prompt_ids.count(image_id) != inside:
            raise InvalidRequestError(
                f"mm_features cover {inside} of the prompt's "
                f"{prompt_ids.count(image_id)} image placeholder tokens.",
                "mm_features",
            )
        return features

    def _check_whole_images(self, features: list[MultiModalFeature]) -> None:
        """Raises InvalidRequestError for an image with more placeholders than a step
        computes: it could never be scheduled whole."""
        assert self.max_image_tokens is not None
        for i, f in enumerate(features):
            if f.length > self.max_image_tokens:
                raise InvalidRequestError(
                    f"image {i} takes {f.length} tokens, more than the "
                    f"{self.max_image_tokens} a step computes (--max-num-batched-tokens), and "
                    "an image's tokens are computed in one step here",
                    "multi_modal_data",
                )

    def _check_no_image_tokens(self, prompt_ids: list[int]) -> None:
        """Raises InvalidRequestError for a prompt without images that holds image
        tokens: they would run the model on the placeholder token's own embedding."""
        if self.mm_processor is not None and self.mm_processor.image_token_id in prompt_ids:
            raise InvalidRequestError(
                f"the prompt holds the image placeholder token "
                f"(id {self.mm_processor.image_token_id}) but no image was given.", "prompt"
            )

    def _resolve_eos_ids(self) -> list[int]:
        ids = list(self.model_config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in ids:
            ids.append(int(tok_eos))
        return ids

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the defaults of the model's generation_config.json."""
        return SamplingParams.from_generation_config(self.model_config.generation_config)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
        validate_max_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Tokenize and validate one request and build its EngineCoreRequests.

        Args:
            request_id: the user-facing id (unique among live requests).
            prompt: text, token ids, or ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``
                (optionally with ``"cache_salt"``).
            params: sampling parameters, or a beam search's; not modified (the request gets
                a copy).
            arrival_time: ``time.time()`` of arrival (seconds); now if None.
            priority: scheduling priority (lower runs earlier).
            validate_max_tokens: reject prompt + max_tokens beyond the context (the API
                server); when False, generation just stops at the context length (offline).
            lora_request: the LoRA adapter to run with (None: the base model).

        Returns:
            The ProcessedRequest.

        Raises:
            InvalidRequestError: a priority outside 64-bit integers, an empty prompt,
                token ids outside the vocabulary, prompt or prompt + max_tokens longer than
                the context, stop strings without detokenization, allowed_token_ids that
                are all banned (one-token bad words, stop tokens under min_tokens).
            SamplingParamsError: more logprobs than allowed, or token ids in the sampling
                parameters outside the vocabulary.
        """
        if not (isinstance(priority, int) and INT64_MIN <= priority <= INT64_MAX):
            # The engine's messages carry it as a 64-bit integer.
            raise InvalidRequestError(
                f"priority must be a 64-bit signed integer, got {priority!r}.", "priority"
            )
        if isinstance(params, BeamSearchParams):
            if self.model_config.logprobs_mode.endswith("logits"):
                # A beam's score sums its tokens' logprobs; logits would not add up to one.
                raise InvalidRequestError(
                    "beam search needs logprobs, and this server returns logits "
                    f"(--logprobs-mode {self.model_config.logprobs_mode}).", "use_beam_search"
                )
            if lora_request is not None:
                # Forked beams do not carry the adapter: refuse rather than decode with the
                # base model.
                raise InvalidRequestError(
                    "beam search is not implemented with LoRA adapters.", "model"
                )
            return self._process_beam_search(
                request_id, prompt, params, arrival_time, priority, validate_max_tokens
            )
        text, prompt_ids, cache_salt = self._tokenize(prompt)
        mm_features = None
        if isinstance(prompt, dict):
            mm_features = prompt.get("mm_features")
            if prompt.get("multi_modal_data") is not None:
                prompt_ids, mm_features = self.process_multimodal(
                    prompt_ids, prompt["multi_modal_data"]
                )
            elif mm_features:
                mm_features = self._check_mm_features(prompt_ids, mm_features)
        if not mm_features:
            self._check_no_image_tokens(prompt_ids)
        if mm_features and self.max_image_tokens is not None:
            self._check_whole_images(mm_features)
        if mm_features and params.truncate_prompt_tokens is not None:
            raise InvalidRequestError(
                "truncate_prompt_tokens cannot be used with images (it could cut an image's "
                "placeholder tokens).",
                "truncate_prompt_tokens",
            )
        if params.truncate_prompt_tokens is not None:
            kept = truncate_prompt(
                prompt_ids, params.truncate_prompt_tokens, self.max_model_len, params.max_tokens
            )
            if len(kept) < len(prompt_ids):
                text, prompt_ids = None, kept  # the text no longer matches the tokens
        self._validate_prompt(prompt_ids, params, validate_max_tokens)
        params = self._validate_params(params)
        arrival = time.time() if arrival_time is None else arrival_time

        def core_request(
            req_id: str, req_params: SamplingParams, features=mm_features
        ) -> EngineCoreRequest:
            return EngineCoreRequest(
                request_id=req_id,
                prompt_token_ids=prompt_ids,
                sampling_params=req_params,
                arrival_time=arrival,
                priority=priority,
                cache_salt=cache_salt,
                mm_features=features or None,
                lora_request=lora_request,
            )

        if needs_fan_out(params):
            assert params.best_of is not None
            # The first child carries the images' data; the core gives it to the others
            # (``SharedImageData``), so the pixels cross to the core once, not best_of times.
            engine_requests = [
                core_request(child_request_id(i, request_id), make_child_params(params, i),
                             mm_features if i == 0 else without_data(mm_features))
                for i in range(params.best_of)
            ]  # fmt: skip
        else:
            engine_requests = [core_request(request_id, params)]
        return ProcessedRequest(request_id, text, prompt_ids, params, engine_requests, arrival)

    def _process_beam_search(
        self,
        request_id: str,
        prompt: PromptType,
        params: BeamSearchParams,
        arrival_time: float | None,
        priority: int,
        validate_max_tokens: bool,
    ) -> ProcessedRequest:
        """``process`` for a beam search: one engine request whose steps return the
        ``max(2, 1 + number of EOS tokens) * beam_width`` candidates of each beam.

        Raises:
            InvalidRequestError: as ``process``, a beam width above ``max_num_seqs`` or
                with more candidates than the vocabulary has tokens, or an engine with
                pipeline stages or speculative decoding.
        """
        if self.speculative:
            # Drafts are verified per sequence; beams fork between the steps that verify.
            raise InvalidRequestError(
                "beam search is not implemented with speculative decoding (--speculative-config)."
            )
        if self.pipeline_parallel_size > 1:
            # Beams fork and drop sequences between steps; the pipeline's micro-batches in
            # flight do not follow a fork.
            raise InvalidRequestError(
                "beam search is not implemented with pipeline parallelism "
                f"(--pipeline-parallel-size {self.pipeline_parallel_size})."
            )
        if isinstance(prompt, dict) and (
            prompt.get("multi_modal_data") is not None or prompt.get("mm_features")
        ):
            # Beams fork from a running request's blocks; the encoder cache and the image
            # placeholders are not carried across forks.
            raise InvalidRequestError(
                "beam search does not take images (multi_modal_data).", "multi_modal_data"
            )
        text, prompt_ids, cache_salt = self._tokenize(prompt)
        self._check_no_image_tokens(prompt_ids)
        width = params.beam_width
        if self.max_num_seqs is not None and width > self.max_num_seqs:
            raise InvalidRequestError(
                f"beam_width {width} is larger than the engine's --max-num-seqs "
                f"({self.max_num_seqs}): every beam is a running sequence.",
                "n",
            )
        num_eos = 0 if params.ignore_eos else len(self.eos_token_ids)
        num_candidates = max(2, 1 + num_eos) * width
        if num_candidates > self.vocab_size:
            raise InvalidRequestError(
                f"beam_width {width} needs {num_candidates} candidate tokens per step, more "
                f"than the vocabulary's {self.vocab_size}.",
                "n",
            )
        sampling = params.engine_sampling_params(num_candidates)
        sampling.eos_token_ids = list(self.eos_token_ids)
        self._validate_prompt(prompt_ids, sampling, validate_max_tokens)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=sampling,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            beam_search=params,
        )
        return ProcessedRequest(
            request_id, text, prompt_ids, sampling, [request], request.arrival_time
        )

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's token ids as it would start the text and as it would follow a space
        (tokenizers give most words a different token there), without duplicates."""
        sequences: dict[tuple[int, ...], None] = {}  # ordered, without duplicates
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = encode_prompt(self.tokenizer, text, add_special_tokens=False)
                if ids:
                    sequences[tuple(ids)] = None
        return [list(ids) for ids in sequences]

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        cache_salt = None
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
            if prompt.get("prompt_token_ids") is not None:
                return (
                    prompt.get("prompt"),
                    self._as_token_ids(prompt["prompt_token_ids"]),
                    (cache_salt),
                )
            if "prompt" not in prompt:
                raise InvalidRequestError(
                    "A prompt dict needs a 'prompt' (text) or 'prompt_token_ids' key, "
                    f"got keys {sorted(prompt)}.",
                    "prompt",
                )
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, encode_prompt(self.tokenizer, prompt), cache_salt
        if isinstance(prompt, (list, tuple)):
            return None, self._as_token_ids(prompt), cache_salt
        raise InvalidRequestError(
            f"A prompt must be a string, a list of token ids or a dict, got "
            f"{type(prompt).__name__}.",
            "prompt",
        )

    @staticmethod
    def _as_token_ids(ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise InvalidRequestError("prompt_token_ids must be a list of integers.", "prompt")
        return list(ids)

    def _validate_prompt(
        self, prompt_ids: list[int], params: SamplingParams, validate_max_tokens: bool
    ) -> None:
        if not prompt_ids:
            raise InvalidRequestError(
                "The prompt is empty: it must contain at least one token.", "prompt"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"Prompt token id(s) {bad[:5]} are out of the vocabulary: the model has "
                f"{self.vocab_size} tokens (ids 0 to {self.vocab_size - 1}).",
                "prompt",
            )
        num_prompt, max_len = len(prompt_ids), self.max_model_len
        too_long = params.max_tokens is not None and num_prompt + params.max_tokens > max_len
        if validate_max_tokens and too_long:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {num_prompt + params.max_tokens} tokens ({num_prompt} in the "
                f"prompt, {params.max_tokens} in the completion). Please reduce the length "
                f"of the prompt or completion.",
                "max_tokens",
            )
        if num_prompt >= max_len:
            # NOTE: a prompt of exactly max_model_len tokens leaves no position to generate in.
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"prompt has {num_prompt} tokens, which leaves no room for the completion "
                f"(at least 1 token). Please reduce the length of the prompt.",
                "prompt",
            )

    def _validate_params(self, params: SamplingParams) -> SamplingParams:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value == -1 and 0 <= self.max_logprobs < self.vocab_size:
                raise SamplingParamsError(
                    f"Requested {name}=-1 (the whole vocabulary, {self.vocab_size} tokens) "
                    f"but at most {self.max_logprobs} are allowed (--max-logprobs).",
                    name,
                )
        if params.stop and not params.detokenize:
            raise InvalidRequestError(
                "Stop strings need detokenize=True (they are matched on the text).", "stop"
            )
        params = params.clone()
        params.eos_token_ids = list(self.eos_token_ids)
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        limit = self.max_logprobs if self.max_logprobs >= 0 else self.vocab_size
        params.verify_for_model(self.vocab_size, limit)
        if params.structured_outputs is not None:
            from tokenmill.structured_output import validate

            validate(params.structured_outputs)
            if params.allowed_token_ids is not None:
                # Two masks whose intersection can empty out mid-output: no token left.
                raise InvalidRequestError(
                    "allowed_token_ids cannot be combined with an output constraint "
                    "(structured outputs).",
                    "allowed_token_ids",
                )
        if params.allowed_token_ids is not None:
            # Tokens never sampled at the first step: one-token bad words, and stop tokens
            # under min_tokens.
            banned = {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
            if params.min_tokens:
                banned |= params.all_stop_token_ids
            if set(params.allowed_token_ids) <= banned:
                raise InvalidRequestError(
                    "Every allowed token is a one-token bad word, or a stop or EOS token "
                    "that min_tokens keeps from being sampled: no token could be sampled.",
                    "allowed_token_ids",
                )
        return params

"""Mistral 3 (Mistral Small 3.1's architecture: Pixtral tower, 2x2 patch merger, Mistral),
and Pixtral-12B's (the tower and Mistral in a LLaVA, no merger), against transformers on
the same random weights (float32, CPU): the prompt's ids as PixtralProcessor writes them
(rows of [IMG] closed by [IMG_BREAK] / [IMG_END]), the log-probs of every prompt position
and of 16 greedy tokens, for prompts with one and with two images of other sizes and
aspect ratios; and the encoder cache on a repeated image."""

from __future__ import annotations

import pytest
import torch

from tests.model.vlm_checkpoints import random_image, write_mistral3
from tests.model.vlm_parity import (
    PARITY_PARAMS,
    assert_matches_transformers,
    assert_repeated_image_hits_the_encoder_cache,
    chat_content,
    parity_llm,
    transformers_model,
)
from tokenmill.entrypoints.llm import LLM

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["mistral3", "pixtral_llava"])
def checkpoint(request, tmp_path_factory) -> str:
    llava = request.param == "pixtral_llava"
    return write_mistral3(str(tmp_path_factory.mktemp(request.param)), llava=llava)


def _unit(checkpoint: str) -> int:
    """Pixels a side of one image token: 14-pixel patches, merged 2x2 by Mistral 3."""
    return 14 if "pixtral_llava" in checkpoint else 28


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers_model(checkpoint)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return parity_llm(checkpoint)


def _hf_inputs(checkpoint: str, text: str, images: list) -> dict:
    """transformers' inputs: the image processor's pixels (resized to multiples of an
    image token's side, as PixtralProcessor asks) and the prompt's [IMG] expanded as
    PixtralProcessor writes it (built here: that class needs torchvision)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    unit = _unit(checkpoint)
    processed = AutoImageProcessor.from_pretrained(checkpoint)(
        images=images, patch_size={"height": unit, "width": unit}, return_tensors="pt"
    )  # fmt: skip
    img, brk, end = tok.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    sizes = iter(processed["image_sizes"].tolist())
    ids: list[int] = []
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        if t != img:
            ids.append(t)
            continue
        h, w = next(sizes)
        rows = ([img] * (w // unit) + [brk]) * (h // unit)
        ids.extend(rows[:-1] + [end])
    return dict(input_ids=torch.tensor([ids]), pixel_values=processed["pixel_values"],
                image_sizes=processed["image_sizes"])  # fmt: skip


CASES = {
    "one image": ([(0, 112, 84)], ["image", "What is in the picture?"]),
    "two images": ([(1, 60, 100), (2, 150, 40)], ["First:", "image", "second:", "image", "?"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_and_greedy_tokens_match_transformers(case, checkpoint, hf_model, llm):
    specs, parts = CASES[case]
    images = [random_image(*s) for s in specs]
    out = llm.chat([{"role": "user", "content": chat_content(parts, images)}], PARITY_PARAMS,
                   use_tqdm=False)[0]  # fmt: skip
    if case == "one image" and _unit(checkpoint) == 28:  # 112 x 84: 4 rows of 3 tokens
        tok = llm.get_tokenizer()
        img, brk, end = tok.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
        run = ([img] * 3 + [brk]) * 3 + [img] * 3 + [end]
        start = out.prompt_token_ids.index(img)
        assert out.prompt_token_ids[start : start + 16] == run
    assert_matches_transformers(out, hf_model, _hf_inputs(checkpoint, out.prompt, images))


def test_repeated_image_hits_the_encoder_cache(llm):
    assert_repeated_image_hits_the_encoder_cache(llm, 84, 112)


def test_a_tokenizer_without_the_row_tokens_is_refused_in_one_line(checkpoint, tmp_path):
    """A Mistral 3 folder whose tokenizer lacks [IMG_BREAK] cannot lay out images: the
    engine refuses it at start-up, naming the token."""
    import shutil

    from tests.model.vlm_checkpoints import byte_tokenizer
    from tokenmill.config import ConfigError

    folder = shutil.copytree(checkpoint, tmp_path / "m3")
    byte_tokenizer(["<s>", "</s>", "[INST]", "[/INST]", "[IMG]"], bos_token="<s>",
                   eos_token="</s>").save_pretrained(folder)  # fmt: skip
    with pytest.raises(ConfigError, match=r"no \[IMG_BREAK\] token"):
        LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=256)

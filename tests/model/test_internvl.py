"""InternVL (transformers' form; Qwen2 and Qwen3 language models) against transformers on the same
random weights (float32, CPU): the prompt's ids as InternVLProcessor writes them (``<img>``,
4 context tokens per tile, ``</img>``; 1 to 4 tiles and a thumbnail by aspect ratio), the
log-probs of every prompt position and of 16 greedy tokens, for prompts with one and two
images; and the encoder cache on a repeated image."""

from __future__ import annotations

import pytest
import torch

from tests.model.vlm_checkpoints import random_image, write_internvl
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


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp(f"internvl_{request.param}"))
    return write_internvl(folder, text_model=request.param)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers_model(checkpoint)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return parity_llm(checkpoint)


def _hf_inputs(checkpoint: str, text: str, images: list) -> dict:
    """transformers' inputs: the tiling image processor's pixels and the prompt's
    ``<IMG_CONTEXT>`` expanded as InternVLProcessor does."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    processed = AutoImageProcessor.from_pretrained(checkpoint)(
        images=images, crop_to_patches=True, return_tensors="pt"
    )  # fmt: skip
    ctx, start, end = tok.convert_tokens_to_ids(["<IMG_CONTEXT>", "<img>", "</img>"])
    tiles = iter(processed["num_patches"].tolist())
    ids: list[int] = []
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        ids.extend([start, *[ctx] * (4 * next(tiles)), end] if t == ctx else [t])
    return dict(input_ids=torch.tensor([ids]), pixel_values=processed["pixel_values"])


CASES = {
    "one image": ([(0, 100, 60)], ["image", "What is in the picture?"]),
    "two images": ([(1, 56, 56), (2, 40, 150)], ["First:", "image", "second:", "image", "?"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_and_greedy_tokens_match_transformers(case, checkpoint, hf_model, llm):
    specs, parts = CASES[case]
    images = [random_image(*s) for s in specs]
    out = llm.chat([{"role": "user", "content": chat_content(parts, images)}], PARITY_PARAMS,
                   use_tqdm=False)[0]  # fmt: skip
    assert_matches_transformers(out, hf_model, _hf_inputs(checkpoint, out.prompt, images))


def test_repeated_image_hits_the_encoder_cache(llm):
    assert_repeated_image_hits_the_encoder_cache(llm, 80, 120)


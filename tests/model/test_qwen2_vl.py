"""Qwen2-VL against transformers on the same random weights (float32, CPU): the log-probs
of every prompt position and of 16 greedy tokens, for prompts with one and with two images
(the checks of ``test_qwen2_5_vl.py`` on the earlier vision tower)."""

from __future__ import annotations

import pytest

from tests.model.test_qwen2_5_vl import CASES, _hf_inputs
from tests.model.vlm_checkpoints import random_image, write_qwen2_vl
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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_qwen2_vl(str(tmp_path_factory.mktemp("qwen2_vl")))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers_model(checkpoint)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return parity_llm(checkpoint)


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_and_greedy_tokens_match_transformers(case, checkpoint, hf_model, llm):
    specs, parts = CASES[case]
    images = [random_image(*s) for s in specs]
    out = llm.chat([{"role": "user", "content": chat_content(parts, images)}], PARITY_PARAMS,
                   use_tqdm=False)[0]  # fmt: skip
    assert_matches_transformers(out, hf_model, _hf_inputs(checkpoint, hf_model, out.prompt, images))


def test_repeated_image_hits_the_encoder_cache(llm):
    assert_repeated_image_hits_the_encoder_cache(llm, 224, 224)


"""Qwen3-VL against transformers on the same random weights (float32, CPU): the log-probs
of every prompt position and of 16 greedy tokens, for prompts with one and with two images
(the checks of ``test_qwen2_5_vl.py``: interleaved M-RoPE, QK-norm, 16-pixel patches with
learned position embeddings, and DeepStack features added after the first decoder layers),
over the dense language model and the MoE one (Qwen3-VL-MoE)."""

from __future__ import annotations

import pytest

from tests.model.test_qwen2_5_vl import CASES, _hf_inputs
from tests.model.vlm_checkpoints import random_image, write_qwen3_vl
from tests.model.vlm_parity import (
    PARITY_PARAMS,
    assert_matches_transformers,
    assert_repeated_image_hits_the_encoder_cache,
    chat_content,
    parity_llm,
    transformers_model,
)
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["dense", "moe"])
def checkpoint(request, tmp_path_factory) -> str:
    moe = request.param == "moe"
    return write_qwen3_vl(str(tmp_path_factory.mktemp(f"qwen3_vl_{request.param}")), moe=moe)


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


def test_moe_experts_load_from_the_released_orientation(checkpoint, llm, tmp_path):
    """The released Qwen3-VL-MoE checkpoints store each layer's experts as ``x @ W``
    (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``); transformers 5 saves them the
    other way round. Both load to the same model."""
    if "moe" not in checkpoint:
        pytest.skip("dense language model")
    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(checkpoint, tmp_path / "released")
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    released = LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=256)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    prompt = {"prompt_token_ids": list(range(40, 60))}
    ours = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    theirs = released.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert ours.token_ids == theirs.token_ids
    for a, b, tok in zip(ours.logprobs, theirs.logprobs, ours.token_ids, strict=True):
        assert a[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-5)

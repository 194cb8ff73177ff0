"""Adapters of fused checkpoint projections: Phi-3 stores q/k/v as one ``qkv_proj`` and
gate/up as one ``gate_up_proj``, so peft's adapters of it target those (one A, B over every
part's output features). Greedy tokens against transformers + peft on a tiny random Phi-3."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_phi3_parity import _config
from tests.model.test_qwen3_parity import save_random_model
from tokenmill import SamplingParams
from tokenmill.lora.request import LoRARequest

pytestmark = pytest.mark.slow
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13, 14]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(model folder, adapter folder, peft model): the adapter targets all of Phi-3's
    projections, fused ones included, with random non-zero A and B."""
    from peft import LoraConfig, get_peft_model

    path = tmp_path_factory.mktemp("phi3")
    hf = save_random_model(_config("phi3"), path, {"lm_head": 30.0})
    torch.manual_seed(1)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(hf, config)
    adapter = tmp_path_factory.mktemp("phi3-adapter")
    model.save_pretrained(adapter)
    return str(path), str(adapter), model.eval()


def _peft_tokens(model, prompt: list[int], adapter: bool) -> list[int]:
    ids = torch.tensor([prompt])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                  do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    with torch.no_grad():
        if adapter:
            return model.generate(ids, **kwargs)[0, len(prompt):].tolist()
        with model.disable_adapter():
            return model.generate(ids, **kwargs)[0, len(prompt):].tolist()


@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2}], ids=["tp1", "tp2"])
def test_a_fused_projection_adapter_matches_peft(phi3, smollm2_gguf_path, layout):
    """With two ranks, each keeps its heads' rows of every part of the fused B."""
    from tokenmill import LLM

    path, adapter, model = phi3
    # The tiny model has no tokenizer of its own; SmolLM2's decodes ids below its vocab.
    llm = LLM(path, tokenizer=smollm2_gguf_path, dtype="float32", device="cpu",
              kv_cache_memory=16 << 20, max_model_len=128, enable_lora=True,
              max_lora_rank=8, **layout)  # fmt: skip
    lora = LoRARequest("phi3", 1, adapter)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS * 2]
    loras = [lora] * len(PROMPTS) + [None] * len(PROMPTS)  # adapter and base in one batch
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    finally:
        llm.llm_engine.shutdown()
    for i, out in enumerate(outputs):
        prompt, with_adapter = PROMPTS[i % len(PROMPTS)], loras[i] is not None
        assert list(out.outputs[0].token_ids) == _peft_tokens(model, prompt, with_adapter)
    # the adapter changes the output
    assert outputs[0].outputs[0].token_ids != outputs[len(PROMPTS)].outputs[0].token_ids

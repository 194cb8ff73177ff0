"""Speculative decoding through the Triton attention kernels, run by Triton's interpreter on
CPU: verify steps (a request's last token and its drafts as one short query over its paged
context) and an EAGLE head's passes (ragged first pass, then decode passes that rotate and
write their KV inside the decode kernel) give the greedy tokens of the torch backend without
speculation (float32)."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter only (tests/gpu covers CUDA)", allow_module_level=True)

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.model.attention import selector  # noqa: E402
from tokenmill.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tokenmill.worker import model_runner  # noqa: E402
from tokenmill.worker.proposers import model_proposer  # noqa: E402

pytestmark = pytest.mark.slow


def _tokens(target, tokenizer, prompts, backend, monkeypatch, spec=None):
    monkeypatch.setattr(model_runner, "get_attn_backend", lambda device, **kw: backend)
    monkeypatch.setattr(model_proposer, "get_attn_backend", lambda device, **kw: backend)
    extra = {"speculative_config": spec} if spec else {}
    llm = LLM(target, tokenizer=tokenizer, max_model_len=128, kv_cache_memory=8 << 20,
              max_num_batched_tokens=32, **extra)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.counters.spec_decoding


def test_verify_steps_and_eagle_passes_on_the_triton_kernels(
    tiny_target, eagle_head, smollm2_gguf_path, monkeypatch
):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 60, (9,), generator=g).tolist() * 2 for _ in range(2)]
    args = (tiny_target, smollm2_gguf_path, prompts)
    reference, _ = _tokens(*args, selector.get_attn_backend("cpu"), monkeypatch)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
             "prompt_lookup_min": 1}  # fmt: skip
    eagle = {"method": "eagle", "model": eagle_head, "num_speculative_tokens": 2}
    for spec in (ngram, eagle):
        tokens, counters = _tokens(*args, TritonAttentionBackend, monkeypatch, spec)
        assert tokens == reference and counters.num_drafts > 0, spec["method"]

"""Speculative decoding on the real SmolLM2, end to end through ``LLM``: greedy outputs are
token for token those without speculation (n-gram lookup; SmolLM2 as its own draft, as is
and perturbed), on repetitive and non-repetitive prompts; logprobs are the target's;
penalties and stop strings see the same tokens; preemption in the middle of speculation
leaks no block."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

PROMPTS = [
    # repetitive: the answer copies the prompt (n-gram lookup's load)
    "Copy this list exactly, one item per line: apple, banana, cherry, date, elderberry, "
    "fig, grape, apple, banana, cherry, date, elderberry, fig, grape.",
    "Rewrite this sentence in the same words: The quick brown fox jumps over the lazy dog. "
    "The quick brown fox jumps over the lazy dog.",
    # not repetitive
    "Write a short story about a robot who learns to paint.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# float32 weights (GGUF dequantized), where greedy output is exact; a draft from the same
# file follows the target's choice.
KV = dict(kv_cache_memory=96 << 20, max_model_len=512, max_num_batched_tokens=128,
          gguf_dequantize=True)  # fmt: skip


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _check_no_blocks_held(llm: LLM) -> None:
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def _proposer(llm: LLM):
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    return runner.spec_decode.proposer


@pytest.fixture(scope="module")
def plain(smollm2_gguf_path):
    return LLM(smollm2_gguf_path, **KV)


@pytest.fixture(scope="module")
def reference(plain):
    return _tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def ngram(smollm2_gguf_path):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}  # fmt: skip
    return LLM(smollm2_gguf_path, speculative_config=spec, **KV)


@pytest.fixture(scope="module")
def draft(smollm2_gguf_path):
    spec = {"model": smollm2_gguf_path, "num_speculative_tokens": 3}
    return LLM(smollm2_gguf_path, speculative_config=spec, **KV)


def test_ngram_greedy_tokens_are_the_plain_ones(ngram, reference):
    before = ngram.llm_engine.counters.spec_decoding.num_accepted_tokens
    assert _tokens(ngram.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    stats = ngram.llm_engine.counters.spec_decoding
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > before  # the copies hit
    _check_no_blocks_held(ngram)


def test_the_model_as_its_own_draft_accepts_everything(draft, reference):
    stats = draft.llm_engine.counters.spec_decoding
    assert _tokens(draft.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    _check_no_blocks_held(draft)


def test_a_perturbed_draft_is_rejected_at_times_and_changes_nothing(draft, reference):
    module = _proposer(draft).module
    generator = torch.Generator().manual_seed(0)
    saved = {n: p.clone() for n, p in module.named_parameters() if "mlp" in n}
    try:
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name in saved:
                    noise = torch.randn(param.shape, generator=generator)
                    param.add_(noise * 0.5 * param.std())
        stats = draft.llm_engine.counters.spec_decoding
        drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
        out = draft.generate(PROMPTS[1:], GREEDY, use_tqdm=False)
        assert _tokens(out) == reference[1:]
        drafted, accepted = stats.num_draft_tokens - drafted, stats.num_accepted_tokens - accepted
        assert 0 < accepted < drafted
    finally:
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name in saved:
                    param.copy_(saved[name])
    _check_no_blocks_held(draft)


def test_logprobs_are_the_targets(ngram, plain):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = plain.generate(PROMPTS[:1], params, use_tqdm=False)
    out = ngram.generate(PROMPTS[:1], params, use_tqdm=False)
    for a, b in zip(ref, out, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for token in la:
                assert la[token].rank == lb[token].rank
                assert abs(la[token].logprob - lb[token].logprob) < 1e-3


def test_penalties_and_stop_strings_see_the_same_tokens(ngram, plain):
    params = [
        SamplingParams(temperature=0, max_tokens=16, presence_penalty=0.8,
                       frequency_penalty=0.3, ignore_eos=True),  # fmt: skip
        SamplingParams(temperature=0, max_tokens=32, stop=["cherry"], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True),
    ]
    prompts = [PROMPTS[0]] * 3
    ref = plain.generate(prompts, params, use_tqdm=False)
    out = ngram.generate(prompts, params, use_tqdm=False)
    assert _tokens(out) == _tokens(ref)
    assert [o.outputs[0].text for o in out] == [o.outputs[0].text for o in ref]


def test_structured_outputs_run_beside_speculation_without_drafts(ngram):
    choices = ["apple pie", "banana bread"]
    params = [
        SamplingParams(temperature=0, max_tokens=8,
                       structured_outputs=StructuredOutputsParams(choice=choices)),  # fmt: skip
        GREEDY,
    ]
    out = ngram.generate([PROMPTS[0], PROMPTS[1]], params, use_tqdm=False)
    assert out[0].outputs[0].text in choices
    _check_no_blocks_held(ngram)


def test_preemption_mid_speculation_leaks_no_block(smollm2_gguf_path, reference):
    # 7 blocks of 16 tokens: the three requests need 4, 3 and 2 blocks with their 16
    # outputs. Admission headroom off: it would keep one waiting instead of preempting.
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}  # fmt: skip
    llm = LLM(smollm2_gguf_path, speculative_config=spec, kv_cache_memory=7 * block_bytes,
              max_model_len=7 * 16, max_num_batched_tokens=64, gguf_dequantize=True)  # fmt: skip
    engine = llm.llm_engine
    engine.engine_core.scheduler.headroom = None
    assert engine.engine_core.scheduler.kv_cache_manager.num_blocks == 7
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.engine_core.check_integrity()
    assert [results[str(i)] for i in range(len(PROMPTS))] == reference
    assert engine.counters.num_preemptions > 0
    assert engine.counters.spec_decoding.num_drafts > 0
    _check_no_blocks_held(llm)


def test_a_target_and_draft_kept_in_their_gguf_blocks_speculate(smollm2_gguf_path):
    # Both keep their GGUF blocks (the default); the CPU's int4 products run in bfloat16,
    # so only the mechanics are checked here, not token equality.
    spec = {"model": smollm2_gguf_path, "num_speculative_tokens": 2}
    llm = LLM(smollm2_gguf_path, speculative_config=spec, kv_cache_memory=32 << 20,
              max_model_len=256)  # fmt: skip
    assert llm.llm_engine.config.speculative_config.draft_model_config.quantization == "gguf"
    out = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [len(t) for t in _tokens(out)] == [16, 16]
    stats = llm.llm_engine.counters.spec_decoding
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    _check_no_blocks_held(llm)

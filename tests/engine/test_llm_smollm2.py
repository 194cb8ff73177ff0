"""The offline engine on the real SmolLM2: continuous batching, chunked prefill, preemption,
prefix caching and sampling, end to end through ``LLM``."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

# bytes of one KV block of SmolLM2 in float32: 30 layers x K,V x 16 tokens x 3 heads x 64 dims x 4
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4


def _prompts(n: int) -> list[str]:
    topics = ["the sea", "a robot", "Paris", "mathematics", "a small dog", "the moon", "coffee"]
    return [
        f"Write a sentence about {topics[i % len(topics)]}."
        + " Please be brief and clear." * (i % 5)
        + f" Number {i}."
        for i in range(n)
    ]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _scheduler(llm: LLM):
    return llm.llm_engine.engine_core.scheduler


def _counters(llm: LLM):
    """A copy of the engine's running totals (prefix-cache queries/hits, preemptions)."""
    import dataclasses

    return dataclasses.replace(llm.llm_engine.counters)


# The engines here load float32 weights (gguf_dequantize=True), whose greedy output follows
# the float32 reference; the model kept in its blocks (bfloat16 products) has its own checks
# in tests/engine/test_gguf_quantized.py, batch independence included.


@pytest.fixture(scope="module")
def llm(smollm2_gguf_path):
    """A small-budget engine: 8 running requests, 64 tokens per step."""
    return LLM(
        smollm2_gguf_path,
        gguf_dequantize=True,
        kv_cache_memory=256 << 20,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_batched_greedy_equals_alone(llm):
    prompts = _prompts(64)
    batched = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in batched)
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert _tokens(batched) == _tokens(alone)
    kv = _scheduler(llm).kv_cache_manager
    kv.check_integrity()
    assert kv.usage == 0.0


def test_preemption_with_a_tiny_cache(llm, smollm2_gguf_path):
    long_prompts = [p * 3 for p in _prompts(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = _tokens(llm.generate(long_prompts, params, use_tqdm=False))
    tiny = LLM(
        smollm2_gguf_path,
        gguf_dequantize=True,
        kv_cache_memory=12 * BLOCK_BYTES,
        max_model_len=12 * 16,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    scheduler = _scheduler(tiny)
    assert scheduler.kv_cache_manager.num_blocks == 12
    engine = tiny.llm_engine
    for i, p in enumerate(long_prompts):
        engine.add_request(str(i), p, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        scheduler.kv_cache_manager.check_integrity()
    assert [results[str(i)].outputs[0].token_ids for i in range(8)] == reference
    assert engine.counters.num_preemptions > 0
    assert scheduler.kv_cache_manager.usage == 0.0
    assert scheduler.kv_cache_manager.num_free_blocks == 12


def test_prefix_cache_hits_and_same_output(llm, smollm2_gguf_path):
    tokenizer = llm.get_tokenizer()
    prefix = tokenizer.encode(" ".join(f"Fact {i}: the sky is blue." for i in range(40)))[:200]
    assert len(prefix) == 200
    first = prefix + tokenizer.encode(" Question one: what colour is the sky?")
    second = prefix + tokenizer.encode(" Question two: is grass green?")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm.reset_prefix_cache()
    llm.generate({"prompt_token_ids": first}, params, use_tqdm=False)
    before = _counters(llm)
    out = llm.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    after = _counters(llm)
    full_blocks = 200 // 16 * 16
    assert after.prefix_cache_hits - before.prefix_cache_hits == full_blocks
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(second)
    assert out.num_cached_tokens == full_blocks
    no_cache = LLM(
        smollm2_gguf_path,
        gguf_dequantize=True,
        kv_cache_memory=64 << 20,
        max_model_len=1024,
        enable_prefix_caching=False,
    )
    ref = no_cache.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("Tell me about the ocean.", params, use_tqdm=False)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 5
    mixed = llm.generate(
        ["Hello there"] * 3 + ["Tell me about the ocean."] + ["Hi"] * 2,
        others[:3] + [params] + others[3:],
        use_tqdm=False,
    )
    assert mixed[3].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = SamplingParams(
        temperature=0.9, top_p=0.95, seed=99, max_tokens=16, ignore_eos=True
    )
    different = llm.generate("Tell me about the ocean.", other_seed, use_tqdm=False)[0]
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids


def test_stop_string_split_across_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    pieces = [tokenizer.decode([t]) for t in full.token_ids]
    # a stop string that spans the boundary between two consecutive multi-char tokens
    i = next(
        i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
    )
    stop = pieces[i][-1] + pieces[i + 1][:2]
    cut = full.text.index(stop)
    out = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=30, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == full.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_parallel_sampling_shares_prompt_blocks(llm):
    prompt = "Name a colour: " * 20
    params = SamplingParams(temperature=1.0, n=4, seed=7, max_tokens=8, ignore_eos=True)
    llm.reset_prefix_cache()
    before = _counters(llm)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    hits = _counters(llm).prefix_cache_hits - before.prefix_cache_hits
    assert len(out.outputs) == 4 and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    prompt_len = len(out.prompt_token_ids)
    # the 3 siblings scheduled after the first reuse its full prompt blocks
    assert hits == 3 * (prompt_len // 16 * 16)


def test_best_of_returns_highest_cumulative_logprob(llm):
    params = SamplingParams(
        temperature=1.0, n=2, best_of=5, seed=3, max_tokens=6, ignore_eos=True, logprobs=0
    )
    out = llm.generate("Pick a number:", params, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob


def test_logprobs_and_prompt_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids)
    for tok, lp in zip(comp.token_ids, comp.logprobs, strict=False):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(lp) <= 4
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=False):
        assert tok in lp


def test_chat_answers_paris(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    # The rendered conversation is the output's prompt, and its tokens are the prompt's.
    assert out.prompt.endswith("<|im_start|>assistant\n") and "France?" in out.prompt
    assert out.prompt_token_ids == llm.get_tokenizer()(out.prompt, add_special_tokens=False)[
        "input_ids"
    ]


@pytest.mark.parametrize(
    "knob, sizes, num_prompts",
    [
        # Decode graphs: inert rows with slot -1 and no context.
        ("pad_decode_batches_to", [8], 5),
        # Piecewise graphs: trailing token-0 rows at position 0 with slot -1, attention told
        # the real token count, with prompt chunks and decodes mixed in one step.
        ("pad_token_batches_to", [16, 48, 64], 6),
    ],
)
def test_batches_padded_like_cuda_graphs(llm, knob, sizes, num_prompts):
    """The runner's CUDA-graph padding does not change any real request's tokens; checked
    on CPU with eager padded batches (64-token budget)."""
    prompts = _prompts(num_prompts)
    reference = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    setattr(runner, knob, sizes)
    try:
        padded = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        setattr(runner, knob, None)
    assert padded == reference


@pytest.mark.parametrize("pass_name", ["short_chunk_pass", "shared_prefix_pass"])
def test_attention_warm_up_passes_write_nothing(llm, pass_name):
    """The start-up passes that compile attention variants on CUDA (a short chunk after a
    long context; decodes sharing prefix blocks, for cascade attention), run over
    arbitrary blocks, leave the KV cache and later outputs as they were."""
    import torch

    from tokenmill.worker import start_up_passes

    prompts = _prompts(3)
    reference = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    before = [c.clone() for c in runner.kv_caches]
    assert getattr(start_up_passes, pass_name)(runner)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference


def test_plain_decode_warm_up_passes_write_nothing(llm):
    """The start-up passes that compile the decode kernel's tiles on CUDA (decode steps of
    chosen batch sizes and contexts, and cascade steps) leave the KV cache and
    later outputs as they were; the backend on CPU asks for none."""
    import torch

    from tokenmill.worker import start_up_passes

    prompts = _prompts(3)
    reference = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    before = [c.clone() for c in runner.kv_caches]
    assert not start_up_passes.plain_decode_passes(runner)
    assert start_up_passes.plain_decode_passes(runner, cases=[(1, 1), (5, 40)])
    assert start_up_passes.shared_prefix_pass(runner, 5)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference


def test_async_scheduling_matches_sync(llm, smollm2_gguf_path):
    """Overlapped scheduling (one step in flight) changes no token: natural EOS stops,
    stop strings, preemption in a tiny cache, and seeded requests (run in step) mixed in."""
    prompts = [p * 2 for p in _prompts(10)]
    params = [
        SamplingParams(temperature=0, max_tokens=30),  # may stop at EOS
        SamplingParams(temperature=0, max_tokens=30, stop=[" the"]),
        SamplingParams(temperature=0.8, seed=5, max_tokens=12),
    ] * 3 + [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    reference = llm.generate(prompts, params, use_tqdm=False)
    tiny = LLM(
        smollm2_gguf_path,
        gguf_dequantize=True,
        kv_cache_memory=14 * BLOCK_BYTES,
        max_model_len=14 * 16,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        async_scheduling=True,
    )
    out = tiny.generate(prompts, params, use_tqdm=False)
    assert [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in out
    ] == [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in reference
    ]
    assert tiny.llm_engine.counters.num_preemptions > 0
    kv = _scheduler(tiny).kv_cache_manager
    kv.check_integrity()
    assert kv.usage == 0.0


def test_decodes_sharing_a_cached_prefix_get_cascade_metadata(llm, monkeypatch):
    """Eight requests after a cached 300-token prompt prefix decode together: the runner
    finds the shared blocks and passes them to attention (the CPU backend ignores the hint,
    so this checks the plumbing; the Triton kernels are checked in the interpreter and on
    the GPU)."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    prefix = "Here is a long shared system prompt about ships and the sea. " * 25
    prompts = [prefix + f"Question {i}: name a colour." for i in range(8)]
    llm.generate(prompts[0], GREEDY, use_tqdm=False)  # caches the prefix blocks
    reference = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))

    from tests.engine.prefix_probe import record_common_prefix_lens
    from tokenmill.worker import cascade

    monkeypatch.setattr(cascade, "CASCADE_MIN_SAVED_TOKENS", 0)  # 8 x 300 tokens is few
    monkeypatch.setattr(runner, "cascade_attn", True)
    seen = record_common_prefix_lens(runner, monkeypatch)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    shared = [p for p in seen if p]
    assert shared and all(p >= 256 and p % 16 == 0 for p in shared)
    assert max(shared) <= len(llm.get_tokenizer().encode(prefix))


def test_a_request_the_core_refuses_leaves_nothing_behind(llm, monkeypatch):
    """The core refuses the second child of an ``n = 2`` request: ``generate`` raises, the
    first child is aborted and the request unregistered, so the next ``generate`` runs
    (it waited for the refused request's outputs for ever)."""
    engine = llm._generation_engine()
    add = engine.engine_core.add_request
    calls = []

    def refuse_second(request):
        calls.append(request.request_id)
        if len(calls) == 2:
            raise ValueError("refused")
        add(request)

    monkeypatch.setattr(engine.engine_core, "add_request", refuse_second)
    with pytest.raises(ValueError, match="refused"):
        llm.generate("Hello", SamplingParams(n=2, max_tokens=4), use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    assert not engine.engine_core.scheduler.has_unfinished_requests()
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4

"""Greedy decoding through the whole engine against transformers, for the parity tests of
architectures with local attention, sinks and experts.

The engine runs with a KV cache too small for its requests (they are preempted and
recomputed) and with prefix caching (the requests share a prompt prefix that a first
request has left in the cache); every request's 32 greedy tokens must equal transformers'
greedy continuation, computed without a KV cache (a full forward pass per token), and
every KV block must be free at the end.
"""

from __future__ import annotations

import torch

NEW_TOKENS = 32
BLOCK_SIZE = 16


def greedy_reference(hf, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy continuation: ``new_tokens`` ids, each the argmax of a full
    forward pass over the sequence so far."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def parity_prompts(vocab: int, prefix_len: int = 40, seed: int = 3) -> list[list[int]]:
    """Four prompts of 45-60 random ids (below ``vocab``) sharing a ``prefix_len``-token
    prefix: longer than the windows and chunks of the tiny test models."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=gen).tolist()
    tails = [5, 9, 14, 20]
    return [prefix + torch.randint(0, vocab, (n,), generator=gen).tolist() for n in tails]


def assert_engine_greedy_matches(hf, path: str, tokenizer: str, **engine_kwargs) -> None:
    """Run ``parity_prompts`` greedily through ``LLM(path)`` (float32, CPU, a 9-block KV
    cache, prefix caching on) and compare with ``greedy_reference``.

    The first prompt runs alone, then the other three together: their shared prefix is a
    prefix-cache hit, and three requests growing to 5 blocks each cannot all stay in 9
    blocks, so some are preempted and recomputed.
    """
    from tokenmill import LLM, SamplingParams

    config = hf.config
    layers = config.num_hidden_layers
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    block_bytes = layers * 2 * BLOCK_SIZE * kv_heads * head_dim * 4
    llm = LLM(
        path, tokenizer=tokenizer, dtype="float32", device="cpu", kv_cache_memory=9 * block_bytes,
        max_model_len=128, max_num_batched_tokens=64, block_size=BLOCK_SIZE,
        **engine_kwargs,
    )  # fmt: skip
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    # Admit as vLLM does (prompt fits), so growing requests run out of blocks and preempt.
    scheduler.headroom = None
    kv = scheduler.kv_cache_manager
    assert kv.num_blocks == 9
    prompts = parity_prompts(config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = {}
    for batch in ([0], [1, 2, 3]):
        for i in batch:
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[int(out.request_id)] = list(out.outputs[0].token_ids)
            kv.check_integrity()
    assert engine.counters.prefix_cache_hits > 0
    assert engine.counters.num_preemptions > 0
    assert kv.num_free_blocks == kv.num_blocks
    for i, prompt in enumerate(prompts):
        assert results[i] == greedy_reference(hf, prompt), f"prompt {i}"

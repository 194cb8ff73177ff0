"""The KV offload tiers on CPU (float32; the "device" is host memory, so the disk tier is
the one that leaves it): a multi-turn workload larger than the device KV cache gives the
same greedy outputs with the tiers as without, and its second turns load their prefixes
back from the tiers instead of computing them. The model is a 2-layer Llama with random
weights and SmolLM2's tokenizer (``tiny_llama_checkpoints``): the tiers move whole blocks
of every layer, whatever the weights."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

# Bytes of one KV block of the tiny Llama in float32: 2 layers x K,V x 16 tokens x 2 heads x
# 16 x 4.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4
GIB = 1 << 30
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def conversations(n: int) -> list[str]:
    facts = [[f"Fact {i}.{j}: the value is {j * 7 % 13}." for j in range(22)] for i in range(n)]
    return [f"Conversation {i}. " + " ".join(facts[i]) for i in range(n)]


def multi_turn(llm: LLM) -> list[list[int]]:
    """Turn 1 of every conversation, then turn 2 of each (its turn-1 prompt and answer plus
    a follow-up): the device cache holds about two conversations, so by turn 2 the earlier
    prefixes have been evicted from it."""
    firsts = conversations(5)
    outs = llm.generate(firsts, GREEDY, use_tqdm=False)
    seconds = [f + o.outputs[0].text + " And then?" for f, o in zip(firsts, outs, strict=True)]
    tokens = [o.outputs[0].token_ids for o in outs]
    for prompt in seconds:  # one at a time, as a user's next turn arrives
        tokens += [o.outputs[0].token_ids for o in llm.generate(prompt, GREEDY, use_tqdm=False)]
    llm.llm_engine.engine_core.check_integrity()
    return tokens


@pytest.fixture(scope="module")
def model_path(tiny_llama_checkpoints) -> str:
    return tiny_llama_checkpoints[0]


def make_llm(model_path, **kwargs) -> LLM:
    return LLM(
        model_path, dtype="float32", kv_cache_memory=48 * BLOCK_BYTES, max_model_len=512,
        max_num_seqs=4, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def expected(model_path):
    llm = make_llm(model_path)
    tokens = multi_turn(llm)
    assert llm.llm_engine.counters.kv_offload == {}
    return tokens


def test_host_tier_gives_the_same_outputs(model_path, expected):
    llm = make_llm(model_path, kv_offloading_size=256 * BLOCK_BYTES / GIB)
    assert multi_turn(llm) == expected
    stats = llm.llm_engine.counters.kv_offload
    assert stats["host_hit_tokens"] > 0
    assert stats["host_store_bytes"] > 0 and stats["host_load_bytes"] > 0
    assert stats["host_load_bytes"] % BLOCK_BYTES == 0


def test_disk_tier_behind_a_small_host_tier(model_path, expected, tmp_path):
    llm = make_llm(
        model_path,
        kv_offloading_size=16 * BLOCK_BYTES / GIB,
        kv_offloading_disk_path=str(tmp_path),
        kv_offloading_disk_size=256 * BLOCK_BYTES / GIB,
    )
    assert multi_turn(llm) == expected
    stats = llm.llm_engine.counters.kv_offload
    assert stats["disk_hit_tokens"] > 0
    assert stats["disk_store_bytes"] > 0 and stats["disk_load_bytes"] > 0
    # The tier's file is unlinked once open: nothing is left behind, however the engine ends.
    assert not any(p.name.startswith("tokenmill-kv-") for p in tmp_path.iterdir())


def test_offloading_flags_are_checked(model_path, tmp_path):
    from tokenmill.config import ConfigError

    with pytest.raises(ConfigError, match="lmcache"):
        make_llm(model_path, kv_offloading_size=1.0, kv_offloading_backend="lmcache")
    with pytest.raises(ConfigError, match="go together"):
        make_llm(model_path, kv_offloading_size=1.0, kv_offloading_disk_path="/tmp")
    with pytest.raises(ConfigError, match="prefix caching"):
        make_llm(model_path, kv_offloading_size=1.0, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="do not fit"):
        make_llm(
            model_path, kv_offloading_size=1.0, kv_offloading_disk_path=str(tmp_path / "kv"),
            kv_offloading_disk_size=float(1 << 30),
        )  # fmt: skip
    with pytest.raises(ConfigError, match="at least one KV block"):
        make_llm(model_path, kv_offloading_size=1e-6)

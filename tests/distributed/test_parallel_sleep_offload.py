"""Sleep mode, weight updates and the KV offload tiers over several ranks on CPU (gloo, one
process per rank): every rank frees and restores its share, level 2 and ``update_weights``
read each rank's slice of the checkpoint, a failing call is reported without ending the
engine, and the tiers give the tokens of one process. The model is the 2-layer Llama of
``tiny_llama_checkpoints`` (4 heads, 2 KV heads: one KV head per rank at ``-tp 2``)."""

from __future__ import annotations

import pytest

from tests.engine.test_kv_offload_multiturn import BLOCK_BYTES, GIB, multi_turn
from tokenmill import LLM, SamplingParams
from tokenmill.hf_config import ModelLoadError

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3,"]
# One process's KV cache holds 48 blocks; at -tp 2 a rank's share of a block is half as
# large, so the same budget per rank is halved to keep 48 blocks.
ENGINE = dict(dtype="float32", max_model_len=512, max_num_seqs=4)


def tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_llama_checkpoints) -> dict[str, list]:
    """One process's tokens: of each checkpoint, and of the multi-turn offload workload."""
    first, second = tiny_llama_checkpoints
    llm = LLM(first, kv_cache_memory=48 * BLOCK_BYTES, enable_sleep_mode=True, **ENGINE)
    try:
        out = {"first": tokens(llm), "multi_turn": multi_turn(llm)}
        llm.update_weights(second)
        out["second"] = tokens(llm)
    finally:
        llm.llm_engine.shutdown()
    assert out["first"] != out["second"]
    return out


@pytest.fixture(scope="module")
def tp2(tiny_llama_checkpoints):
    llm = LLM(
        tiny_llama_checkpoints[0], tensor_parallel_size=2, enable_sleep_mode=True,
        kv_cache_memory=48 * BLOCK_BYTES // 2, kv_offloading_size=256 * BLOCK_BYTES / GIB,
        **ENGINE,
    )  # fmt: skip
    yield llm
    llm.llm_engine.shutdown()


def test_tp2_sleep_level_1_wakes_up_identical(tp2, reference):
    core = tp2.llm_engine.engine_core
    assert tokens(tp2) == reference["first"]
    awake = core.memory_bytes()  # summed over the 2 ranks
    assert awake["weights"] > 0 and awake["kv_cache"] > 0
    assert not core.executor.is_sleeping()
    tp2.sleep(level=1)
    assert core.memory_bytes() == {"weights": 0, "kv_cache": 0}
    assert core.executor.is_sleeping()
    with pytest.raises(RuntimeError, match="asleep"):
        tp2.generate("Hi", GREEDY, use_tqdm=False)
    tp2.wake_up()
    assert core.memory_bytes() == awake
    assert not core.executor.is_sleeping()
    assert tokens(tp2) == reference["first"]
    core.check_integrity()


def test_tp2_update_weights_and_level_2_reads_the_checkpoint_again(
    tp2, reference, tiny_llama_checkpoints
):
    first, second = tiny_llama_checkpoints
    tp2.update_weights(second)
    assert tokens(tp2) == reference["second"]
    # Level 2 drops the weights: waking reads the model's own checkpoint (the first).
    tp2.sleep(level=2)
    tp2.wake_up()
    assert tokens(tp2) == reference["first"]
    # The training-loop order: drop everything, wake the weights, load new ones, wake the
    # KV cache.
    tp2.sleep(level=2)
    tp2.wake_up(["weights"])
    tp2.update_weights(second)
    tp2.wake_up(["kv_cache"])
    assert tokens(tp2) == reference["second"]
    tp2.update_weights(first)
    assert tokens(tp2) == reference["first"]


def test_tp2_failing_calls_are_reported_and_the_engine_goes_on(tp2, reference, tmp_path):
    # Every rank fails to read the checkpoint: the error keeps its type, the ranks live.
    with pytest.raises(ModelLoadError):
        tp2.update_weights(str(tmp_path / "missing"))
    assert tokens(tp2) == reference["first"]
    # A rank refusing a call (a tag only the engine core checks otherwise) is a ValueError.
    with pytest.raises(ValueError, match="tags"):
        tp2.llm_engine.engine_core.executor.wake_up(["everything"])
    assert tokens(tp2) == reference["first"]


def test_tp2_checkpoint_one_rank_refuses_is_loaded_by_none(
    tp2, reference, tiny_llama_checkpoints, tmp_path
):
    """A q_proj with half its rows would fit rank 0's slice: each rank checks the whole
    part's size, refuses it, and neither loads any of the checkpoint."""
    from safetensors.torch import load_file, save_file

    tp2.update_weights(tiny_llama_checkpoints[0])
    tensors = load_file(f"{tiny_llama_checkpoints[1]}/model.safetensors")
    name = "model.layers.1.self_attn.q_proj.weight"
    tensors[name] = tensors[name][: tensors[name].shape[0] // 2].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"q_proj\.weight.*expected"):
        tp2.update_weights(str(tmp_path / "model.safetensors"))
    assert tokens(tp2) == reference["first"]


def test_tp2_kv_offload_tier_gives_the_tokens_of_one_process(tp2, reference):
    stats = tp2.llm_engine.counters.kv_offload
    hits_before = stats.get("host_hit_tokens", 0)
    assert multi_turn(tp2) == reference["multi_turn"]
    stats = tp2.llm_engine.counters.kv_offload
    assert stats["host_hit_tokens"] > hits_before
    # Both ranks copied their half of each block: the bytes add up to whole blocks.
    assert stats["host_load_bytes"] > 0 and stats["host_load_bytes"] % BLOCK_BYTES == 0


def test_pp2_sleeps_with_micro_batches_in_flight(tiny_llama_checkpoints, reference):
    """Pipeline stages sleep each their layers; the micro-batches in flight when the engine
    falls asleep are collected first, and their requests finish after it wakes."""
    llm = LLM(
        tiny_llama_checkpoints[0], pipeline_parallel_size=2, enable_sleep_mode=True,
        kv_cache_memory=48 * BLOCK_BYTES // 2, max_num_batched_tokens=8, **ENGINE,
    )  # fmt: skip
    try:
        engine = llm.llm_engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"nap-{i}", prompt, GREEDY)
        for _ in range(3):
            engine.step()
        assert engine.engine_core._batches  # micro-batches in flight
        llm.sleep(level=1)
        llm.wake_up()
        results = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = list(out.outputs[0].token_ids)
        assert [results[f"nap-{i}"] for i in range(len(PROMPTS))] == reference["first"]
        llm.sleep(level=2)
        llm.wake_up()
        assert tokens(llm) == reference["first"]
        engine.engine_core.check_integrity()
    finally:
        llm.llm_engine.shutdown()

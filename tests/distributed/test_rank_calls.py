"""How an executor combines its ranks' answers to sleep-mode, weight-update and offload
calls (no processes: a fake executor answers for its ranks)."""

from __future__ import annotations

import pytest

from tokenmill.executor.base import Executor, raise_rank_errors
from tokenmill.hf_config import ModelLoadError


class FakeRanks(Executor):
    """Answers each call with the per-rank results given for it."""

    def __init__(self, answers: dict[str, list]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, tuple]] = []

    def determine_num_blocks(self) -> int:
        return 1

    def initialize_cache(self, num_blocks: int) -> None:
        pass

    def execute_model(self, scheduler_output, grammar_output=None):
        raise NotImplementedError

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.calls.append((method, args))
        return self.answers[method]


def test_answers_are_combined_over_the_ranks():
    ranks = FakeRanks({
        "memory_bytes": [{"weights": 10, "kv_cache": 4}, {"weights": 12, "kv_cache": 4}],
        "is_sleeping": [False, True],
        "kv_offload_slots": [(64, 128), (60, 128)],
        "take_kv_offload_stats": [
            {"host_store_bytes": 100.0, "host_seconds": 0.5},
            {"host_store_bytes": 100.0, "host_seconds": 0.75, "disk_load_bytes": 8.0},
        ],
        "sleep": [None, None],
    })  # fmt: skip
    assert ranks.memory_bytes() == {"weights": 22, "kv_cache": 8}
    assert ranks.is_sleeping()
    assert ranks.kv_offload_slots() == (60, 128)
    # Bytes add up; the ranks copy at the same time, so the seconds are the slowest's.
    assert ranks.take_kv_offload_stats() == {
        "host_store_bytes": 200.0, "host_seconds": 0.75, "disk_load_bytes": 8.0,
    }  # fmt: skip
    ranks.sleep(2)
    assert ranks.calls[-1] == ("sleep", (2,))


def test_weights_load_on_no_rank_when_one_refuses_them():
    """Every rank checks a checkpoint before any loads it (``check_weights``)."""
    from tokenmill.engine.engine_core import EngineCore

    ranks = FakeRanks({
        "check_weights": [None, ("ModelLoadError", "rank 1's slice does not fit")],
        "update_weights": [None, None],
    })  # fmt: skip
    core = EngineCore.__new__(EngineCore)  # only what update_weights reads
    core.executor, core._asleep = ranks, set()
    with pytest.raises(ModelLoadError, match="rank 1's slice"):
        core.update_weights("/checkpoint")
    assert [method for method, _ in ranks.calls] == ["check_weights"]


def test_rank_errors_keep_the_user_error_types():
    raise_rank_errors([None, None])
    with pytest.raises(ValueError, match="the weights are asleep"):
        raise_rank_errors([("ValueError", "the weights are asleep"), None])
    with pytest.raises(ModelLoadError, match="no such folder"):
        raise_rank_errors([None, ("ModelLoadError", "no such folder")])
    with pytest.raises(RuntimeError, match="rank 1 failed: OutOfMemoryError: CUDA out"):
        raise_rank_errors([None, ("OutOfMemoryError", "CUDA out of memory")])
    ranks = FakeRanks({"wake_up": [None, ("RuntimeError", "cuMemCreate failed")]})
    with pytest.raises(RuntimeError, match="rank 1 failed: RuntimeError: cuMemCreate"):
        ranks.wake_up(None)

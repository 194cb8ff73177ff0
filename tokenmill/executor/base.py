"""Executor: runs the worker(s) of an engine — in this process, or one process per device."""

from __future__ import annotations

import abc
import operator

from tokenmill.config import EngineConfig, ParallelConfig
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.scheduler_output import GrammarOutput, SchedulerOutput
from tokenmill.hf_config import ModelLoadError
from tokenmill.lora.peft import LoRAAdapterError
from tokenmill.lora.request import LoRARequest


class Executor(abc.ABC):
    """The engine core's handle on its workers.

    Life cycle: ``__init__`` (loads the model), ``determine_num_blocks``,
    ``initialize_cache(num_blocks)``, then ``execute_model`` per step, ``shutdown``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks that fit on every worker (the minimum over workers)."""

    @abc.abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and warm up (CUDA graphs)."""

    @abc.abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """Run one step; returns the driver worker's output. ``grammar_output`` holds the
        step's grammar bitmasks (structured outputs), if any."""

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ):
        """Launch a step without waiting for its tokens; the returned handle's ``get()``
        gives the ModelRunnerOutput (async scheduling, pipeline micro-batches).
        ``grammar_output`` only where the workers run steps in order (pipeline stages)."""
        raise NotImplementedError(f"{type(self).__name__} does not run steps asynchronously")

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Call ``method(*args)`` on every worker (sleep, wake_up, update_weights, ...);
        returns their results in rank order (vLLM's ``collective_rpc``)."""
        raise NotImplementedError(f"{type(self).__name__} does not call its workers by name")

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load a LoRA adapter into every worker's host memory (a no-op when loaded).

        Raises:
            ValueError: LoRA is off, or the adapter cannot be served (the message says why;
                a worker in this process raises it, a rank of several answers it).
        """
        errors = self.collective_rpc("add_lora", (lora_request,))
        error = next((e for e in errors if e), None)
        if error is not None:
            raise LoRAAdapterError(error)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a LoRA adapter from every worker; False when it was not loaded."""
        return all(self.collective_rpc("remove_lora", (lora_int_id,)))

    # ---- sleep mode and weight updates: every worker, in rank order -----------------------

    def sleep(self, level: int) -> None:
        """Free every worker's weights (level 1: kept on the host; 2: dropped) and KV cache.

        Raises:
            ValueError: sleep mode is off, or an invalid level; RuntimeError: a worker
                failed otherwise (the message names its rank).
        """
        raise_rank_errors(self.collective_rpc("sleep", (level,)))

    def wake_up(self, tags: list[str] | None) -> None:
        """Bring back every worker's weights and/or KV cache (``None``: both).

        Raises:
            ValueError: an unknown tag; RuntimeError: a worker failed (out of memory).
        """
        raise_rank_errors(self.collective_rpc("wake_up", (tags,)))

    def check_weights(self, path: str) -> None:
        """Check on every worker that ``path`` fits its share of the model (its slices, its
        pipeline stage's layers), writing nothing. ``update_weights`` after this: a worker
        checks only its own share, so one must not load while another would refuse.

        Raises:
            ValueError: the weights are asleep; ModelLoadError: the checkpoint cannot be
                read or does not fit the model.
        """
        raise_rank_errors(self.collective_rpc("check_weights", (path,)))

    def update_weights(self, path: str) -> None:
        """Load new weights in place on every worker (each reads its share of ``path``),
        after ``check_weights``.

        Raises:
            ValueError: the weights are asleep; ModelLoadError: the checkpoint cannot be
                read or does not fit the model.
        """
        raise_rank_errors(self.collective_rpc("update_weights", (path,)))

    def is_sleeping(self) -> bool:
        """Whether any worker has its weights or KV cache freed."""
        return any(self.collective_rpc("is_sleeping"))

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes the weights and the KV cache hold now, summed over the workers."""
        total: dict[str, int] = {}
        for per_rank in self.collective_rpc("memory_bytes"):
            for key, value in per_rank.items():
                total[key] = total.get(key, 0) + value
        return total

    # ---- KV offload tiers ------------------------------------------------------------------

    def kv_offload_slots(self) -> tuple[int, int]:
        """Blocks the host and disk tiers hold: every worker holds its share of each block,
        so the fewest any worker has room for (they agree under tensor parallelism)."""
        slots = self.collective_rpc("kv_offload_slots")
        return min(s[0] for s in slots), min(s[1] for s in slots)

    def take_kv_offload_stats(self) -> dict[str, float]:
        """Bytes the workers moved (summed) and seconds they spent (the slowest worker's:
        they copy at the same time) per tier, since the last call."""
        total: dict[str, float] = {}
        for per_rank in self.collective_rpc("take_kv_offload_stats"):
            for key, value in per_rank.items():
                combine = max if key.endswith("_seconds") else operator.add
                total[key] = combine(total.get(key, 0.0), float(value))
        return total

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release workers and devices."""


def raise_rank_errors(results: list) -> None:
    """Raise the first error a worker answered (``RankWorker``: ``(type name, message)``;
    a worker in this process raises its own): ValueError and ModelLoadError keep their
    type (a user's error, the same on every rank), others become RuntimeError naming the
    rank."""
    for rank, error in enumerate(results):
        if error is None:
            continue
        kind, message = error
        if kind == ValueError.__name__:
            raise ValueError(message)
        if kind == ModelLoadError.__name__:
            raise ModelLoadError(message)
        raise RuntimeError(f"rank {rank} failed: {kind}: {message}")


def stage_leaders(parallel_config: ParallelConfig) -> tuple[int, ...]:
    """The ranks that answer a step: the first tensor-parallel rank of each pipeline stage,
    in stage order (the last one's answer carries the tokens; ``merge_stage_outputs``)."""
    tp = parallel_config.tensor_parallel_size
    return tuple(stage * tp for stage in range(parallel_config.pipeline_parallel_size))

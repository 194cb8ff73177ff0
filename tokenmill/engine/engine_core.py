"""EngineCore: the loop of schedule -> execute -> update, in-process.

``EngineCoreProc`` (engine/engine_core_proc.py) runs the same loop in its own process behind
ZMQ sockets for the server. This module stays importable without torch: the executor
(which loads torch) is created through a factory.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.core.engine_io import (
    CONSTRAINT_BUSY_PREFIX,
    CONSTRAINT_FAILURE_PREFIX,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from tokenmill.core.grammar_compilation import (
    WORKER_NICE,
    GrammarCompilation,
    default_num_workers,
)
from tokenmill.core.grammar_masks import GrammarMaskFiller
from tokenmill.core.grammar_workers import WorkerProcess
from tokenmill.core.pipeline_scheduler import PipelineScheduler
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import GrammarOutput, SchedulerOutput
from tokenmill.engine.errors import EngineDeadError
from tokenmill.executor.multiproc import WorkerDiedError
from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.inputs import SharedImageData

logger = logging.getLogger(__name__)

# The longest an idle engine waits for a grammar before looking at its input again (s).
GRAMMAR_WAIT_S = 0.01


def _default_executor(config: EngineConfig):
    """The executor ``--distributed-executor-backend`` names: one worker in this process
    (``uni``), one process per rank (``mp``) or one Ray actor per rank (``ray``)."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "mp":
        from tokenmill.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from tokenmill.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from tokenmill.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)


class EngineCore:
    """Owns the scheduler and the executor; ``step()`` runs one iteration.

    Args:
        config: the resolved engine configuration.
        executor_factory: builds the executor (defaults to one in-process worker).
        log_stats: attach SchedulerStats to every step's outputs.

    Raises:
        ConfigError: the KV cache cannot hold even one request of ``max_model_len``.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor_factory: Callable[[EngineConfig], object] | None = None,
        log_stats: bool = True,
    ) -> None:
        self.config = config
        start = time.perf_counter()
        self.executor = (executor_factory or _default_executor)(config)
        self._images = SharedImageData()
        num_blocks = self._init_kv_cache()
        self._offload = bool(config.cache_config.kv_offloading_bytes)
        self._offload_steps_seen = 0  # KVOffloadManager.num_transfer_steps when last asked
        offload_slots = (
            self.executor.kv_offload_slots() if self._offload else (0, 0)
        )
        # Pipeline parallelism: up to one micro-batch in flight per stage.
        self.num_stages = config.parallel_config.pipeline_parallel_size
        scheduler_cls = PipelineScheduler if self.num_stages > 1 else Scheduler
        lora = config.lora_config
        self.scheduler = scheduler_cls(
            config.scheduler_config,
            config.cache_config,
            num_blocks,
            log_stats=log_stats,
            offload_slots=tuple(offload_slots),
            speculative_config=config.speculative_config,
            max_loras=lora.max_loras if lora is not None else 0,
        )
        # Adapters whose removal waits for the requests that still use them.
        self._lora_removals: set[int] = set()
        self.log_stats = log_stats
        self.async_scheduling = config.scheduler_config.async_scheduling
        # Async scheduling: the step in flight (its plan and its output handle).
        self._pending: tuple[SchedulerOutput, Any] | None = None
        # Pipeline parallelism: the micro-batches in flight, oldest first.
        self._batches: deque[tuple[SchedulerOutput, Any]] = deque()
        self._failed: list[EngineCoreOutput] = []  # requests refused here, to report
        self._asleep: set[str] = set()  # sleep mode: "weights", "kv_cache" while freed
        self._num_constraint_failures = 0  # of those, not yet in a SchedulerStats
        # Set once a worker died or a step failed: the engine cannot run another step, and
        # every later step raises at once rather than spinning on requests that can never
        # be scheduled.
        self._dead_error: Exception | None = None
        sc = config.scheduler_config
        logger.info(
            "Scheduler: %d tokens and %d requests per step, chunked prefill %s, prefill pacing "
            "%s, async scheduling %s",
            sc.max_num_batched_tokens, sc.max_num_seqs,
            "on" if sc.enable_chunked_prefill else "off",
            f"{sc.prefill_pacing_tokens} {sc.prefill_pacing_mode} tokens"
            if sc.prefill_pacing_tokens
            else "off",
            "on" if sc.async_scheduling else "off",
        )  # fmt: skip
        logger.info("Engine core ready in %.1f s", time.perf_counter() - start)
        # Structured outputs' grammars are compiled and their masks filled in worker
        # processes (the tokenizer's table for them is built on a thread, ~1 s), so that
        # a costly constraint cannot stall the running requests.
        self._grammars = GrammarCompilation(
            self._build_grammar_backend, lambda args: _grammar_worker(args, WORKER_NICE)
        )
        self._grammar_masks = GrammarMaskFiller(
            lambda: _grammar_worker(self._grammars.backend.worker_args, 0),
            max_workers=default_num_workers(),
        )

    def _init_kv_cache(self) -> int:
        cc, mc, sc = (
            self.config.cache_config,
            self.config.model_config,
            self.config.scheduler_config,
        )
        num_blocks = self.executor.determine_num_blocks()
        capacity = num_blocks * cc.block_size
        if capacity < mc.max_model_len:
            if self.config.max_model_len_auto:
                mc.max_model_len = sc.max_model_len = capacity
            else:
                raise ConfigError(
                    f"the KV cache holds {capacity} tokens ({num_blocks} blocks of "
                    f"{cc.block_size}), fewer than --max-model-len {mc.max_model_len}: lower "
                    "--max-model-len or give the cache more memory (--kv-cache-memory, "
                    "--gpu-memory-utilization)"
                )
        cc.num_blocks = num_blocks
        self.executor.initialize_cache(num_blocks)
        logger.info(
            "KV cache (%s): %d blocks of %d tokens = %d tokens; maximum concurrency for "
            "%d-token requests: %.2fx",
            cc.cache_dtype if cc.cache_dtype != "auto" else mc.dtype,
            num_blocks,
            cc.block_size,
            capacity,
            mc.max_model_len,
            capacity / mc.max_model_len,
        )
        return num_blocks

    # ---- requests ----------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request (validated by the front end; the scheduler re-checks lengths).

        A request with structured outputs is held back until its grammar compiles
        (``core/grammar_compilation.py``); one whose constraint does not compile finishes
        aborted (the front end checks the constraints, so this is rare).

        Raises:
            ValueError: the scheduler refuses the request (``Scheduler.check_request``), its
                LoRA adapter cannot be served (LoRA off, an unreadable adapter), or an image
                of it came without data that no other request carries.
        """
        # One copy of each image for the requests that carry it (fanned-out children
        # arrive with the first one's data only).
        self._images.share(request.mm_features)
        req = Request.from_engine_core_request(request, self.config.model_config.max_model_len)
        if req.request_id in self._grammars:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if request.lora_request is not None:
            if self.config.lora_config is None:
                raise ValueError("this request names a LoRA adapter, but LoRA is off "
                                 "(--enable-lora)")
            self._lora_removals.discard(request.lora_request.lora_int_id)
            self.executor.add_lora(request.lora_request)
        if request.sampling_params.structured_outputs is None:
            self.scheduler.add_request(req, request.beam_search)
            return
        self.scheduler.check_request(req)
        self._grammars.submit(req)

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammars are ready; report those that failed."""
        ready, failed = self._grammars.take_ready()
        if ready:
            self._grammar_masks.prepare()
        for req in ready:
            self.scheduler.add_request(req)
        for req, error in failed:
            logger.warning("request %s aborted: %s", req.request_id, error)
            # The reason travels as the stop reason: the server answers it with a 400 (a
            # 429 when the compilers were busy).
            reason = str(error)
            if not reason.startswith((CONSTRAINT_FAILURE_PREFIX, CONSTRAINT_BUSY_PREFIX)):
                reason = f"{CONSTRAINT_FAILURE_PREFIX} the constraint failed to compile: {reason}"
            self._failed.append(
                EngineCoreOutput(
                    req.request_id, [], finish_reason=FinishReason.ABORT, stop_reason=reason
                )
            )
            self._num_constraint_failures += 1

    def _build_grammar_backend(self) -> Any:
        from tokenmill.grammar_runtime import GrammarBackend
        from tokenmill.tokenizer import get_tokenizer

        mc = self.config.model_config
        tokenizer = get_tokenizer(mc.model, mc.tokenizer if mc.tokenizer != mc.model else None)
        return GrammarBackend(tokenizer, mc.vocab_size)

    def _grammar_output(self, so: SchedulerOutput) -> GrammarOutput | None:
        """The next-token bitmasks of the requests with structured outputs that sample in
        ``so`` (their whole context computed by it), from their grammars' current state;
        None when no such request samples.

        A grammar whose mask takes too long (``core/grammar_masks.py``) is given up: its
        request samples without a mask, and ``update_from_output`` drops that token and
        finishes the request aborted with the reason.
        """
        requests = self.scheduler.requests
        self._grammar_masks.forget(requests)
        grammars = {}
        for req_id in so.num_scheduled_tokens:
            request = requests[req_id]
            if request.grammar is not None and request.num_computed_tokens >= request.num_tokens:
                grammars[req_id] = request.grammar
        if not grammars:
            return None
        masks, given_up = self._grammar_masks.fill(grammars)
        for req_id, reason in given_up.items():
            grammars[req_id].fail(reason)
        return GrammarOutput(masks)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish requests at once and free their KV blocks (unknown ids are ignored)."""
        request_ids = list(request_ids)
        self._grammars.discard(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        # An unloaded adapter whose last request this was goes now: the engine may not
        # step again before the next request.
        self._remove_unused_loras()

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self._pending is not None
            or bool(self._batches)
            or bool(self._failed)
            or len(self._grammars) > 0
        )

    # ---- the loop ----------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """One iteration: schedule, run the model, turn sampled tokens into outputs.

        With async scheduling the step launched here is collected by the next call: the
        host schedules and processes outputs while the device computes, and the outputs
        returned are those of the previous step.

        Raises:
            WorkerDiedError: a worker died, in this step or an earlier one.
            EngineDeadError: an earlier step failed (vLLM's engine-dead state: a step that
                raised may have left the scheduler and the workers disagreeing about what
                it ran, so no later step is trusted; the served engine core exits there).
        """
        if self._dead_error is not None:
            raise self._dead_error
        try:
            return self._step()
        except WorkerDiedError as e:
            self._dead_error = WorkerDiedError(str(e))
            raise
        except Exception as e:
            self._dead_error = EngineDeadError(
                f"the engine failed in an earlier step ({type(e).__name__}: {e}); "
                "start a new one"
            )
            raise

    def _step(self) -> EngineCoreOutputs:
        if self._asleep:
            return EngineCoreOutputs(timestamp=time.time())
        if len(self._grammars):
            if not self.scheduler.has_unfinished_requests() and self._pending is None:
                # Nothing else to run: wait for a grammar rather than spin.
                self._grammars.wait_any(GRAMMAR_WAIT_S)
            self._admit_compiled()
        if self.num_stages > 1:
            outputs = self._step_pipelined()
        elif self.async_scheduling:
            outputs = self._step_async()
        else:
            outputs = self._step_sync()
        self._remove_unused_loras()
        if self._failed:
            outputs.outputs[:0], self._failed = self._failed, []
        if outputs.scheduler_stats is not None and self._offload:
            self._add_kv_offload_stats(outputs.scheduler_stats)
        if outputs.scheduler_stats is not None:
            # Requests whose grammars compile are waiting too (vLLM's WAITING_FOR_FSM).
            outputs.scheduler_stats.num_waiting_reqs += len(self._grammars)
            outputs.scheduler_stats.num_constraint_failures += self._num_constraint_failures
            self._num_constraint_failures = 0
        return outputs

    def _add_kv_offload_stats(self, stats: SchedulerStats) -> None:
        """The workers' bytes and seconds of the offload copies made since the last call
        that found new ones (the workers count them until asked)."""
        offload = self.scheduler.kv_cache_manager.offload
        if offload is None or offload.num_transfer_steps == self._offload_steps_seen:
            return
        self._offload_steps_seen = offload.num_transfer_steps
        stats.kv_offload_stats.update(self.executor.take_kv_offload_stats())

    def _step_sync(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            # Still tell the worker about finished requests (it drops their state) and
            # about blocks to copy.
            if scheduler_output.has_worker_work:
                self.executor.execute_model(scheduler_output)
            outputs = EngineCoreOutputs(timestamp=time.time())
            if self.log_stats:
                outputs.scheduler_stats = self.scheduler.make_stats()
            return outputs
        grammar_output = self._grammar_output(scheduler_output)
        runner_output = self.executor.execute_model(scheduler_output, grammar_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.timestamp = time.time()
        return outputs

    def _step_async(self) -> EngineCoreOutputs:
        so = self.scheduler.schedule()
        pending, self._pending = self._pending, None
        outputs = EngineCoreOutputs(timestamp=time.time())
        if so.total_num_scheduled_tokens == 0:
            if pending is not None:
                outputs = self._collect(pending)
            if so.has_worker_work:
                self.executor.execute_model(so)  # the worker drops finished requests
            if self.log_stats and outputs.scheduler_stats is None:
                outputs.scheduler_stats = self.scheduler.make_stats()
            return outputs
        requests = self.scheduler.requests
        if any(requests[r].needs_sync_step for r in so.num_scheduled_tokens):
            # Its sampling needs every earlier token on the host: run it in step.
            if pending is not None:
                outputs = self._collect(pending)
            runner_output = self.executor.execute_model(so, self._grammar_output(so))
            return _merge(outputs, self.scheduler.update_from_output(so, runner_output))
        handle = self.executor.execute_model_async(so)
        if pending is not None:
            outputs = self._collect(pending)
        self._pending = (so, handle)
        return outputs

    def _step_pipelined(self) -> EngineCoreOutputs:
        """Pipeline parallelism: launch a micro-batch while a stage is free; collect the
        oldest once every stage has one, or when nothing else is ready
        (``core/pipeline_scheduler.py``)."""
        launched = False
        if len(self._batches) < self.num_stages:
            so = self.scheduler.schedule(self.num_stages - len(self._batches))
            if so.total_num_scheduled_tokens or so.finished_req_ids:
                launched = so.total_num_scheduled_tokens > 0
                # A request is in one micro-batch at a time, so its grammar is at its
                # latest token here. Finished ids travel in order with the steps, so each
                # stage drops a request after its last step there.
                grammar_output = self._grammar_output(so) if launched else None
                self._batches.append((so, self.executor.execute_model_async(so, grammar_output)))
        if self._batches and (not launched or len(self._batches) == self.num_stages):
            return self._collect(self._batches.popleft())
        outputs = EngineCoreOutputs(timestamp=time.time())
        if self.log_stats:
            outputs.scheduler_stats = self.scheduler.make_stats()
        return outputs

    def _collect(self, pending: tuple[SchedulerOutput, Any]) -> EngineCoreOutputs:
        scheduler_output, handle = pending
        outputs = self.scheduler.update_from_output(scheduler_output, handle.get())
        outputs.timestamp = time.time()
        return outputs

    # ---- sleep mode and weight updates --------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def sleep(self, level: int = 1) -> EngineCoreOutputs | None:
        """Free the weights and the KV cache (``worker/sleep_mode.py``). Running requests
        are preempted: they wait, and are computed again after ``wake_up``; so do requests
        added meanwhile.

        Returns:
            The outputs of a step that was still in flight (async scheduling), or None.

        Raises:
            ValueError: sleep mode is off, or an invalid level.
        """
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with --enable-sleep-mode")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._asleep:
            return None
        outputs = self._drop_kv_cache()
        self.executor.sleep(level)
        self._asleep = {"weights", "kv_cache"}
        return outputs

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and/or the KV cache (``None``: both); requests run again
        once both are back.

        Raises:
            ValueError: an unknown tag.
        """
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake-up tags {sorted(unknown)}: use weights, kv_cache")
        if self._asleep:
            self.executor.wake_up(tags)
            self._asleep -= set(tags)

    def update_weights(self, path: str) -> EngineCoreOutputs | None:
        """Load new weights in place (safetensors folder or file, or GGUF). Every rank
        checks the checkpoint first; then the prefix cache is emptied and running requests
        are preempted, so no KV of the old weights is read.

        Returns:
            As ``sleep``.

        Raises:
            ValueError: the weights are asleep.
            ModelLoadError: the checkpoint cannot be read or does not fit the model (the
                weights, the requests and the prefix cache are as they were).
        """
        if "weights" in self._asleep:
            raise ValueError("the weights are asleep: wake them first (tags=['weights'])")
        self.executor.check_weights(path)
        outputs = self._drop_kv_cache()
        self.executor.update_weights(path)
        return outputs

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes the weights and the KV cache hold now (summed over the ranks)."""
        return self.executor.memory_bytes()

    def _drop_kv_cache(self) -> EngineCoreOutputs | None:
        """Finish the steps in flight (async scheduling's, pipeline micro-batches), preempt
        the running requests and empty the prefix cache: nothing may read the KV cache
        after this. The encoder cache is emptied too (the worker drops its outputs with the
        next step): images encoded by the old weights must not be read after
        ``update_weights``."""
        outputs = None
        if self._pending is not None:
            outputs = self._collect(self._pending)
            self._pending = None
        while self._batches:
            collected = self._collect(self._batches.popleft())
            outputs = collected if outputs is None else _merge(outputs, collected)
        self.scheduler.preempt_all()
        reset = self.scheduler.reset_prefix_cache()
        assert reset, "blocks still in use after preempting every request"
        self.scheduler.encoder_cache.reset()
        return outputs
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter into the workers' host memory (checked against the model).

        Raises:
            ValueError: LoRA is off, or the adapter cannot be served.
        """
        if self.config.lora_config is None:
            raise ValueError("LoRA adapters need --enable-lora")
        self._lora_removals.discard(lora_request.lora_int_id)
        self.executor.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter once no live request uses it (at once when none does)."""
        self._lora_removals.add(lora_int_id)
        self._remove_unused_loras()

    def lora_ids_in_use(self) -> tuple[set[int], set[int]]:
        """The adapter ids of the running and of the waiting requests."""
        s = self.scheduler
        running = {r.lora_int_id for r in s.running if r.lora_int_id}
        waiting = {r.lora_int_id for r in s.requests.values() if r.lora_int_id} - running
        return running, waiting

    def _remove_unused_loras(self) -> None:
        if not self._lora_removals:
            return
        running, waiting = self.lora_ids_in_use()
        for lora_id in list(self._lora_removals - running - waiting):
            self._lora_removals.discard(lora_id)
            self.executor.remove_lora(lora_id)

    def check_integrity(self) -> None:
        """Verify the KV cache's bookkeeping (``KVCacheManager.check_integrity``)."""
        self.scheduler.kv_cache_manager.check_integrity()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def check_health(self) -> None:
        """Raise if a worker of the executor is gone (multi-rank executors)."""
        check = getattr(self.executor, "check_health", None)
        if check is not None:
            check()

    def shutdown(self) -> None:
        self._grammars.shutdown()
        self._grammar_masks.shutdown()
        self.executor.shutdown()


def _grammar_worker(args: tuple, nice: int) -> WorkerProcess:
    """A grammar worker process (``grammar_runtime.serve_grammars``) started with ``args``."""
    return WorkerProcess("tokenmill.grammar_runtime:serve_grammars", args, nice=nice)


def _merge(first: EngineCoreOutputs, second: EngineCoreOutputs) -> EngineCoreOutputs:
    """One step's outputs followed by the next's (async mode collecting two at once)."""
    first.outputs.extend(second.outputs)
    first.first_scheduled.update(second.first_scheduled)
    first.scheduler_stats = second.scheduler_stats or first.scheduler_stats
    first.timestamp = second.timestamp or first.timestamp
    return first

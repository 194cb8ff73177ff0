"""The multiprocess executor: one worker process per rank on this node, started and
supervised by the engine core (``--distributed-executor-backend mp``, the default for
more than one rank, as in vLLM).

Each call is pickled once and written to every rank's pipe (a step's ``SchedulerOutput``:
the diff, never the whole batch); ranks run calls in order. A step's tokens come from the
first tensor-parallel rank of the last pipeline stage, the only rank that answers it.
Waiting for an answer also watches every worker process: one that exits ends the wait
with ``WorkerDiedError`` at once, the other ranks are stopped, and the engine fails.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import pickle
import socket
import time
import weakref
from typing import Any

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.core.model_runner_output import ModelRunnerOutput, merge_stage_outputs
from tokenmill.core.scheduler_output import GrammarOutput, SchedulerOutput
from tokenmill.executor.base import Executor, stage_leaders
from tokenmill.executor.worker_proc import check_rank_method, run_worker
from tokenmill.hf_config import ModelLoadError

logger = logging.getLogger(__name__)

# How long one wait for an answer lasts before it looks again (seconds); a dead worker
# ends a wait at once through its process sentinel.
_POLL_S = 1.0


class WorkerDiedError(RuntimeError):
    """A worker process exited, or failed; the engine cannot go on."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for ``torch.distributed``'s rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def raise_rank_error(rank: int, kind: str, message: str) -> None:
    """Raise a rank's start-up or step error in the engine core: configuration and model
    errors keep their type (one-line errors at start-up), others become WorkerDiedError.
    """
    if kind == ConfigError.__name__:
        raise ConfigError(message)
    if kind == ModelLoadError.__name__:
        raise ModelLoadError(message)
    raise WorkerDiedError(f"rank {rank} failed: {kind}: {message}")


class _StepHandle:
    """A step sent to the workers; ``get()`` waits for its ModelRunnerOutput."""

    def __init__(self, executor: MultiprocExecutor, seq: int) -> None:
        self.executor = executor
        self.seq = seq

    def get(self) -> ModelRunnerOutput:
        return merge_stage_outputs(self.executor._wait(set(self.executor.step_ranks), self.seq))


class MultiprocExecutor(Executor):
    """``tensor_parallel_size * pipeline_parallel_size`` worker processes on this node.

    Raises:
        ConfigError, ModelLoadError: a rank failed to start for that reason.
        WorkerDiedError: a worker process exited or failed during start-up.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        pc = config.parallel_config
        self.world_size = pc.world_size
        # The first rank of each stage answers a step (the last stage's: the tokens).
        self.step_ranks = stage_leaders(pc)
        self._seq = 0
        self._results: dict[tuple[int, int], Any] = {}
        self.dead_error: str | None = None
        self._start_workers()
        try:
            layouts = self._wait(set(range(self.world_size)), 0)
        except BaseException:
            self.shutdown()
            raise
        log_layout(config, "mp", layouts)

    def _start_workers(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        level = logging.getLogger().getEffectiveLevel()
        self.procs: list[Any] = []
        self.cmd_conns: list[Any] = []
        self.result_conns: list[Any] = []
        first_device = self.config.parallel_config.data_parallel_rank * self.world_size
        for rank in range(self.world_size):
            cmd_read, cmd_write = ctx.Pipe(duplex=False)
            result_read, result_write = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=run_worker,
                args=(
                    self.config, rank, first_device + rank, init_method, cmd_read,
                    result_write, level,
                ),  # fmt: skip
                name=f"tokenmill-worker-{rank}",
                daemon=True,
            )
            proc.start()
            cmd_read.close()
            result_write.close()
            self.procs.append(proc)
            self.cmd_conns.append(cmd_write)
            self.result_conns.append(result_read)
        # Workers never outlive the executor, however it goes away.
        self._finalizer = weakref.finalize(self, _stop_processes, list(self.procs))

    # ---- calls ---------------------------------------------------------------------------

    def _send(self, method: str, *args: Any, reply_all: bool = True) -> int:
        """Send ``method(*args)`` to every rank (pickled once); returns the call's seq."""
        self.check_health()
        self._seq += 1
        for rank, conn in enumerate(self.cmd_conns):
            reply = reply_all or rank in self.step_ranks
            try:
                conn.send_bytes(pickle.dumps((self._seq, method, args, reply), protocol=5))
            except OSError as e:
                # The process died after the health check above and before it was reaped:
                # reported as that rank's death, as the health check would.
                self._die(f"the worker process of rank {rank} is gone ({type(e).__name__})")
        return self._seq

    def _call(self, method: str, *args: Any) -> list[Any]:
        """Run ``method(*args)`` on every rank; returns their results in rank order."""
        return self._wait(set(range(self.world_size)), self._send(method, *args))

    def _wait(self, ranks: set[int], seq: int) -> list[Any]:
        """The results of call ``seq`` from ``ranks`` (in rank order), reading every answer
        that arrives meanwhile; raises at once if any worker exits or fails."""
        missing = {r for r in ranks if (r, seq) not in self._results}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        conns = {id(conn): rank for rank, conn in enumerate(self.result_conns)}
        while missing:
            ready = multiprocessing.connection.wait(
                [*self.result_conns, *sentinels], timeout=_POLL_S
            )
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    self.procs[rank].join(0.1)  # reap it: its exit code is known
                    if self._drain(rank):  # it said why before it exited
                        continue
                    self._die(
                        f"the worker process of rank {rank} exited unexpectedly (exit code "
                        f"{self.procs[rank].exitcode})"
                    )
                else:
                    self._drain(conns[id(obj)])
            missing = {r for r in ranks if (r, seq) not in self._results}
        return [self._results.pop((r, seq)) for r in sorted(ranks)]

    def _drain(self, rank: int) -> bool:
        """Read every answer rank ``rank`` has sent; False if there was none."""
        conn = self.result_conns[rank]
        got = False
        try:
            while conn.poll():
                seq, ok, payload = pickle.loads(conn.recv_bytes())
                got = True
                if not ok:
                    self._die_with(rank, *payload)
                self._results[(rank, seq)] = payload
        except (EOFError, OSError):
            pass
        return got

    def _die_with(self, rank: int, kind: str, message: str) -> None:
        self.dead_error = f"rank {rank} failed: {kind}: {message}"
        self._kill_workers()
        raise_rank_error(rank, kind, message)

    def _die(self, error: str) -> None:
        self.dead_error = error
        logger.error("%s; stopping the other workers", error)
        self._kill_workers()
        raise WorkerDiedError(error)

    def _kill_workers(self) -> None:
        """Stop every worker now: the others may wait in a collective for the dead one."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        self.shutdown()

    # ---- Executor --------------------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        return min(self._call("determine_num_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self._call("initialize_cache", num_blocks)

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """``RankWorker.<method>(*args)`` on every rank (e.g. ``add_lora``), in rank order.

        Raises:
            NotImplementedError: a method ``RankWorker`` does not serve.
        """
        check_rank_method(type(self).__name__, method)
        return self._call(method, *args)

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output, grammar_output, sync=True).get()

    def execute_model_async(
        self,
        scheduler_output: SchedulerOutput,
        grammar_output: GrammarOutput | None = None,
        sync: bool = False,
    ):
        """Send a step and return at once; the handle's ``get()`` waits for its tokens.
        Steps are collected in the order sent (pipeline micro-batches, async scheduling)."""
        method = "execute_model" if sync else self._async_method
        args: tuple[Any, ...] = (scheduler_output,)
        if method == "execute_model":
            args += (grammar_output,)
        else:
            assert grammar_output is None, "the engine runs steps with grammars in step"
        return _StepHandle(self, self._send(method, *args, reply_all=False))

    @property
    def _async_method(self) -> str:
        # Pipeline stages run steps synchronously (micro-batches overlap them instead);
        # async scheduling launches a step on the device before its tokens are read.
        pc = self.config.parallel_config
        return "execute_model" if pc.pipeline_parallel_size > 1 else "execute_model_async"

    def check_health(self) -> None:
        """Raises WorkerDiedError if a worker process is gone."""
        if self.dead_error is not None:
            raise WorkerDiedError(self.dead_error)
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                self._die(
                    f"the worker process of rank {rank} exited unexpectedly (exit code "
                    f"{proc.exitcode})"
                )

    def shutdown(self) -> None:
        for conn in getattr(self, "cmd_conns", []):
            try:
                conn.send_bytes(pickle.dumps((0, "shutdown", (), False)))
            except (OSError, ValueError):
                pass
            conn.close()
        self.cmd_conns = []
        if hasattr(self, "_finalizer"):
            self._finalizer()


def _stop_processes(procs: list[Any], timeout_s: float = 5.0) -> None:
    """Let the workers exit (they leave on ``shutdown`` or a closed pipe) within
    ``timeout_s``, then kill those still running."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(2)


def log_layout(config: EngineConfig, backend: str, layouts: list[str]) -> None:
    """The start-up log of the parallel layout: sizes, backend and each rank's share."""
    pc = config.parallel_config
    logger.info(
        "Parallel layout: %d ranks (TP %d x PP %d%s), executor %s, %s",
        pc.world_size, pc.tensor_parallel_size, pc.pipeline_parallel_size,
        ", experts spread over the TP ranks" if pc.enable_expert_parallel else "",
        backend, "NCCL" if config.device_config.device == "cuda" else "gloo",
    )  # fmt: skip
    for text in layouts:
        logger.info("  %s", text)

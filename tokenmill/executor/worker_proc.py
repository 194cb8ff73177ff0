"""One rank of a multi-device engine core: its worker and the loop that serves its executor.

``RankWorker`` joins the process groups (``torch.distributed``), builds the rank's ``Worker``
and answers the executor's calls; the multiprocess executor runs it in its own process
(``run_worker``), the Ray executor in a Ray actor. Every rank runs every call, in the order
sent, so their collectives match.

The multiprocess executor's messages travel over two pipes per rank, pickled:

  executor -> rank:  (seq, method, args, reply)   reply: whether this rank answers
  rank -> executor:  (seq, True, result) | (seq, False, (error type name, message))

A rank answers an error whatever ``reply`` says, then exits: the executor ends the engine.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import traceback
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.scheduler_output import GrammarOutput, SchedulerOutput
from tokenmill.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class RankWorker:
    """The worker of global rank ``rank``: process groups, device, model.

    Args:
        config: the engine configuration (the same on every rank).
        rank: global rank, ``pp_rank * tp_size + tp_rank``.
        device_index: the CUDA device this rank uses (ignored on CPU).
        init_method: ``torch.distributed``'s rendezvous (``tcp://host:port``).

    Raises:
        ConfigError, ModelLoadError: as ``Worker`` start-up raises them.
    """

    def __init__(
        self, config: EngineConfig, rank: int, device_index: int, init_method: str
    ) -> None:
        from tokenmill.distributed.parallel_state import init_model_parallel
        from tokenmill.worker.worker import Worker

        pc = config.parallel_config
        cuda = config.device_config.device == "cuda"
        if cuda:
            import torch

            # NCCL binds to the current device when its communicator is made.
            torch.cuda.set_device(device_index)
        init_model_parallel(
            rank,
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
            pc.enable_expert_parallel,
            "nccl" if cuda else "gloo",
            init_method,
        )
        self.rank = rank
        self.worker = Worker(config, rank=device_index)
        self.worker.init_device()
        self.worker.load_model()
        self._pending: Any = None  # an async step whose tokens are not yet sent

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)
        self.worker.warm_up()

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output, grammar_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Any:
        """Launch a step; returns its handle (``get()`` gives the ModelRunnerOutput)."""
        return self.worker.execute_model_async(scheduler_output)

    def add_lora(self, lora_request: LoRARequest) -> str | None:
        """Load a LoRA adapter into this rank's host memory; returns None, or why it cannot
        be served. (Every rank reads the same folder, so all answer alike; an adapter the
        engine refuses must not end the rank, as a raised error would.)"""
        try:
            self.worker.add_lora(lora_request)
        except ValueError as e:
            return str(e)
        return None

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.worker.remove_lora(lora_int_id)

    # ---- sleep mode, weight updates, KV offload tiers -------------------------------------
    # A call that fails here (no sleep mode, weights asleep, an unreadable checkpoint, the
    # device out of memory on waking) answers (error type name, message) rather than
    # raising, which would end the rank: the engine reports it and goes on (every rank
    # reads the same checkpoint and has the same state, so all answer alike).

    def sleep(self, level: int = 1) -> RankError | None:
        return _answer(self.rank, self.worker.sleep, level)

    def wake_up(self, tags: list[str] | None = None) -> RankError | None:
        return _answer(self.rank, self.worker.wake_up, tags)

    def check_weights(self, path: str) -> RankError | None:
        return _answer(self.rank, self.worker.check_weights, path)

    def update_weights(self, path: str) -> RankError | None:
        return _answer(self.rank, self.worker.update_weights, path)

    def is_sleeping(self) -> bool:
        return self.worker.is_sleeping()

    def memory_bytes(self) -> dict[str, int]:
        return self.worker.memory_bytes()

    def kv_offload_slots(self) -> tuple[int, int]:
        return self.worker.kv_offload_slots()

    def take_kv_offload_stats(self) -> dict[str, float]:
        return self.worker.take_kv_offload_stats()

    def layout(self) -> str:
        """This rank's share of the model, for the start-up log."""
        from tokenmill.distributed.parallel_state import (
            get_pipeline_parallel_rank,
            get_tensor_model_parallel_rank,
        )

        runner = self.worker.model_runner
        assert runner is not None
        layers = [m.layer_idx for m in runner.attention_layers()]
        heads = runner.attention_layers()[0] if layers else None
        text = (
            f"rank {self.rank} (TP {get_tensor_model_parallel_rank()}, PP "
            f"{get_pipeline_parallel_rank()}) on {self.worker.device}: layers "
            f"{layers[0]}-{layers[-1]}" if layers else f"rank {self.rank}: no layers"
        )
        if heads is not None:
            text += f", {heads.num_heads} query / {heads.num_kv_heads} KV heads per layer"
        return text + f", {runner.model_weight_bytes() / 2**20:,.1f} MiB of weights"


# A rank's failed call: (error type name, message).
RankError = tuple[str, str]


def _answer(rank: int, method: Any, *args: Any) -> RankError | None:
    """``method(*args)``; None, or the error it raised (logged here, with a traceback when
    it is not a user's error)."""
    from tokenmill.hf_config import ModelLoadError

    try:
        method(*args)
    except (ValueError, ModelLoadError) as e:
        logger.error("rank %d: %s", rank, e)
        return type(e).__name__, str(e)
    except Exception as e:  # noqa: BLE001 - e.g. the device out of memory on waking
        logger.exception("rank %d: %s failed", rank, getattr(method, "__name__", method))
        return type(e).__name__, str(e)
    return None


def check_rank_method(executor: str, method: str) -> None:
    """Raises NotImplementedError unless ``RankWorker`` serves ``method`` (a call it lacks
    would end every rank)."""
    if not callable(getattr(RankWorker, method, None)):
        raise NotImplementedError(f"{executor} does not call {method} on its ranks")


def serve_calls(worker: RankWorker, cmd_conn: Any, result_conn: Any) -> None:
    """Run the executor's calls until it says ``shutdown`` or goes away.

    An async step's tokens are sent once the next call has been launched, or at once when
    no call is waiting: the device works on step n+1 while step n's tokens travel.
    """
    seq = 0
    try:
        while True:
            if worker._pending is not None and not cmd_conn.poll(0):
                _send_pending(worker, result_conn)
            try:
                message = cmd_conn.recv_bytes()
            except (EOFError, OSError):  # the executor is gone
                return
            seq, method, args, reply = pickle.loads(message)
            if method == "shutdown":
                return
            result = getattr(worker, method)(*args)
            if method == "execute_model_async":
                if worker._pending is not None:
                    _send_pending(worker, result_conn)
                worker._pending = (seq, result, reply)
            else:
                _send_result(result_conn, seq, result, reply)
    except Exception as e:
        _send_error(result_conn, seq, e, worker.rank)


def _send_pending(worker: RankWorker, result_conn: Any) -> None:
    seq, handle, reply = worker._pending
    worker._pending = None
    _send_result(result_conn, seq, handle.get(), reply)


def _send_result(result_conn: Any, seq: int, result: Any, reply: bool) -> None:
    if reply:
        result_conn.send_bytes(pickle.dumps((seq, True, result), protocol=pickle.HIGHEST_PROTOCOL))


def _send_error(result_conn: Any, seq: int, error: BaseException, rank: int) -> None:
    from tokenmill.config import ConfigError
    from tokenmill.hf_config import ModelLoadError

    if isinstance(error, (ConfigError, ModelLoadError)):
        logger.error("rank %d failed: %s", rank, error)  # a user error: no traceback
    else:
        logger.error("rank %d failed: %s\n%s", rank, error, traceback.format_exc())
    payload = (type(error).__name__, str(error))
    try:
        result_conn.send_bytes(pickle.dumps((seq, False, payload)))
    except (OSError, ValueError):
        pass


def run_worker(
    config: EngineConfig,
    rank: int,
    device_index: int,
    init_method: str,
    cmd_conn: Any,
    result_conn: Any,
    log_level: int = logging.INFO,
) -> None:
    """Process entry point of one rank (multiprocessing spawn target).

    Answers ``(0, True, layout)`` once the model is loaded, or an error; then serves calls.
    """
    logging.basicConfig(
        level=log_level,
        format=f"%(levelname)s %(asctime)s [rank {rank} %(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    # The engine core decides when to stop: Ctrl-C in a terminal reaches every process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logger.info("Worker process of rank %d started (pid %d)", rank, os.getpid())
    try:
        worker = RankWorker(config, rank, device_index, init_method)
    except Exception as e:
        _send_error(result_conn, 0, e, rank)
        return
    _send_result(result_conn, 0, worker.layout(), True)
    serve_calls(worker, cmd_conn, result_conn)

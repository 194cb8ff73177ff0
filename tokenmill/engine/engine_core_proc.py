"""EngineCoreProc: the engine loop in its own process, talking to the front end over ZMQ.
It runs an ``EngineCore``, or a ``PoolingEngineCore`` for an embedding model.

Tokenizing, detokenizing and HTTP run in the front-end process, so they never stall the
model loop. Messages are msgspec-msgpack encoded; each is a two-frame ZMQ message
``[kind, payload]``:

  front end -> core:  b"add" EngineCoreRequest | b"abort" list[str] | b"utility" [name, args]
  core -> front end:  b"out" EngineCoreOutputs | b"utility" [name, result, error or None]

Start-up (model loading, KV sizing) reports success or failure over a multiprocessing pipe.
A failure in the loop is reported as ``EngineCoreOutputs(engine_error=...)`` before the
process exits, so the front end can fail every live request at once.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import traceback
from collections import Counter
from typing import Any

import msgspec
import zmq

from tokenmill import envs
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.core.engine_io import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from tokenmill.core.grammar_workers import exit_skipping_finalisation
from tokenmill.gc_freeze import freeze_startup_heap
from tokenmill.hf_config import ModelLoadError
from tokenmill.lora.request import LoRARequest

logger = logging.getLogger(__name__)

MSG_ADD, MSG_ABORT, MSG_UTILITY = b"add", b"abort", b"utility"
MSG_OUT = b"out"

_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
_ids_decoder = msgspec.msgpack.Decoder(list[str])
_encoder = msgspec.msgpack.Encoder()


class _StepLog:
    """Debug aid (TOKENMILL_LOG_STEP_STATS=1): step durations, output counts and the Triton
    kernels compiled while serving (each one stalls a step), every 5 s."""

    INTERVAL_S = 5.0

    def __init__(self, paths: Counter[str] | None = None) -> None:
        self.durations: list[float] = []
        self.outputs = 0
        self.last = time.monotonic()
        self.compiled: list[str] = []
        # The steps by the path that ran them (``StepGraphs.paths``) where the model runs in
        # this process; emptied at each log line.
        self.paths = paths
        try:
            import triton
        except ImportError:
            return
        triton.knobs.runtime.jit_post_compile_hook = self._on_compile

    def _on_compile(self, *args: Any, **kwargs: Any) -> None:
        fn = kwargs.get("fn")
        self.compiled.append(getattr(fn, "name", "?"))

    def record(self, duration_s: float, num_outputs: int) -> None:
        self.durations.append(duration_s)
        self.outputs += num_outputs
        if time.monotonic() - self.last >= self.INTERVAL_S:
            d = sorted(self.durations)
            logger.info(
                "Engine steps: %d in %.1f s, mean %.2f ms, p50 %.2f ms, max %.2f ms, "
                "%.1f request outputs per step; kernels compiled: %s",
                len(d), time.monotonic() - self.last, 1e3 * sum(d) / len(d),
                1e3 * d[len(d) // 2], 1e3 * d[-1], self.outputs / len(d),
                ", ".join(self.compiled) or "none",
            )
            if self.paths:
                logger.info("Engine step paths: %s", ", ".join(
                    f"{name} {count}" for name, count in self.paths.most_common()))
                self.paths.clear()
            self.durations, self.outputs, self.last = [], 0, time.monotonic()
            self.compiled = []


def _step_paths(core: Any) -> Counter[str] | None:
    """The model runner's count of steps by path, where the worker runs in this process
    (one GPU) and has CUDA graphs; None elsewhere."""
    worker = getattr(getattr(core, "executor", None), "worker", None)
    graphs = getattr(getattr(worker, "model_runner", None), "graphs", None)
    return None if graphs is None else graphs.paths


class EngineCoreProc:
    """Runs an EngineCore behind a PULL (input) and a PUSH (output) socket.

    Args:
        config: the engine configuration.
        input_address: ZMQ address the front end pushes requests to.
        output_address: ZMQ address the front end pulls outputs from.
    """

    # Wait this long for input when idle, so signals are noticed promptly (seconds).
    IDLE_POLL_S = 0.5

    def __init__(self, config: EngineConfig, input_address: str, output_address: str) -> None:
        from tokenmill.engine.engine_core import EngineCore
        from tokenmill.engine.pooling_core import PoolingEngineCore

        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.bind(input_address)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.connect(output_address)
        self.engine_core: EngineCore | PoolingEngineCore
        if config.model_config.is_pooling_model:
            self.engine_core = PoolingEngineCore(config)
        else:
            self.engine_core = EngineCore(config, log_stats=not config.disable_log_stats)
        self.running = True
        self.step_log = _StepLog(_step_paths(self.engine_core)) if envs.log_step_stats() else None
        # Data parallelism: tags every output, so the front end knows which core sent it.
        self.engine_index = config.parallel_config.data_parallel_rank

    def ready_info(self) -> dict[str, Any]:
        """What the front end needs after start-up (the core may have resized the context)."""
        config = self.engine_core.config
        return {
            "status": "ready",
            "max_model_len": config.model_config.max_model_len,
            "num_blocks": config.cache_config.num_blocks,
        }

    def _handle(self, kind: bytes, payload: bytes) -> None:
        core = self.engine_core
        if kind == MSG_ADD:
            request = _request_decoder.decode(payload)
            try:
                core.add_request(request)
            except ValueError as e:
                # The front end checked the request; what remains (an adapter folder gone
                # since it was loaded) ends this request, not the engine.
                logger.warning("request %s refused: %s", request.request_id, e)
                out = EngineCoreOutput.refused(request.request_id, str(e))
                self.output.send_multipart(
                    [MSG_OUT, _encoder.encode(EngineCoreOutputs(outputs=[out]))]
                )
        elif kind == MSG_ABORT:
            core.abort_requests(_ids_decoder.decode(payload))
        elif kind == MSG_UTILITY:
            name, args = msgspec.msgpack.decode(payload)
            try:
                reply = [name, self._utility(name, args), None]
            except Exception as e:  # the caller gets the error; the engine keeps serving
                logger.warning("%s failed: %s: %s", name, type(e).__name__, e)
                reply = [name, None, f"{type(e).__name__}: {e}"]
            self.output.send_multipart([MSG_UTILITY, _encoder.encode(reply)])
        else:
            logger.error("unknown message kind %r", kind)

    def _utility(self, name: str, args: list[Any]) -> Any:
        if name == "reset_prefix_cache":
            return self.engine_core.reset_prefix_cache()
        if name == "ping":
            return "pong"
        if name == "add_lora":  # -> None, or why the adapter cannot be served
            try:
                self.engine_core.add_lora(msgspec.convert(args[0], LoRARequest))
            except ValueError as e:
                return str(e)
            return None
        if name == "remove_lora":
            self.engine_core.remove_lora(int(args[0]))
            return True
        if name == "check_integrity":
            self.engine_core.check_integrity()
            return True
        if name in ("sleep", "update_weights"):
            outputs = getattr(self.engine_core, name)(*args)
            if outputs is not None and outputs.outputs:
                self.output.send_multipart([MSG_OUT, _encoder.encode(outputs)])
            return True
        if name == "wake_up":
            self.engine_core.wake_up(*args)
            return True
        if name == "is_sleeping":
            return self.engine_core.is_sleeping
        if name == "memory_bytes":
            return self.engine_core.memory_bytes()
        raise ValueError(f"unknown utility {name!r}")

    def _drain_input(self, block: bool) -> None:
        timeout = int(self.IDLE_POLL_S * 1000) if block else 0
        if not self.input.poll(timeout):
            return
        while True:
            try:
                kind, payload = self.input.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(kind, payload)

    def run(self) -> None:
        """Loop until stopped: take input, step while there is work, send outputs."""
        core = self.engine_core
        parent = os.getppid()
        while self.running:
            had_work = core.has_unfinished_requests() and not core.is_sleeping
            self._drain_input(block=not had_work)
            if os.getppid() != parent:  # the front end died without stopping us
                logger.error("the front-end process is gone; the engine exits")
                return
            if core.is_sleeping:
                continue  # requests wait for wake_up
            if not core.has_unfinished_requests():
                # Idle: a worker process that died is noticed within a poll.
                core.check_health()
                if had_work and core.log_stats:
                    # Aborts emptied the engine: report it, or metrics would keep the
                    # last busy snapshot until the next request.
                    idle = EngineCoreOutputs(
                        timestamp=time.time(),
                        scheduler_stats=core.scheduler.make_stats(),
                        engine_index=self.engine_index,
                    )
                    self.output.send_multipart([MSG_OUT, _encoder.encode(idle)])
                continue
            start = time.perf_counter()
            outputs = core.step()
            if self.step_log is not None:
                self.step_log.record(time.perf_counter() - start, len(outputs.outputs))
            if outputs.outputs or outputs.scheduler_stats is not None:
                outputs.engine_index = self.engine_index
                self.output.send_multipart([MSG_OUT, _encoder.encode(outputs)], copy=False)

    def report_error(self, error: str) -> None:
        try:
            out = EngineCoreOutputs(
                timestamp=time.time(), engine_error=error, engine_index=self.engine_index
            )
            self.output.send_multipart([MSG_OUT, _encoder.encode(out)])
            # The process exits next (os._exit): close the socket and wait up to its linger
            # for the message to leave, or the front end would see only an exit code.
            self.output.close(linger=2000)
            self.input.close(linger=0)
            self.ctx.term()
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self.engine_core.shutdown()
        self.input.close(linger=0)
        self.output.close(linger=1000)
        self.ctx.term()


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    ready_pipe: Any,
    log_level: int = logging.INFO,
) -> None:
    """Process entry point (multiprocessing spawn target).

    ``ready_pipe`` (a multiprocessing Connection) gets ``{"status": "ready", ...}`` once the
    model is loaded and the KV cache allocated, or ``{"status": "failed", "error": ...}``.
    """
    # The front end's format (entrypoints/cli/serve.py), the process named in the brackets.
    logging.basicConfig(
        level=log_level,
        format="%(levelname)s %(asctime)s [engine %(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    logger.info("Engine core process started (pid %d)", os.getpid())
    # NOTE: the front end starts this process as a daemon (terminated when it exits); the
    # flag is cleared here, in the process's own view, so that the multiprocess executor
    # may start worker processes (which end with this process: their pipes close).
    multiprocessing.current_process().daemon = False
    proc: EngineCoreProc | None = None

    def stop(signum, frame):  # noqa: ARG001
        if proc is not None:
            proc.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when to stop
    try:
        proc = EngineCoreProc(config, input_address, output_address)
        freeze_startup_heap("engine core")
        ready_pipe.send(proc.ready_info())
        proc.run()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        if isinstance(e, (ConfigError, ModelLoadError)):
            logger.error("engine core failed: %s", error)  # a user error: no traceback
        else:
            logger.error("engine core failed: %s\n%s", error, traceback.format_exc())
        if proc is None:
            ready_pipe.send({"status": "failed", "error": error})
        else:
            proc.report_error(error)
        os._exit(1)
    finally:
        if proc is not None:
            proc.close()
    exit_skipping_finalisation(0)  # everything is closed; xgrammar may be loaded here

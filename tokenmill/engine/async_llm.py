"""AsyncLLM: the asyncio front of the engine (the server), one output stream per request.

The EngineCore runs in its own process (engine/engine_core_proc.py). This side tokenizes,
submits requests over ZMQ, and one background task receives each step's outputs,
detokenizes them and wakes the waiting request streams. A request whose consumer goes
away (client disconnect, cancellation) is aborted in the core, freeing its KV blocks.
If the engine process dies, every live request fails with EngineDeadError at once.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.core.engine_io import EngineCoreOutputs, SchedulerStats
from tokenmill.engine.async_tokenizer import AsyncTokenizer
from tokenmill.engine.engine_core_proc import (
    MSG_ABORT,
    MSG_ADD,
    MSG_OUT,
    MSG_UTILITY,
    run_engine_core,
)
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.output_processor import IterationStats, OutputProcessor
from tokenmill.engine.request_collector import RequestOutputCollector
from tokenmill.engine.stage_timings import FRONT_END_TIMINGS
from tokenmill.engine_args import EngineArgs
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
_encoder = msgspec.msgpack.Encoder()


class EngineDeadError(RuntimeError):
    """The engine process failed or exited; no request can be served."""


class StatLogger(Protocol):
    """Receives each step's stats; ``log()`` is called every few seconds."""

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None: ...

    def log(self) -> None: ...


class AsyncLLM:
    """Serves requests from asyncio code.

    Args:
        config: the resolved engine configuration.
        stat_loggers: objects with ``record(scheduler_stats, iteration_stats)`` and ``log()``.
        start_timeout_s: how long to wait for the engine to load (seconds).

    Raises:
        EngineDeadError: the engine process failed to start (the message says why).
    """

    LOG_INTERVAL_S = 5.0

    def __init__(
        self,
        config: EngineConfig,
        stat_loggers: list[StatLogger] | None = None,
        start_timeout_s: float = 1800.0,
    ) -> None:
        self.config = config
        self.model_config = config.model_config
        self.stat_loggers = list(stat_loggers or [])
        mc = config.model_config
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._utility_waiters: dict[str, list[asyncio.Future]] = {}
        self._tasks: list[asyncio.Task] = []
        self.dead_error: str | None = None
        self._death_callbacks: list[Callable[[str], None]] = []
        self._closed = False
        self._timed = envs.log_step_stats()
        # The engine process starts first: the tokenizer loads while it does.
        self._spawn_engine()
        try:
            self.tokenizer = get_tokenizer(
                mc.model, mc.tokenizer if mc.tokenizer != mc.model else None
            )
            self.input_processor = InputProcessor(mc, self.tokenizer, mc.max_logprobs)
            self.output_processor = OutputProcessor(
                self.tokenizer, log_stats=bool(self.stat_loggers)
            )
            self.async_tokenizer = AsyncTokenizer(self.tokenizer, max_model_len=mc.max_model_len)
        except BaseException:
            self.engine_proc.kill()
            self.engine_proc.join(2)
            self._release_ipc()
            raise
        try:
            self._wait_for_engine(start_timeout_s)
        except BaseException:
            self._release_ipc()
            raise

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(engine_args.create_engine_config("server"), **kwargs)

    # ---- engine process ----------------------------------------------------------------

    def _spawn_engine(self) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="tokenmill-")
        tag = uuid.uuid4().hex[:8]
        input_address = f"ipc://{self._ipc_dir}/in-{tag}"
        output_address = f"ipc://{self._ipc_dir}/out-{tag}"
        self._zmq = zmq.asyncio.Context()
        self._output_sock = self._zmq.socket(zmq.PULL)
        self._output_sock.bind(output_address)
        self._input_sock = self._zmq.socket(zmq.PUSH)
        self._input_sock.connect(input_address)
        mp = multiprocessing.get_context("spawn")
        parent_conn, child_conn = mp.Pipe(duplex=False)
        self.engine_proc = mp.Process(
            target=run_engine_core,
            args=(
                self.config,
                input_address,
                output_address,
                child_conn,
                logging.getLogger().getEffectiveLevel(),
            ),
            name="tokenmill-engine-core",
            daemon=True,
        )
        self.engine_proc.start()
        child_conn.close()
        self._ready_conn = parent_conn

    def _wait_for_engine(self, timeout_s: float) -> None:
        """Wait for the engine process's start-up report; take the settings it fitted.

        Raises:
            EngineDeadError: the process exited, failed, or did not report in ``timeout_s``.
        """
        parent_conn = self._ready_conn
        deadline = time.monotonic() + timeout_s
        while not parent_conn.poll(0.2):
            if not self.engine_proc.is_alive():
                raise EngineDeadError(
                    f"the engine process exited during start-up (exit code "
                    f"{self.engine_proc.exitcode}); see its log above"
                )
            if time.monotonic() > deadline:
                self.engine_proc.kill()
                raise EngineDeadError(f"the engine did not start within {timeout_s:.0f} s")
        try:
            info = parent_conn.recv()
        except EOFError:
            info = {"status": "failed", "error": "the engine process exited during start-up"}
        parent_conn.close()
        if info.get("status") != "ready":
            self.engine_proc.join(timeout=5)
            raise EngineDeadError(f"the engine failed to start: {info.get('error')}")
        # The core may have fitted max_model_len to the KV cache (--max-model-len -1).
        self.model_config.max_model_len = info["max_model_len"]
        self.config.scheduler_config.max_model_len = info["max_model_len"]
        self.config.cache_config.num_blocks = info["num_blocks"]

    def _ensure_background_tasks(self) -> None:
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._output_loop(), name="tokenmill-output-handler"),
            loop.create_task(self._log_loop(), name="tokenmill-stat-logger"),
        ]
        if envs.log_step_stats():
            self._tasks.append(loop.create_task(self._lag_probe(), name="tokenmill-lag-probe"))
        # The process sentinel becomes readable the moment the engine process exits.
        loop.add_reader(self.engine_proc.sentinel, self._on_engine_exit)

    def _on_engine_exit(self) -> None:
        try:
            asyncio.get_running_loop().remove_reader(self.engine_proc.sentinel)
        except (RuntimeError, ValueError):
            pass
        self.engine_proc.join(0.1)  # reap it, so the exit code is known
        if not self._closed:
            self._fail_all(
                f"the engine process exited unexpectedly (exit code {self.engine_proc.exitcode})"
            )

    def add_death_callback(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once, when the engine process dies (after its live
        requests have been failed)."""
        self._death_callbacks.append(callback)

    def _fail_all(self, error: str) -> None:
        first = self.dead_error is None
        if first:
            self.dead_error = error
            logger.error("Engine is dead: %s", error)
        self.output_processor.fail_all(error)
        for collector in self._collectors.values():
            collector.put(EngineDeadError(error))
        for waiters in self._utility_waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(EngineDeadError(error))
        if first:
            for callback in self._death_callbacks:
                callback(error)

    async def _output_loop(self) -> None:
        sock = self._output_sock
        while True:
            try:
                kind, payload = await sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated, zmq.ZMQError):
                return
            if kind == MSG_OUT:
                outputs = _outputs_decoder.decode(payload)
                if self._timed and outputs.timestamp:
                    FRONT_END_TIMINGS.record("engine->front end", time.time() - outputs.timestamp)
                self._process_outputs(outputs)
                # Give the streams this step woke a turn of the event loop before the next
                # step is read: a message already queued is returned without suspending, and
                # its tokens would merge with these in each stream's collector (two tokens
                # per chunk). A stream reading its collector directly takes its tokens in
                # that turn; one interleaving several prompts (``merge_streams``) needs more
                # turns and may still merge steps.
                await asyncio.sleep(0)
            elif kind == MSG_UTILITY:
                name, result = msgspec.msgpack.decode(payload)
                waiters = self._utility_waiters.get(name)
                if waiters:
                    fut = waiters.pop(0)
                    if not fut.done():
                        fut.set_result(result)

    def _process_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.engine_error is not None:
            self._fail_all(f"the engine failed: {outputs.engine_error}")
            return
        result = self.output_processor.process_outputs(
            outputs.outputs, outputs.timestamp or time.time(), outputs.first_scheduled
        )
        if result.reqs_to_abort:
            self._send_abort(result.reqs_to_abort)
        for stat_logger in self.stat_loggers:
            stat_logger.record(outputs.scheduler_stats, result.iteration_stats)

    async def _log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.LOG_INTERVAL_S)
            for stat_logger in self.stat_loggers:
                try:
                    stat_logger.log()
                except Exception:  # a logger must never take the server down
                    logger.exception("stat logger failed")

    async def _lag_probe(self) -> None:
        """Debug aid: how late the event loop runs a 10 ms timer (a busy front end shows)."""
        lags: list[float] = []
        last = time.monotonic()
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - t - 0.01)
            if time.monotonic() - last >= self.LOG_INTERVAL_S:
                lags.sort()
                logger.info(
                    "Front-end event loop lag: p50 %.1f ms, p99 %.1f ms, max %.1f ms; "
                    "stages (mean/max): %s",
                    1e3 * lags[len(lags) // 2],
                    1e3 * lags[int(len(lags) * 0.99)],
                    1e3 * lags[-1],
                    FRONT_END_TIMINGS.take(),
                )
                lags, last = [], time.monotonic()

    # ---- requests ----------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def check_health(self) -> None:
        """Raises EngineDeadError if the engine process is gone."""
        if self.dead_error is None and not self.engine_proc.is_alive() and not self._closed:
            self._fail_all(
                f"the engine process is not running (exit code {self.engine_proc.exitcode})"
            )
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        validate_max_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request and yield its outputs until it finishes.

        Validation happens before the first yield, so an invalid request raises at once.
        Closing or cancelling the generator aborts the request in the engine.

        Raises:
            InvalidRequestError, SamplingParamsError: the request cannot be served.
            EngineDeadError: the engine is not running (or dies meanwhile).
            ValueError: ``request_id`` is already in use.
        """
        self._ensure_background_tasks()
        self.check_health()
        processed = self.input_processor.process(
            request_id,
            prompt,
            sampling_params,
            priority=priority,
            validate_max_tokens=validate_max_tokens,
            lora_request=lora_request,
        )
        # Encode every engine request before registering any: one that cannot be sent
        # must not leave its siblings running in the engine unobserved.
        messages = [_encoder.encode(req) for req in processed.engine_requests]
        collector = RequestOutputCollector(processed.params.output_kind)
        self.output_processor.add_request(processed, processed.params, collector)
        self._collectors[request_id] = collector
        finished = False
        try:
            for message in messages:
                # Awaited one by one: each unawaited send leaves a future in pyzmq's queue,
                # whose clean-up scans that queue, so a burst of thousands (many prompts
                # times n) cost the event loop quadratic time.
                await self._input_sock.send_multipart([MSG_ADD, message])
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests by their user-facing ids (unknown or finished ids are ignored)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        engine_ids = self.output_processor.abort_requests(ids)
        if engine_ids:
            self._send_abort(engine_ids)

    def _send_abort(self, engine_ids: list[str]) -> None:
        if self.dead_error is None and not self._closed:
            self._input_sock.send_multipart([MSG_ABORT, _encoder.encode(engine_ids)])

    async def _utility(self, name: str, *args: Any, timeout_s: float = 30.0) -> Any:
        self._ensure_background_tasks()
        self.check_health()
        fut = asyncio.get_running_loop().create_future()
        self._utility_waiters.setdefault(name, []).append(fut)
        await self._input_sock.send_multipart([MSG_UTILITY, _encoder.encode([name, list(args)])])
        return await asyncio.wait_for(fut, timeout_s)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._utility("reset_prefix_cache"))

    async def add_lora(self, lora_request: LoRARequest) -> str | None:
        """Load an adapter in the engine (checked against the model, kept in host memory);
        returns None, or why it cannot be served."""
        return await self._utility("add_lora", lora_request, timeout_s=300.0)

    async def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter once the requests using it have finished."""
        await self._utility("remove_lora", lora_int_id)

    async def check_kv_integrity(self) -> bool:
        """Ask the core to verify its KV cache bookkeeping (raises there if broken)."""
        return bool(await self._utility("check_integrity"))

    def get_tokenizer(self):
        return self.tokenizer

    async def encode(
        self, text: str, add_special_tokens: bool = True, param: str | None = None
    ) -> list[int]:
        """Token ids of a prompt, encoded off the event loop (see AsyncTokenizer).

        Raises:
            InvalidRequestError: the text cannot be tokenized (``param`` names its field).
        """
        return await self.async_tokenizer.encode(text, add_special_tokens, param)

    async def render_chat(
        self, render: Callable[[], str], num_messages: int, num_chars: int, param: str
    ) -> str:
        """A chat template's rendering, off the event loop and bounded (see
        ``AsyncTokenizer.render``).

        Raises:
            InvalidRequestError: the conversation cannot fit the context.
        """
        return await self.async_tokenizer.render(render, num_messages, num_chars, param)

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ---- shutdown ----------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process and release sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.async_tokenizer.shutdown()
        for task in self._tasks:
            task.cancel()
        try:
            asyncio.get_running_loop().remove_reader(self.engine_proc.sentinel)
        except (RuntimeError, ValueError):
            pass
        if self.engine_proc.is_alive():
            self.engine_proc.terminate()
            self.engine_proc.join(timeout_s)
            if self.engine_proc.is_alive():
                self.engine_proc.kill()
                self.engine_proc.join(2)
        self._release_ipc()

    def _release_ipc(self) -> None:
        """Close the engine sockets and the start-up pipe; remove the socket files."""
        self._input_sock.close(linger=0)
        self._output_sock.close(linger=0)
        self._zmq.term()
        self._ready_conn.close()
        for name in os.listdir(self._ipc_dir):
            try:
                os.unlink(os.path.join(self._ipc_dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self._ipc_dir)
        except OSError:
            pass

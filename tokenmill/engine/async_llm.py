"""AsyncLLM: the asyncio front of the engine (the server), one output stream per request.

The EngineCore runs in its own process (engine/engine_core_proc.py). This side tokenizes,
submits requests over ZMQ, and one background task receives each step's outputs,
detokenizes them and wakes the waiting request streams. A request whose consumer goes
away (client disconnect, cancellation) is aborted in the core, freeing its KV blocks.
If the engine process dies, every live request fails with EngineDeadError at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.core.engine_io import EngineCoreOutputs, SchedulerStats
from tokenmill.engine.async_tokenizer import AsyncTokenizer
from tokenmill.engine.engine_core_proc import MSG_ABORT, MSG_ADD, MSG_OUT, MSG_UTILITY
from tokenmill.engine.engine_procs import EngineDeadError, EngineProcs
from tokenmill.engine.input_processor import InputProcessor, whole_image_budget
from tokenmill.engine.output_processor import IterationStats, OutputProcessor
from tokenmill.engine.request_collector import RequestOutputCollector
from tokenmill.engine.stage_timings import FRONT_END_TIMINGS
from tokenmill.engine_args import EngineArgs
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams
from tokenmill.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
_encoder = msgspec.msgpack.Encoder()


def merge_engine_stats(
    latest: list[SchedulerStats | None], current: SchedulerStats
) -> SchedulerStats:
    """The stats of several engine cores as one: ``current`` (one core's step, whose
    counters are deltas) with the gauges summed over each core's latest snapshot (the KV
    cache usage averaged)."""
    snapshots = [s for s in latest if s is not None]
    return dataclasses.replace(
        current,
        num_running_reqs=sum(s.num_running_reqs for s in snapshots),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in snapshots),
        kv_cache_usage=sum(s.kv_cache_usage for s in snapshots) / len(snapshots),
        num_free_blocks=sum(s.num_free_blocks for s in snapshots),
        num_total_blocks=sum(s.num_total_blocks for s in snapshots),
    )


class EngineCallError(ValueError):
    """A call to the engine (sleep, wake_up, update_weights, ...) failed; the message says
    why. The engine keeps serving."""


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
        self._watching = False
        self.dead_error: str | None = None
        # True when the engine process ended through its SIGTERM handler (exit code 0): a
        # stop signal sent to the whole process group, not a failure.
        self.stopped_by_signal = False
        self._death_callbacks: list[Callable[[str], None]] = []
        self._closed = False
        # Sleep mode: True from a sleep() call until wake_up() brings everything back.
        self.sleeping = False
        self._timed = envs.log_step_stats()
        # The engine process starts first: the tokenizer loads while it does.
        self._spawn_engine()
        try:
            self.tokenizer = get_tokenizer(
                mc.model, mc.tokenizer if mc.tokenizer != mc.model else None
            )
            self.input_processor = InputProcessor(
                mc, self.tokenizer, mc.max_logprobs, config.scheduler_config.max_num_seqs,
                config.parallel_config.pipeline_parallel_size,
                speculative=config.speculative_config is not None,
                max_image_tokens=whole_image_budget(config.scheduler_config),
            )
            self.output_processor = OutputProcessor(
                self.tokenizer, log_stats=bool(self.stat_loggers),
                stream_interval=config.scheduler_config.stream_interval,
            )  # fmt: skip
            self.async_tokenizer = AsyncTokenizer(self.tokenizer, max_model_len=mc.max_model_len)
        except BaseException:
            self._kill_engines()
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
        """Start the engine core process, or one per data-parallel rank (``-dp N``)."""
        self._procs = EngineProcs.spawn(self.config)
        self.engine_procs = self._procs.procs
        self._output_sock = self._procs.output_sock
        self._input_socks = self._procs.input_socks
        # The first (or only) engine core; an embedding engine has only this one.
        self.engine_proc = self.engine_procs[0]
        self._input_sock = self._input_socks[0]
        # Requests in flight per engine core: a new one goes to the least loaded.
        self._engine_load = [0] * len(self.engine_procs)
        self._engine_stats: list[SchedulerStats | None] = [None] * len(self.engine_procs)

    def _wait_for_engine(self, timeout_s: float) -> None:
        """Wait for every engine process's start-up report; take the settings they fitted.

        Raises:
            EngineDeadError: a process exited, failed, or did not report in ``timeout_s``.
        """
        infos = self._procs.wait_ready(timeout_s)
        # The cores may have fitted max_model_len to their KV caches (--max-model-len -1).
        max_model_len = min(info["max_model_len"] for info in infos)
        self.model_config.max_model_len = max_model_len
        self.config.scheduler_config.max_model_len = max_model_len
        self.config.cache_config.num_blocks = infos[0]["num_blocks"]

    def _kill_engines(self) -> None:
        self._procs.kill()

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
        self.watch_engine_processes()

    def watch_engine_processes(self) -> None:
        """Notice an engine process's exit the moment it happens, not at the next request
        (its sentinel becomes readable then); on the running event loop, once."""
        if self._watching:
            return
        self._watching = True
        loop = asyncio.get_running_loop()
        for proc in self.engine_procs:
            loop.add_reader(proc.sentinel, self._on_engine_exit, proc)

    def _on_engine_exit(self, proc: Any) -> None:
        try:
            asyncio.get_running_loop().remove_reader(proc.sentinel)
        except (RuntimeError, ValueError):
            pass
        proc.join(0.1)  # reap it, so the exit code is known
        if not self._closed:
            self._read_pending_outputs()
            if self.dead_error is None:
                self._engine_exited(proc)

    def _engine_exited(self, proc: Any) -> None:
        """Fail everything for an engine process that has exited without sending an error.
        Exit code 0 is its SIGTERM handler's: a stop signal (often one sent to the server's
        whole process group), logged as a stop rather than a failure."""
        if proc.exitcode == 0:
            self.stopped_by_signal = True
            self._fail_all("the engine process was stopped by SIGTERM")
        else:
            self._fail_all(f"the engine process exited unexpectedly (exit code {proc.exitcode})")

    def _read_pending_outputs(self) -> None:
        """Handle the messages already received, without waiting. An engine that fails
        sends its error (which names the cause: a dead worker process, ...) just before it
        exits, and its exit may be seen before that message is read."""
        while True:
            try:
                kind, payload = self._output_sock.recv_multipart(flags=zmq.NOBLOCK).result()
            except zmq.ZMQError:  # zmq.Again: nothing left
                return
            self._handle_message(kind, payload)

    def add_death_callback(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once, when the engine process dies (after its live
        requests have been failed)."""
        self._death_callbacks.append(callback)

    def _fail_all(self, error: str) -> None:
        first = self.dead_error is None
        if first:
            self.dead_error = error
            log = logger.warning if self.stopped_by_signal else logger.error
            log("Engine is dead: %s", error)
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
            self._handle_message(kind, payload)
            if kind == MSG_OUT:
                # Give the streams this step woke a turn of the event loop before the next
                # step is read: a message already queued is returned without suspending, and
                # its tokens would merge with these in each stream's collector (two tokens
                # per chunk). A stream reading its collector directly takes its tokens in
                # that turn; one interleaving several prompts (``merge_streams``) needs more
                # turns and may still merge steps.
                await asyncio.sleep(0)

    def _handle_message(self, kind: bytes, payload: bytes) -> None:
        if kind == MSG_OUT:
            outputs = _outputs_decoder.decode(payload)
            if self._timed and outputs.timestamp:
                FRONT_END_TIMINGS.record("engine->front end", time.time() - outputs.timestamp)
            self._process_outputs(outputs)
        elif kind == MSG_UTILITY:
            name, result, error = msgspec.msgpack.decode(payload)
            waiters = self._utility_waiters.get(name)
            if waiters:
                fut = waiters.pop(0)
                if fut.done():
                    return
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(EngineCallError(error))

    def _process_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.engine_error is not None:
            self._fail_all(f"the engine failed: {outputs.engine_error}")
            return
        if outputs.scheduler_stats is not None and len(self.engine_procs) > 1:
            self._engine_stats[outputs.engine_index] = outputs.scheduler_stats
            outputs.scheduler_stats = merge_engine_stats(
                self._engine_stats, outputs.scheduler_stats
            )
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
        """Raises EngineDeadError if an engine process is gone."""
        for proc in self.engine_procs:
            if self.dead_error is None and not proc.is_alive() and not self._closed:
                self._read_pending_outputs()  # the error it sent names the cause
            if self.dead_error is None and not proc.is_alive() and not self._closed:
                self._engine_exited(proc)
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams | BeamSearchParams,
        request_id: str,
        priority: int = 0,
        validate_max_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request and yield its outputs until it finishes.

        With ``BeamSearchParams`` it is a beam search: one output, when the search ends,
        with the best beams as its ``outputs`` (best first), as vLLM's ``beam_search``.

        Validation happens before the first yield, so an invalid request raises at once.
        Closing or cancelling the generator aborts the request in the engine.

        Raises:
            InvalidRequestError, SamplingParamsError: the request cannot be served.
            EngineDeadError: the engine is not running (or dies meanwhile).
            ValueError: ``request_id`` is already in use.
        """
        self._ensure_background_tasks()
        self.check_health()
        process = functools.partial(
            self.input_processor.process,
            request_id,
            prompt,
            sampling_params,
            priority=priority,
            validate_max_tokens=validate_max_tokens,
            lora_request=lora_request,
        )
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            # The image processor's CPU work runs in a thread, off the event loop.
            processed = await asyncio.get_running_loop().run_in_executor(None, process)
        else:
            processed = process()
        # Encode every engine request before registering any: one that cannot be sent
        # must not leave its siblings running in the engine unobserved.
        messages = [_encoder.encode(req) for req in processed.engine_requests]
        collector = RequestOutputCollector(processed.params.output_kind)
        self.output_processor.add_request(processed, processed.params, collector)
        self._collectors[request_id] = collector
        # Data parallelism: the engine core with the fewest requests in flight takes it.
        engine = min(range(len(self._engine_load)), key=self._engine_load.__getitem__)
        self._engine_load[engine] += 1
        finished = False
        try:
            for message in messages:
                # Awaited one by one: each unawaited send leaves a future in pyzmq's queue,
                # whose clean-up scans that queue, so a burst of thousands (many prompts
                # times n) cost the event loop quadratic time.
                await self._input_socks[engine].send_multipart([MSG_ADD, message])
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            self._engine_load[engine] -= 1
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
            # Every engine core hears it: one that does not hold a request ignores its id.
            message = _encoder.encode(engine_ids)
            for sock in self._input_socks:
                sock.send_multipart([MSG_ABORT, message])

    async def _utility(self, name: str, *args: Any, timeout_s: float = 30.0) -> list[Any]:
        """Run a utility on every engine core; returns their results."""
        self._ensure_background_tasks()
        self.check_health()
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in self._input_socks]
        self._utility_waiters.setdefault(name, []).extend(futures)
        message = _encoder.encode([name, list(args)])
        for sock in self._input_socks:
            await sock.send_multipart([MSG_UTILITY, message])
        return list(await asyncio.wait_for(asyncio.gather(*futures), timeout_s))

    async def reset_prefix_cache(self) -> bool:
        return all(await self._utility("reset_prefix_cache"))

    # ---- sleep mode and weight updates --------------------------------------------------

    # Sleeping, waking and loading weights move the model's whole memory (seconds, or
    # minutes for a large checkpoint read from disk).
    ENGINE_CALL_TIMEOUT_S = 1800.0

    async def sleep(self, level: int = 1) -> None:
        """Free the engine's weights and KV cache (``EngineCore.sleep``); new requests are
        refused (``is_sleeping``) until ``wake_up``, requests in flight wait.

        Raises:
            EngineCallError: sleep mode is off, or an invalid level.
        """
        self.sleeping = True
        try:
            await self._utility("sleep", level, timeout_s=self.ENGINE_CALL_TIMEOUT_S)
        except BaseException:
            self.sleeping = any(await self._utility("is_sleeping"))
            raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and/or the KV cache (``None``: both).

        Raises:
            EngineCallError: an unknown tag.
        """
        await self._utility("wake_up", tags, timeout_s=self.ENGINE_CALL_TIMEOUT_S)
        self.sleeping = any(await self._utility("is_sleeping"))

    async def is_sleeping(self) -> bool:
        return any(await self._utility("is_sleeping"))

    async def update_weights(self, path: str) -> None:
        """Load new weights in place (``EngineCore.update_weights``).

        Raises:
            EngineCallError: the weights are asleep, or the checkpoint cannot be loaded.
        """
        await self._utility("update_weights", path, timeout_s=self.ENGINE_CALL_TIMEOUT_S)

    async def memory_bytes(self) -> dict[str, int]:
        """Device bytes the engine's weights and KV cache hold now (summed over the
        data-parallel engine cores)."""
        total: dict[str, int] = {}
        for per_core in await self._utility("memory_bytes"):
            for key, value in dict(per_core).items():
                total[key] = total.get(key, 0) + value
        return total

    async def add_lora(self, lora_request: LoRARequest) -> str | None:
        """Load an adapter in the engine (checked against the model, kept in host memory);
        returns None, or why it cannot be served."""
        errors = await self._utility("add_lora", lora_request, timeout_s=300.0)
        return next((e for e in errors if e is not None), None)  # the same on every core

    async def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter once the requests using it have finished."""
        await self._utility("remove_lora", lora_int_id)

    async def check_kv_integrity(self) -> bool:
        """Ask the cores to verify their KV cache bookkeeping (raises there if broken)."""
        return all(await self._utility("check_integrity"))

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
        for proc in self.engine_procs:
            try:
                asyncio.get_running_loop().remove_reader(proc.sentinel)
            except (RuntimeError, ValueError):
                pass
        self._procs.terminate(timeout_s)
        self._release_ipc()

    def _release_ipc(self) -> None:
        """Close the engine sockets and the start-up pipes; remove the socket files."""
        self._procs.release()

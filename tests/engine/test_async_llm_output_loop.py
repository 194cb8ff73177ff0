"""The front end's output loop: a stream reading its collector takes each step's tokens
before the next step is read, so it sends one chunk per step rather than merging steps."""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace

import msgspec

from tokenmill.core.engine_io import EngineCoreOutputs
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.engine_core_proc import MSG_OUT
from tokenmill.engine.request_collector import RequestOutputCollector
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import RequestOutputKind


class _QueuedSocket:
    """Hands out queued messages without suspending, as a zmq socket does for a message
    that has already arrived; then ends the loop."""

    def __init__(self, num_messages: int) -> None:
        payload = msgspec.msgpack.encode(EngineCoreOutputs())
        self.messages = [(MSG_OUT, payload)] * num_messages

    async def recv_multipart(self) -> tuple[bytes, bytes]:
        if not self.messages:
            raise asyncio.CancelledError
        return self.messages.pop(0)


def _delta(step: int) -> RequestOutput:
    completion = CompletionOutput(index=0, text=f" t{step}", token_ids=[step])
    return RequestOutput("r", None, [1], None, [completion], finished=False)


def test_each_step_reaches_the_stream_before_the_next_is_read():
    async def main() -> list[list[int]]:
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        steps = iter(range(3))
        front_end = SimpleNamespace(
            _output_sock=_QueuedSocket(3),
            _timed=False,
            _process_outputs=lambda outputs: collector.put(_delta(next(steps))),
        )
        front_end._handle_message = functools.partial(AsyncLLM._handle_message, front_end)
        received: list[list[int]] = []

        async def stream() -> None:
            while len(received) < 3:
                out = await collector.get()
                received.append(out.outputs[0].token_ids)

        consumer = asyncio.ensure_future(stream())
        await asyncio.sleep(0)  # the stream waits on its collector
        await AsyncLLM._output_loop(front_end)  # type: ignore[arg-type]
        await asyncio.wait_for(consumer, timeout=1)
        return received

    assert asyncio.run(main()) == [[0], [1], [2]]


def test_step_log_reports_steps_by_path(caplog):
    """``TOKENMILL_LOG_STEP_STATS``: with the runner's count of steps by path (one GPU, in
    the core's process), each log interval names the paths its steps took, then restarts."""
    from collections import Counter
    from types import SimpleNamespace

    from tokenmill.engine import engine_core_proc

    paths: Counter[str] = Counter()
    runner = SimpleNamespace(graphs=SimpleNamespace(paths=paths))
    core = SimpleNamespace(executor=SimpleNamespace(worker=SimpleNamespace(model_runner=runner)))
    assert engine_core_proc._step_paths(core) is paths
    assert engine_core_proc._step_paths(SimpleNamespace(executor=None)) is None
    log = engine_core_proc._StepLog(paths)
    log.last -= log.INTERVAL_S
    paths.update({"decode": 3, "images": 1})
    with caplog.at_level("INFO", logger=engine_core_proc.logger.name):
        log.record(0.01, 4)
    assert "Engine step paths: decode 3, images 1" in caplog.text
    assert not paths

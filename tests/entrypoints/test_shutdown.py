"""Stopping the server with requests in flight: the ``--shutdown-timeout`` grace period, then
an abort that ends every client's response; a second signal exits at once.

Each test starts its own tiny-model server. The engine is paused with SIGSTOP so that the
request is still running when the signal comes, whatever the machine's speed.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.entrypoints.conftest import RemoteServer, tiny_args
from tests.entrypoints.test_lifecycle import LONG, StreamReader, engine_pid, wait_for_log

pytestmark = pytest.mark.slow


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


@pytest.mark.parametrize(
    "flags", [[], ["--shutdown-timeout", "1"]], ids=["default: abort at once", "after 1 s"]
)
def test_requests_still_running_after_the_timeout_are_aborted(tiny_model_dir, flags):
    server = RemoteServer([*tiny_args(tiny_model_dir), *flags])
    pid = engine_pid(server)
    try:
        streaming = StreamReader(server, LONG)
        streaming.start()
        assert streaming.first.wait(60) and streaming.error is None
        os.kill(pid, signal.SIGSTOP)  # the request cannot finish by itself
        server.proc.send_signal(signal.SIGTERM)
        streaming.join(60)
        assert not streaming.is_alive(), "the stream hangs after the shutdown timeout"
        assert streaming.error is None and streaming.events[-1] == "[DONE]"
        assert "shutting down" in streaming.events[-2]["error"]["message"]
        resume(pid)
        assert server.proc.wait(60) == 0, server.log_text()
        log = server.log_text(1_000_000)
        assert "aborted 1 running request(s)" in log
        assert "Engine shut down" in log and "Traceback" not in log
        assert not os.path.exists(f"/proc/{pid}"), "the engine process outlived the server"
    finally:
        resume(pid)
        server.stop()


def test_second_signal_exits_at_once(tiny_model_dir):
    server = RemoteServer([*tiny_args(tiny_model_dir), "--shutdown-timeout", "600"])
    pid = engine_pid(server)
    try:
        streaming = StreamReader(server, LONG)
        streaming.start()
        assert streaming.first.wait(60) and streaming.error is None
        os.kill(pid, signal.SIGSTOP)  # without the second signal, shutdown would wait 600 s
        server.proc.send_signal(signal.SIGTERM)
        wait_for_log(server, "shutting down", 1)
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(60) == 128 + signal.SIGINT
        streaming.join(60)
        assert not streaming.is_alive(), "the stream hangs after the server exited"
        log = server.log_text(1_000_000)
        assert "SIGINT again: exiting now" in log and "Traceback" not in log
        assert not os.path.exists(f"/proc/{pid}"), "the engine process outlived the server"
    finally:
        resume(pid)
        server.stop()

"""Process life cycle: the engine process dying under load, and SIGTERM draining the server.

Each test starts its own tiny-model server (the tests end it). The engine is paused with
SIGSTOP where a request must still be in flight when something happens, so that nothing
depends on how fast the machine is.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.conftest import RemoteServer, tiny_args

pytestmark = pytest.mark.slow


def engine_pid(server: RemoteServer) -> int:
    """The engine process: the server's child started by multiprocessing's spawn."""
    pid = server.proc.pid
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return child
    raise AssertionError(f"no engine process among {children}")


def wait_for_log(server: RemoteServer, text: str, count: int, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while server.log_text(1_000_000).count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not logged {count} times"
        time.sleep(0.05)


class StreamReader(threading.Thread):
    """Reads an SSE stream in the background; ``first`` is set once a chunk has arrived."""

    def __init__(self, server: RemoteServer, body: dict) -> None:
        super().__init__(daemon=True)
        self.server, self.body = server, body
        self.first = threading.Event()
        self.events: list[dict | str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST",
                self.server.url + "/v1/completions",
                json={**self.body, "stream": True},
                timeout=120.0,
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        payload = line[6:]
                        self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                        self.first.set()
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.first.set()


LONG = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def test_engine_death_fails_health_and_pending_requests(tiny_model_dir):
    """With --keep-alive-on-engine-death the server stays up, answering 503."""
    server = RemoteServer([*tiny_args(tiny_model_dir), "--keep-alive-on-engine-death"])
    try:
        pid = engine_pid(server)
        streaming = StreamReader(server, LONG)
        streaming.start()
        assert streaming.first.wait(60) and streaming.error is None
        os.kill(pid, signal.SIGSTOP)  # the request cannot finish before the kill
        pending: dict = {}
        blocking = threading.Thread(
            target=lambda: pending.update(r=server.post("/v1/completions", LONG)), daemon=True
        )
        blocking.start()
        wait_for_log(server, "Received request", 2)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        status = None
        while time.monotonic() - killed_at < 1.0:
            status = httpx.get(server.url + "/health", timeout=1.0).status_code
            if status == 503:
                break
        assert status == 503, "/health did not fail within a second of the engine's death"
        health = httpx.get(server.url + "/health", timeout=10)
        assert "engine" in health.json()["error"]["message"]

        blocking.join(60)
        assert not blocking.is_alive(), "the pending request hangs"
        assert pending["r"].status_code == 503
        assert pending["r"].json()["error"]["code"] == "engine_dead"
        streaming.join(60)
        assert not streaming.is_alive(), "the pending stream hangs"
        assert streaming.events[-1] == "[DONE]"
        assert "error" in streaming.events[-2]

        again = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert again.status_code == 503
    finally:
        code = server.stop()
    assert code == 0, server.log_text()


def test_engine_death_fails_running_requests_then_the_server_exits_with_1(tiny_model_dir):
    """By default (as vLLM): the running requests get their 503 (a stream its error event and
    [DONE]), then the server stops and exits with code 1 for its orchestrator to restart."""
    server = RemoteServer(tiny_args(tiny_model_dir))
    try:
        pid = engine_pid(server)
        streaming = StreamReader(server, LONG)
        streaming.start()
        assert streaming.first.wait(60) and streaming.error is None
        os.kill(pid, signal.SIGSTOP)  # the request cannot finish before the kill
        pending: dict = {}
        blocking = threading.Thread(
            target=lambda: pending.update(r=server.post("/v1/completions", LONG)), daemon=True
        )
        blocking.start()
        wait_for_log(server, "Received request", 2)
        os.kill(pid, signal.SIGKILL)
        blocking.join(60)
        assert pending["r"].status_code == 503
        assert pending["r"].json()["error"]["code"] == "engine_dead"
        streaming.join(60)
        assert streaming.events[-1] == "[DONE]" and "error" in streaming.events[-2]
        assert server.proc.wait(60) == 1
        log = server.log_text()
        assert "the server exits" in log and "error: the engine died" in log
    finally:
        server.stop()


def test_an_engine_stopped_by_sigterm_is_logged_as_stopped_not_dead(tiny_model_dir):
    """A stop signal sent to the whole process group reaches the engine process too, which
    exits through its SIGTERM handler (code 0): the idle server notices at once, exits and
    says the engine was stopped, without an error-level "died" line."""
    server = RemoteServer(tiny_args(tiny_model_dir))
    try:
        os.kill(engine_pid(server), signal.SIGTERM)
        server.proc.wait(60)
        log = server.log_text()
        assert "The engine stopped" in log and "stopped by SIGTERM" in log, log
        assert "The engine died" not in log and "exited unexpectedly" not in log, log
    finally:
        server.stop()


def test_sigterm_stops_accepting_and_drains(tiny_model_dir):
    # A grace period far longer than the request needs: it finishes rather than be aborted.
    server = RemoteServer([*tiny_args(tiny_model_dir), "--shutdown-timeout", "600"])
    try:
        pid = engine_pid(server)
        body = {**LONG, "max_tokens": 200, "stream_options": {"include_usage": True}}
        streaming = StreamReader(server, body)
        streaming.start()
        assert streaming.first.wait(60) and streaming.error is None
        os.kill(pid, signal.SIGSTOP)  # keeps the request in flight while the server stops
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while True:  # new connections are refused once uvicorn has seen the signal
            assert time.monotonic() < deadline, "the server still accepts connections"
            try:
                httpx.get(server.url + "/health", timeout=2.0)
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                # Refused, or reset: the kernel's backlog took the connection just before
                # the listening socket closed, and nothing served it.
                break
            time.sleep(0.05)
        assert server.proc.poll() is None
        os.kill(pid, signal.SIGCONT)
        streaming.join(60)
        assert streaming.error is None and streaming.events[-1] == "[DONE]"
        usage = streaming.events[-2]["usage"]
        assert usage["completion_tokens"] == 200
        finish = [
            c["finish_reason"]
            for e in streaming.events[:-1]
            if isinstance(e, dict)
            for c in e["choices"]
            if c["finish_reason"]
        ]
        assert finish == ["length"]
        assert server.proc.wait(60) == 0, server.log_text()
        assert "Engine shut down" in server.log_text()
    finally:
        server.stop()

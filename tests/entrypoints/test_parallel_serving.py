"""Serving with several ranks: ``tokenmill serve -tp 2`` logs its layout, answers, and when a
worker process dies every request fails with an error and ``/health`` turns 503 within
seconds, instead of the engine hanging in a collective. (With --keep-alive-on-engine-death,
so the server stays up to be asked; without it the server then exits with 1, as
test_lifecycle checks for one rank.)"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from tests.entrypoints.conftest import RemoteServer, tiny_args
from tests.entrypoints.test_lifecycle import LONG, StreamReader

pytestmark = pytest.mark.slow


def test_worker_death_fails_requests_and_health(tiny_model_dir):
    server = RemoteServer([*tiny_args(tiny_model_dir), "--tensor-parallel-size", "2",
                           "--keep-alive-on-engine-death"])
    try:
        log = server.log_text(1_000_000)
        assert "Parallel layout: 2 ranks (TP 2 x PP 1), executor mp, gloo" in log
        ok = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4

        streaming = StreamReader(server, LONG)
        streaming.start()
        assert streaming.first.wait(60) and streaming.error is None
        pid = int(re.search(r"Worker process of rank 1 started \(pid (\d+)\)", log).group(1))
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        status = None
        while time.monotonic() - killed_at < 10.0:
            status = httpx.get(server.url + "/health", timeout=2.0).status_code
            if status == 503:
                break
            time.sleep(0.1)
        assert status == 503, "/health did not fail within seconds of the worker's death"
        health = httpx.get(server.url + "/health", timeout=10).json()
        assert "rank 1" in health["error"]["message"], health

        streaming.join(60)
        assert not streaming.is_alive(), "the pending stream hangs"
        assert streaming.events[-1] == "[DONE]" and "error" in streaming.events[-2]
        again = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert again.status_code == 503
    finally:
        server.stop()

"""Costly structured-output constraints sent together cannot hold the engine: each gets a 400
(too slow to compile) or a 429 (the compilers were busy) in OpenAI's error format, a plain
request sent meanwhile is served in full, and afterwards the engine process has no more
threads than before, no compile left running, and is idle. Times are measured by
benchmarks/hostile_constraints_bench.py, not here."""

from __future__ import annotations

import asyncio
import time

import httpx
import psutil
import pytest

from tests.entrypoints.test_chat_completions import MODEL

pytestmark = pytest.mark.slow

# ".?" repeated 60+ times takes xgrammar minutes to compile; each request's differs.
COSTLY = [".?" * n + "c" * 30 for n in range(60, 68)]


def engine_process(server) -> psutil.Process:
    """The engine core process: the server's multiprocessing child that runs the loop."""
    children = psutil.Process(server.proc.pid).children()
    [engine] = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    return engine


def cpu_seconds(process: psutil.Process) -> float:
    """CPU time of ``process`` and its descendants alive now."""
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


async def _attack(url: str) -> tuple[list[httpx.Response], httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        costly = [
            client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 8, "guided_regex": regex},
            )
            for regex in COSTLY
        ]
        tasks = [asyncio.ensure_future(c) for c in costly]
        await asyncio.sleep(0.5)  # the compiles are under way
        plain = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16,
                  "temperature": 0, "ignore_eos": True},
        )  # fmt: skip
        return list(await asyncio.gather(*tasks)), plain


def test_costly_constraints_sent_together_are_refused_and_leave_nothing_running(
    default_server,
):
    # Warm up: a constraint compiled and followed, so the workers exist before the baseline.
    warm = default_server.post(
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_regex": "[ab]{2,4}"},
    )
    assert warm.status_code == 200
    engine = engine_process(default_server)
    threads_before = engine.num_threads()
    failures_before = default_server.metrics()["tokenmill:structured_output_failures_total"]

    refused, plain = asyncio.run(_attack(default_server.url))

    statuses = sorted(r.status_code for r in refused)
    assert set(statuses) <= {400, 429} and 400 in statuses
    for response in refused:
        error = response.json()["error"]
        assert error["param"] == "guided_regex"
        if response.status_code == 400:
            assert "took more than 5 s to compile" in error["message"]
        else:
            assert error["type"] == "rate_limit_error" and "retry later" in error["message"]
    body = plain.json()
    assert plain.status_code == 200 and body["usage"]["completion_tokens"] == 16
    metrics = default_server.metrics()
    assert metrics["tokenmill:structured_output_failures_total"] == failures_before + 8
    assert metrics["tokenmill:num_requests_waiting"] == 0
    # Nothing left compiling: the engine keeps its threads, and over a few seconds it and
    # its grammar workers use next to no CPU.
    assert engine.num_threads() == threads_before
    start = cpu_seconds(engine)
    time.sleep(3)
    assert cpu_seconds(engine) - start < 0.5
    # And it still compiles and follows constraints.
    again = default_server.post(
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_choice": ["yes", "no"]},
    )
    assert again.status_code == 200 and again.json()["choices"][0]["text"] in ("yes", "no")

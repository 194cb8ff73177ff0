"""Concurrency on the default model: many streaming clients, seeded sampling under load, and
clients that disconnect (their requests must stop and free their KV blocks)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from tests.entrypoints.test_chat_completions import MODEL

pytestmark = pytest.mark.slow

GAUGES = (
    "tokenmill:num_requests_running",
    "tokenmill:num_requests_waiting",
    "tokenmill:kv_cache_usage_perc",
)


def assert_idle(server) -> dict[str, float]:
    metrics = server.metrics()
    for name in GAUGES:
        assert metrics[name] == 0, (name, metrics[name])
    return metrics


def test_32_concurrent_streaming_clients(default_server):
    client = default_server.async_openai()

    async def one(i: int) -> tuple[str, str, int]:
        # Short prompts: on a CPU the 32 prefills would otherwise dominate the test's time.
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Count from {i}:",
            temperature=0.7,
            seed=i,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, finish, usage

    async def run_all():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    before = default_server.metrics()
    results = asyncio.run(run_all())
    assert len(results) == 32
    for text, finish, usage in results:
        assert finish in ("stop", "length")
        assert 0 < usage <= 8
        assert text
    after = assert_idle(default_server)
    generated = (
        after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"]
    )
    assert generated == sum(r[2] for r in results)
    finished = sum(
        after[k] - before.get(k, 0)
        for k in after
        if k.startswith("tokenmill:request_success_total")
    )
    assert finished == 32
    assert after["tokenmill:time_to_first_token_seconds_count"] >= 32


def test_same_seed_same_text_under_concurrent_load(default_server):
    """Regression: a seeded request samples the same tokens whatever else is in the batch."""
    body = {
        "prompt": "Once upon a time",
        "temperature": 1.0,
        "max_tokens": 8,
        "seed": 1234,
        "ignore_eos": True,
    }
    alone = default_server.post("/v1/completions", body).json()["choices"][0]["text"]

    async def run_all():
        async with httpx.AsyncClient(base_url=default_server.url, timeout=120.0) as client:
            requests = []
            for i in range(8):
                seeded = i % 2 == 0
                payload = body if seeded else {**body, "seed": 10_000 + i, "max_tokens": 12}
                requests.append(client.post("/v1/completions", json=payload))
            responses = await asyncio.gather(*requests)
        return [r.json()["choices"][0]["text"] for r in responses]

    texts = asyncio.run(run_all())
    seeded_texts = texts[0::2]
    assert seeded_texts == [alone] * len(seeded_texts)
    assert len(set(texts[1::2])) > 1  # the other seeds did sample differently


def _wait_running(server, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.metrics()["tokenmill:num_requests_running"] >= 1:
            return
        time.sleep(0.05)
    raise AssertionError("the request never started running")


def _settle(server) -> None:
    """One short request: its last engine step reports the scheduler state after it."""
    response = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 200


LONG = {
    "prompt": "Tell me a very long story.",
    "max_tokens": 1500,
    "ignore_eos": True,
    "temperature": 0,
}


def test_streaming_disconnect_aborts_and_frees_blocks(default_server):
    """Regression: a client that goes away mid-stream stops its generation."""
    before = default_server.metrics()
    received = 0
    with httpx.stream(
        "POST", default_server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=120.0
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                received += 1
                assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
            if received == 3:
                break  # leaving the block closes the connection
    _settle(default_server)
    after = assert_idle(default_server)
    generated = (
        after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"]
    )
    assert generated < LONG["max_tokens"]


def test_non_streaming_disconnect_aborts_and_frees_blocks(default_server):
    """Regression: generation stops when a non-streaming client disconnects."""
    before = default_server.metrics()
    body = json.dumps(LONG).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", default_server.port), timeout=60) as sock:
        sock.sendall(request)
        _wait_running(default_server)
    _settle(default_server)
    after = assert_idle(default_server)
    generated = (
        after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"]
    )
    assert generated < LONG["max_tokens"]
    assert "client disconnected" in default_server.log_text(200_000)

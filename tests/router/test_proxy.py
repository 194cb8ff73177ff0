"""The router's request side: routing keys of malformed bodies, the prefix map's bound per
prompt, start-up checks of --backend, and the body size limit (an aiohttp app on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tokenmill.router.backends import BackendPool, normalize_url
from tokenmill.router.policy import make_policy
from tokenmill.router.proxy import MAX_SEGMENTS, Router, prompt_segments, routing_key


def _key(body: bytes):
    request = SimpleNamespace(headers={}, content_type="application/json")
    return routing_key(request, body, "x-session-id", 64)


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
        b'{"system": [{"type": "text", "text": 7}], "messages": []}',
        b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b"\xff\xfe not json",
    ],
)
def test_a_body_the_router_cannot_read_is_routed_by_load(body):
    """Fields of the wrong type, nesting past the parser's depth or bytes that are not JSON
    give no routing key (the backend answers them with a 400), never a router error."""
    key = _key(body)
    assert key.segments == () and key.model == ""


def test_one_prompt_fills_at_most_max_segments():
    assert len(prompt_segments({"prompt": "a" * 64 * (MAX_SEGMENTS + 50)}, 64)) == MAX_SEGMENTS
    messages = [{"role": "user", "content": str(i)} for i in range(MAX_SEGMENTS + 5)]
    assert len(prompt_segments({"system": "s", "messages": messages}, 64)) == MAX_SEGMENTS


def test_backend_urls_are_checked_at_start_up():
    with pytest.raises(ValueError, match="no backend URL"):
        BackendPool([])
    with pytest.raises(ValueError, match="not a port number"):
        normalize_url("http://127.0.0.1:notaport")


def test_a_body_over_the_limit_is_an_openai_413(monkeypatch):
    monkeypatch.setenv("TOKENMILL_MAX_REQUEST_BODY_BYTES", "1000")

    async def scenario() -> tuple[int, dict]:
        pool = BackendPool(["http://127.0.0.1:9"], interval_s=60)
        router = Router(pool, make_policy("roundrobin", 16, 16, 1.5), "x-session-id")
        async with TestClient(TestServer(router.build_app())) as client:
            r = await client.post("/v1/completions", data=b"x" * 5000,
                                  headers={"Content-Type": "application/json"})  # fmt: skip
            return r.status, json.loads(await r.text())

    status, body = asyncio.run(scenario())
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert "1000 bytes" in body["error"]["message"]


async def _serve(runner: web.AppRunner) -> tuple[web.AppRunner, str]:
    """Start ``runner``'s app on a free loopback port: ``(runner, its URL)``."""
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def _backend(name: str, status: int = 200) -> tuple[web.AppRunner, str]:
    """A stand-in engine server serving the model ``name``: /health, /v1/models, and
    /v1/completions answering with its own name (or with ``status``'s error)."""

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def complete(request: web.Request) -> web.Response:
        if status != 200:
            return web.json_response({"error": {"message": "shutting down"}}, status=status)
        return web.json_response({"served_by": name, "model": (await request.json())["model"]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    return await _serve(web.AppRunner(app))


@pytest.mark.parametrize("logic", ["roundrobin", "prefixaware", "session"])
def test_requests_go_to_a_backend_serving_their_model(logic):
    """Backends serving different models: a request goes to one that lists its ``model``;
    ``/v1/models`` merges every healthy backend's list; a model none lists is left to a
    backend to answer."""

    async def scenario() -> None:
        (ra, url_a), (rb, url_b) = await _backend("alpha"), await _backend("beta")
        try:
            pool = BackendPool([url_a, url_b], interval_s=60)
            router = Router(pool, make_policy(logic, 1024, 16, 1.5), "x-session-id")
            async with TestClient(TestServer(router.build_app())) as client:
                for i in range(6):
                    model = "alpha" if i % 2 else "beta"
                    r = await client.post("/v1/completions", json={"model": model, "prompt": "hi"})
                    assert (await r.json())["served_by"] == model
                r = await client.get("/v1/models")
                assert sorted(m["id"] for m in (await r.json())["data"]) == ["alpha", "beta"]
                r = await client.post("/v1/completions", json={"model": "gamma", "prompt": "x"})
                assert (await r.json())["served_by"] in ("alpha", "beta")
        finally:
            await ra.cleanup()
            await rb.cleanup()

    asyncio.run(scenario())


def test_a_request_a_backend_refuses_with_503_is_routed_again():
    """A replica answering 503 (stopping, asleep: the request did not run there) is taken
    out and the request goes to another; the last one's 503 reaches the client."""

    async def scenario() -> None:
        (ra, url_a), (rb, url_b) = await _backend("m", 503), await _backend("m")
        try:
            pool = BackendPool([url_a, url_b], interval_s=60)
            router = Router(pool, make_policy("roundrobin", 1024, 16, 1.5), "x-session-id")
            async with TestClient(TestServer(router.build_app())) as client:
                for _ in range(4):
                    r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
                    assert r.status == 200, await r.text()
                assert [b.healthy for b in pool.backends.values()] == [False, True]
                pool.backends[url_b].healthy = False
                pool.backends[url_a].healthy = True  # the only one left: its 503 is relayed
                r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
                assert r.status == 503 and "shutting down" in await r.text()
        finally:
            await ra.cleanup()
            await rb.cleanup()

    asyncio.run(scenario())


async def _hanging_backend(health: str) -> tuple[web.AppRunner, str]:
    """A stand-in engine server whose requests never finish (a stream sends one event
    first); its /health answers 200, never answers (``"silent"``: a frozen process) or
    answers 503 (``"draining"``: a server finishing its requests before it stops)."""
    answer = {"ok": True}

    async def check(_: web.Request) -> web.Response:
        if answer["ok"] or health == "ok":
            return web.Response()
        if health == "draining":
            return web.Response(status=503)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def complete(request: web.Request) -> web.StreamResponse:
        answer["ok"] = False  # from the first request on, the process stops answering
        if (await request.json()).get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'data: {"choices": []}\n\n')
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_get("/health", check)
    app.router.add_post("/v1/completions", complete)
    # its handlers never return
    return await _serve(web.AppRunner(app, shutdown_timeout=0.1))


@contextlib.asynccontextmanager
async def _router_on_hanging_backend(health: str):
    """A router whose only backend is ``_hanging_backend(health)``, checked every 50 ms:
    yields ``(client, pool, url)``."""
    runner, url = await _hanging_backend(health)
    try:
        pool = BackendPool([url], interval_s=0.05, timeout_s=0.05)
        router = Router(pool, make_policy("roundrobin", 1024, 16, 1.5), "x-session-id")
        async with TestClient(TestServer(router.build_app())) as client:
            yield client, pool, url
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True])
def test_requests_on_a_frozen_backend_end(stream):
    """A backend that stops answering its health checks mid-request: the request waiting on
    it ends with a 502 (or, its stream begun, with the connection closed after what came)
    instead of waiting for ever."""

    async def scenario() -> None:
        async with _router_on_hanging_backend("silent") as (client, pool, url):
            body = {"model": "m", "prompt": "x", "stream": stream}
            r = await asyncio.wait_for(client.post("/v1/completions", json=body), 10)
            if not stream:
                assert r.status == 502
                assert "stopped answering" in (await r.json())["error"]["message"]
            else:
                assert r.status == 200
                assert await r.content.readline() == b'data: {"choices": []}\n'
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(r.read(), 10)
            assert pool.backends[url].in_flight == 0

    asyncio.run(scenario())


def test_requests_on_a_draining_backend_are_left_to_finish():
    """A backend answering its health checks with 503 (draining before it stops) is out of
    the pool for new requests, but the requests it runs are not ended."""

    async def scenario() -> None:
        async with _router_on_hanging_backend("draining") as (client, pool, url):
            body = {"model": "m", "prompt": "x"}
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.post("/v1/completions", json=body), 1.0)
            assert not pool.backends[url].healthy and not pool.backends[url].frozen.is_set()

    asyncio.run(scenario())


async def _adapter_backend(calls: list, status: int = 200) -> tuple[web.AppRunner, str]:
    """A stand-in engine server whose runtime LoRA routes record what they got."""

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def adapter(request: web.Request) -> web.Response:
        calls.append((request.path, await request.json()))
        if status != 200:
            return web.json_response({"error": {"message": "bad folder", "param": "lora_path"}},
                                     status=status)  # fmt: skip
        return web.Response(text="Success: LoRA adapter 'sql' added successfully.")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", adapter)
    app.router.add_post("/v1/unload_lora_adapter", adapter)
    return await _serve(web.AppRunner(app))


def test_runtime_lora_routes_reach_every_backend():
    """A runtime adapter load (and unload) reaches every healthy replica, so that any of
    them serves the requests naming it; one replica's refusal is the answer."""

    async def scenario() -> None:
        calls_a, calls_b = [], []
        (ra, url_a), (rb, url_b) = await _adapter_backend(calls_a), await _adapter_backend(calls_b)
        try:
            pool = BackendPool([url_a, url_b], interval_s=60)
            router = Router(pool, make_policy("roundrobin", 1024, 16, 1.5), "x-session-id")
            body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
            async with TestClient(TestServer(router.build_app())) as client:
                r = await client.post("/v1/load_lora_adapter", json=body)
                assert r.status == 200 and "added" in await r.text()
                r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
                assert r.status == 200
            paths = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
            assert [c[0] for c in calls_a] == paths and calls_a == calls_b
        finally:
            await ra.cleanup()
            await rb.cleanup()
        calls_c: list = []
        (rc, url_c), (rd, url_d) = await _adapter_backend(calls_c), await _adapter_backend([], 400)
        try:
            pool = BackendPool([url_c, url_d], interval_s=60)
            router = Router(pool, make_policy("roundrobin", 1024, 16, 1.5), "x-session-id")
            async with TestClient(TestServer(router.build_app())) as client:
                r = await client.post("/v1/load_lora_adapter", json=body)
                assert r.status == 400 and (await r.json())["error"]["param"] == "lora_path"
        finally:
            await rc.cleanup()
            await rd.cleanup()

    asyncio.run(scenario())

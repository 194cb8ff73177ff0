"""A small OpenAI-compatible server for the serve benchmark's tests (aiohttp, own thread).

It streams ``max_tokens`` chunks per request and reports usage with a prompt count that is
deliberately *not* the tokenizer's (``len(prompt) // 3 + 7``), so a test can tell the
server's numbers from the client's. Modes:

- ``ok``: every request succeeds.
- ``error``: every request gets HTTP 500 with an OpenAI error body.
- ``flaky``: request n (in arrival order) gets HTTP 400 when n % 3 == 1, an error event
  mid-stream when n % 3 == 2, else succeeds.
- ``drop``: the connection is closed mid-stream.
- ``no_usage``: like ok, without the usage chunk.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

STUB_MODEL = "stub-model"


def stub_prompt_tokens(prompt: str) -> int:
    """The prompt token count the stub reports."""
    return len(prompt) // 3 + 7


@dataclass
class StubState:
    mode: str
    bodies: list[dict[str, Any]] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    reported: list[dict[str, int]] = field(default_factory=list)


STATE_KEY = web.AppKey("state", StubState)


def _chunk(body: dict[str, Any], text: str, finish: str | None, chat: bool) -> bytes:
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
    event = {"id": "x", "model": body.get("model"), "choices": [choice]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state: StubState = request.app[STATE_KEY]
    body = await request.json()
    number = len(state.bodies)
    state.bodies.append(body)
    state.authorizations.append(request.headers.get("Authorization"))
    mode = state.mode
    if mode == "flaky":
        mode = {0: "ok", 1: "bad_request", 2: "error_event"}[number % 3]
    if mode == "error":
        return web.json_response(
            {"error": {"message": "engine exploded", "type": "InternalServerError"}}, status=500
        )
    if mode == "bad_request":
        return web.json_response(
            {"error": {"message": "prompt is too long", "type": "BadRequestError"}}, status=400
        )
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        return await _stream(request, state, body, chat, mode)
    finally:
        state.in_flight -= 1


async def _stream(
    request: web.Request, state: StubState, body: dict[str, Any], chat: bool, mode: str
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    if chat:  # a role-only first chunk, as real servers send: it carries no token
        role = {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
        await response.write(b"data: " + json.dumps(role).encode() + b"\n\n")
    for i in range(max_tokens):
        await asyncio.sleep(0.002)
        if mode == "error_event" and i == 1:
            await response.write(b'data: {"error": {"message": "worker died"}}\n\n')
            return response
        if mode == "drop" and i == 1:
            request.transport.close()
            return response
        finish = "length" if i == max_tokens - 1 else None
        await response.write(_chunk(body, f" w{i}", finish, chat))
    prompt = body["messages"][0]["content"] if chat else body["prompt"]
    usage = {
        "prompt_tokens": stub_prompt_tokens(prompt),
        "completion_tokens": max_tokens,
        "total_tokens": stub_prompt_tokens(prompt) + max_tokens,
    }
    if mode != "no_usage":
        state.reported.append(usage)
        await response.write(
            b"data: " + json.dumps({"id": "x", "choices": [], "usage": usage}).encode() + b"\n\n"
        )
    await response.write(b"data: [DONE]\n\n")
    return response


async def _models(request: web.Request) -> web.Response:
    if request.app[STATE_KEY].mode == "unauthorized":
        return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
    return web.json_response(
        {"object": "list", "data": [{"id": STUB_MODEL, "object": "model", "owned_by": "stub"}]}
    )


class StubServer:
    """Runs the stub on 127.0.0.1 (a free port) in a background thread.

    Attributes:
        base_url: ``http://127.0.0.1:<port>``.
        state: what the stub received and reported.
    """

    def __init__(self, mode: str = "ok") -> None:
        self.state = StubState(mode)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.base_url = ""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app[STATE_KEY] = self.state
        app.router.add_post("/v1/completions", lambda r: _generate(r, chat=False))
        app.router.add_post("/v1/chat/completions", lambda r: _generate(r, chat=True))
        app.router.add_get("/v1/models", _models)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = self._runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{port}"
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> StubServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the stub server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

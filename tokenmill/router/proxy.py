"""The router's HTTP side (aiohttp): every request is passed to the backend a policy chose.

Routes of its own: ``GET /health`` (200 while some backend is healthy, else 503),
``GET /metrics`` (the router's Prometheus metrics), ``GET /router/backends`` (JSON: each
backend's URL, health and requests in flight), ``GET /v1/models`` (the healthy backends'
lists merged) and the runtime LoRA routes (``ADAPTER_ROUTES``: sent to every healthy
backend); a request naming a ``model`` goes to the backends that list it. Every other
path and method is forwarded as it is — body, query and headers (the client's
``Authorization`` included), less the hop-by-hop ones — and the response comes back byte for
byte as the backend writes it: streams (server-sent events) are passed through unbuffered,
compressed bodies stay compressed. When the client disconnects, the handler is cancelled and
the connection to the backend closed, which aborts the request there. A backend that refuses
the connection, or answers 503 (stopping, asleep: the request did not run there) while
another is left, is marked unhealthy and the request is routed again among the others; one
that fails after the request reached it gets a 502 (the request is not replayed: generation
is not idempotent), as does one that freezes (its health checks unanswered,
``FROZEN_AFTER_CHECKS``) while the request waits on it — or, once its response has begun,
the client's connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenmill import envs
from tokenmill.router.backends import Backend, BackendPool, fetch_model_cards
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import PrefixAwarePolicy, RoutingKey, RoutingPolicy

logger = logging.getLogger("tokenmill.router")
# Routes that change what a backend serves: sent to every backend, not routed to one.
ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")

# Not forwarded either way (RFC 9110 section 7.6.1), and those aiohttp sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",  # (the body is read whole before it is forwarded)
    }
)
# Bodies larger than this are forwarded without being read for a routing key (bytes).
MAX_KEYED_BODY = 32 << 20
# Segments of one prompt the prefix map keeps (a prefix this long already tells replicas
# apart): one huge prompt would otherwise push every other conversation out of the map.
MAX_SEGMENTS = 1024
CONNECT_TIMEOUT_S = 10.0
# Characters per prefix segment of a completion prompt: about one KV block of 16 tokens
# (a prefix shorter than a block gives the engine no cache hit).
PROMPT_BLOCK_CHARS = 64


@web.middleware
async def _openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own refusal of a body over ``client_max_size``, in OpenAI's format."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return error_response(
            413,
            f"The request body is larger than the limit of {envs.max_request_body_bytes()} "
            "bytes (TOKENMILL_MAX_REQUEST_BODY_BYTES).",
            "request_too_large",
        )


class ConnectFailed(Exception):
    """The backend refused the connection, or answered 503 (shutting down, asleep, no
    engine): the request never ran there, so another backend may take it."""


def _forwarded_headers(request: web.Request) -> dict[str, str]:
    """The client's headers a backend gets: all but the hop-by-hop ones."""
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}


def error_response(status: int, message: str, code: str) -> web.Response:
    """An error in OpenAI's format."""
    body = {"error": {"message": message, "type": "router_error", "param": None, "code": code}}
    return web.json_response(body, status=status)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else json.dumps(content, sort_keys=True)


def _message(message: Any) -> str:
    if isinstance(message, dict):
        return f"{message.get('role', '')}\n{_content_text(message.get('content'))}"
    return _content_text(message)


def prompt_segments(body: Any, block_chars: int) -> tuple[str, ...]:
    """The prompt of a request body, as the segments the prefix map hashes: each chat
    message (OpenAI's ``messages``, Anthropic's ``system`` first, a Responses ``input``
    list), else ``block_chars``-character blocks of a completion ``prompt`` or a text
    ``input`` (full blocks only: the tail may still grow). Empty without a prompt."""
    if not isinstance(body, dict):
        return ()
    if isinstance(body.get("messages"), list) or isinstance(body.get("input"), list):
        messages = body.get("messages") or body.get("input") or []
        system = () if body.get("system") is None else ("system\n" + _content_text(body["system"]),)
        return (system + tuple(_message(m) for m in messages[:MAX_SEGMENTS]))[:MAX_SEGMENTS]
    text = body.get("prompt", body.get("input"))
    if isinstance(text, list) and text and not isinstance(text[0], int):
        text = text[0]  # a batch of prompts: route on the first
    if text is None:
        return ()
    if not isinstance(text, str):
        text = json.dumps(text)  # token ids
    end = min(len(text) - block_chars + 1, MAX_SEGMENTS * block_chars)
    return tuple(text[i : i + block_chars] for i in range(0, end, block_chars))


def routing_key(
    request: web.Request, body: bytes, session_header: str, block_chars: int
) -> RoutingKey:
    session = request.headers.get(session_header)
    if not body or len(body) > MAX_KEYED_BODY or request.content_type != "application/json":
        return RoutingKey(session=session)
    try:
        parsed = json.loads(body)
        model = str(parsed.get("model", "")) if isinstance(parsed, dict) else ""
        return RoutingKey(model, prompt_segments(parsed, block_chars), session)
    except (ValueError, TypeError, AttributeError, RecursionError):
        # Not JSON, nested past the parser's depth, or fields of the wrong type: routed by
        # load; the backend answers it (a 400 naming the field).
        return RoutingKey(session=session)


class Router:
    """Routes requests over a pool of backends.

    Args:
        pool: the backends.
        policy: how one is chosen.
        session_header: the header naming a session (``session`` routing).
        block_chars: characters per prefix segment of a completion prompt.
    """

    def __init__(
        self,
        pool: BackendPool,
        policy: RoutingPolicy,
        session_header: str,
        block_chars: int = PROMPT_BLOCK_CHARS,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.session_header = session_header
        self.block_chars = block_chars
        self.metrics = RouterMetrics()
        pool.on_change = self._backend_changed
        self.session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None

    def _backend_changed(self, url: str, healthy: bool | None) -> None:
        self.metrics.backend_changed(url, healthy)
        if healthy is None and isinstance(self.policy, PrefixAwarePolicy):
            self.policy.forget(url)

    def build_app(self) -> web.Application:
        # The largest body the router reads is the engine server's own limit, so a larger
        # one gets the same 413 here instead of being read into memory and cut off while
        # it is forwarded (0: no limit).
        limit = envs.max_request_body_bytes() or 2**63 - 1
        app = web.Application(client_max_size=limit, middlewares=[_openai_errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/router/backends", self.list_backends)
        app.router.add_get("/v1/models", self.list_models)
        for path in ADAPTER_ROUTES:
            app.router.add_post(path, self.to_every_backend)
        app.router.add_route("*", "/{path:.*}", self.forward)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=0)  # the backends limit their own load
        self.session = aiohttp.ClientSession(
            timeout=timeout, connector=connector, auto_decompress=False
        )
        await self.pool.refresh(self.session)
        self._health_task = asyncio.get_running_loop().create_task(self.pool.run(self.session))

    async def _stop(self, _: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.session is not None:
            await self.session.close()

    # ---- its own routes -------------------------------------------------------------------

    async def health(self, _: web.Request) -> web.Response:
        if self.pool.healthy():
            return web.Response(status=200)
        return error_response(503, "No healthy backend.", "no_healthy_backend")

    async def prometheus(self, _: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def list_backends(self, _: web.Request) -> web.Response:
        backends = [
            {"url": b.url, "healthy": b.healthy, "in_flight": b.in_flight}
            for b in self.pool.backends.values()
        ]
        return web.json_response({"backends": backends})

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models``: the healthy backends' lists merged (each id once, as the
        first backend listing it gives it); forwarded to one backend when none answers it
        with a list (its error, e.g. a 401, then reaches the client)."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.pool.timeout_s)
        headers = _forwarded_headers(request)
        lists = await asyncio.gather(*(
            fetch_model_cards(self.session, b.url, timeout, headers) for b in self.pool.healthy()
        ))  # fmt: skip
        if all(cards is None for cards in lists):
            return await self.forward(request)
        merged: dict[str, Any] = {}
        for cards in lists:
            for card in cards or ():
                merged.setdefault(str(card["id"]), card)
        return web.json_response({"object": "list", "data": list(merged.values())})

    async def to_every_backend(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: sent to every
        healthy backend, since a replica without the adapter could not serve the requests
        naming it. The first backend's answer when all agree on success, else the first
        failing one's (others may have applied it: the client loads or unloads again); a
        backend that cannot be reached is a 502 naming it."""
        assert self.session is not None
        backends = self.pool.healthy()
        if not backends:
            return error_response(503, "No healthy backend to route to.", "no_healthy_backend")
        body = await request.read()
        headers = _forwarded_headers(request)
        timeout = aiohttp.ClientTimeout(total=self.pool.timeout_s)

        async def send(backend: Backend) -> tuple[int, bytes, str]:
            url = backend.url + request.rel_url.raw_path_qs
            async with self.session.post(url, data=body, headers=headers, timeout=timeout) as r:
                return r.status, await r.read(), r.content_type

        answers = await asyncio.gather(*(send(b) for b in backends), return_exceptions=True)
        for backend, answer in zip(backends, answers, strict=True):
            if isinstance(answer, BaseException):
                return error_response(502, f"backend {backend.url} did not answer "
                                      f"({type(answer).__name__}: {answer}).", "bad_gateway")
        failed = [a for a in answers if a[0] >= 300]  # type: ignore[index]
        status, data, content_type = (failed or answers)[0]  # type: ignore[misc]
        return web.Response(body=data, status=status, content_type=content_type)

    # ---- forwarding -----------------------------------------------------------------------

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """Route ``request`` and pass the backend's response back."""
        body = await request.read()
        key = routing_key(request, body, self.session_header, self.block_chars)
        refused: set[str] = set()
        while True:
            candidates = [b for b in self.pool.healthy() if b.url not in refused]
            serving = [b for b in candidates if key.model in b.models]
            if serving:  # else: no backend lists it (or none says): the backend answers
                candidates = serving
            if not candidates:
                return error_response(503, "No healthy backend to route to.", "no_healthy_backend")
            decision = self.policy.choose(key, candidates)
            backend = self.pool.backends[decision.backend]
            self.metrics.decisions.labels(backend.url, decision.reason).inc()
            if isinstance(self.policy, PrefixAwarePolicy) and key.segments:
                self.metrics.queried_chars.inc(sum(len(s) for s in key.segments))
                self.metrics.matched_chars.inc(decision.matched_chars)
            try:
                return await self._send(request, body, backend, len(candidates) > 1)
            except ConnectFailed as e:
                logger.warning(
                    "backend %s did not take the request (%s); routing again", backend.url, e
                )
                self.pool.set_health(backend, False)
                self.metrics.retries.labels(backend.url).inc()
                refused.add(backend.url)

    async def _send(
        self, request: web.Request, body: bytes, backend: Backend, can_reroute: bool = False
    ) -> web.StreamResponse:
        """Forward to ``backend`` and relay its response; end it with a 502 (or, once the
        response has started, by closing the client's connection) if the backend freezes
        (``BackendPool``: health checks unanswered) before the response ends.

        Raises:
            ConnectFailed: the connection was refused, or (``can_reroute``: another backend
                is left to try) the backend answered 503.
        """
        backend.in_flight += 1
        self.metrics.in_flight.labels(backend.url).set(backend.in_flight)
        start = time.monotonic()
        sent: dict[str, Any] = {"status": "error"}
        exchange = asyncio.ensure_future(
            self._exchange(request, body, backend, can_reroute, start, sent)
        )
        frozen = asyncio.ensure_future(backend.frozen.wait())
        try:
            done, _ = await asyncio.wait({exchange, frozen}, return_when=asyncio.FIRST_COMPLETED)
            if exchange in done:
                return exchange.result()
            logger.warning("backend %s froze mid-request: ending the request", backend.url)
            sent["status"] = "frozen"
            exchange.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await exchange
            response = sent.get("response")
            if response is None:
                return error_response(
                    502, "The backend stopped answering (its health checks time out).",
                    "bad_gateway",
                )  # fmt: skip
            if request.transport is not None:  # a response begun: the client sees it cut
                request.transport.close()
            return response
        finally:
            frozen.cancel()
            exchange.cancel()  # the client left (this handler cancelled): drop the backend's
            backend.in_flight -= 1
            self.metrics.in_flight.labels(backend.url).set(backend.in_flight)
            self.metrics.requests.labels(backend.url, sent["status"]).inc()
            self.metrics.duration.labels(backend.url).observe(time.monotonic() - start)

    async def _exchange(
        self,
        request: web.Request,
        body: bytes,
        backend: Backend,
        can_reroute: bool,
        start: float,
        sent: dict[str, Any],
    ) -> web.StreamResponse:
        """``_send``'s request to the backend and relay of its answer; ``sent`` gets the
        backend's ``status`` and, once begun, the client's ``response``."""
        assert self.session is not None
        headers = _forwarded_headers(request)
        url = backend.url + request.rel_url.raw_path_qs
        try:
            upstream = await self.session.request(
                request.method, url, headers=headers, data=body or None, allow_redirects=False
            )
        except aiohttp.ClientConnectorError as e:
            raise ConnectFailed(str(e)) from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return error_response(
                502, f"The backend failed: {e or type(e).__name__}", "bad_gateway"
            )
        self.metrics.ttfb.labels(backend.url).observe(time.monotonic() - start)
        sent["status"] = str(upstream.status)
        if upstream.status == 503 and can_reroute:
            # Refused before it ran (a replica stopping or asleep): route it again.
            upstream.release()
            raise ConnectFailed("it answered 503")
        return await self._relay(request, upstream, sent)

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, sent: dict[str, Any]
    ) -> web.StreamResponse:
        """Write ``upstream``'s response to the client as its bytes arrive (``sent``'s
        ``response`` is the client's once begun)."""
        complete = False
        try:
            headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
            response = web.StreamResponse(
                status=upstream.status, reason=upstream.reason, headers=headers
            )
            await response.prepare(request)
            sent["response"] = response
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except aiohttp.ClientError as e:
                # The backend failed mid-response: end the client's connection too, so that
                # it sees an incomplete response rather than a short one.
                logger.warning("backend failed mid-response: %s", e or type(e).__name__)
                if request.transport is not None:
                    request.transport.close()
                return response
            await response.write_eof()
            complete = True
            return response
        finally:
            if complete:
                upstream.release()
            else:  # the client left, or the backend failed mid-response: drop the connection
                upstream.close()

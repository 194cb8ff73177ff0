"""The router's backends: their health, their load and how they are found.

Each configured ``--backend URL`` is either one backend, or (``--resolve-backends``) a DNS
name standing for every address it resolves to, looked up again at each health check: a
Kubernetes headless Service names every ready engine pod that way, so replicas that scale up
or down join and leave the pool without the router needing the Kubernetes API.

A backend is healthy while its ``GET /health`` answers 200 within the timeout. One that
refuses a connection while a request is routed to it is marked unhealthy at once (the
request is routed again, elsewhere) until a health check passes. One whose health check goes
unanswered ``FROZEN_AFTER_CHECKS`` times in a row (not a non-200 answer: a server draining
its requests answers 503) is frozen: its ``frozen`` event is set, which ends the requests in
flight to it (``tokenmill.router.proxy``) instead of leaving their clients waiting on a
process that no longer answers.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

logger = logging.getLogger("tokenmill.router")

# Consecutive unanswered health checks after which a backend's requests in flight are ended
# (with the default interval, 5 s apart: a backend silent for about 15 s).
FROZEN_AFTER_CHECKS = 3


@dataclass
class Backend:
    """One engine server as the router sees it.

    Attributes:
        url: its base URL (``http://host:port``, no trailing slash).
        healthy: whether it takes requests.
        in_flight: requests routed to it whose responses have not ended.
        models: the model names its ``/v1/models`` listed at the last health check (empty:
            not known, e.g. a server that wants an API key there).
        unanswered: consecutive health checks it did not answer (timeouts, lost
            connections).
        frozen: set once ``unanswered`` reaches ``FROZEN_AFTER_CHECKS``; a new event when it
            answers again.
    """

    url: str
    healthy: bool = False
    in_flight: int = 0
    models: frozenset[str] = frozenset()
    unanswered: int = 0
    frozen: asyncio.Event = field(default_factory=asyncio.Event)


def normalize_url(url: str) -> str:
    """``url`` without a trailing slash, with ``http://`` when no scheme is given.

    Raises:
        ValueError: not an http(s) URL with a host and, if one, a valid port.
    """
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number in 0..65535)
    except ValueError:
        raise ValueError(f"not a port number in {url!r}") from None
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


async def resolve(url: str) -> list[str]:
    """The URLs of every address ``url``'s host resolves to (sorted; IPv6 in brackets)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    urls = set()
    for family, _, _, _, address in infos:
        host = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
        urls.add(urlunsplit((parts.scheme, f"{host}:{port}", parts.path, "", "")))
    return sorted(urls)


async def fetch_model_cards(
    session: aiohttp.ClientSession,
    url: str,
    timeout: aiohttp.ClientTimeout,
    headers: dict[str, str] | None = None,
) -> list[dict[str, Any]] | None:
    """The model cards (those with an ``id``) of ``url``'s ``GET /v1/models``; None when it
    does not answer 200 with a JSON object."""
    try:
        async with session.get(url + "/v1/models", headers=headers, timeout=timeout) as response:
            if response.status != 200:
                return None
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    data = body.get("data")
    return [c for c in data if isinstance(c, dict) and "id" in c] if isinstance(data, list) else []


class BackendPool:
    """The backends, kept current by a health-check loop.

    Args:
        urls: the ``--backend`` URLs.
        resolve_names: each URL stands for every address its host resolves to.
        interval_s: seconds between health checks.
        timeout_s: how long a health check may take.
        on_change: called with (url, healthy) when a backend's health changes, and with
            (url, None) when one leaves the pool.

    Raises:
        ValueError: no URL, or one ``normalize_url`` refuses.
    """

    def __init__(
        self,
        urls: list[str],
        resolve_names: bool = False,
        interval_s: float = 5.0,
        timeout_s: float = 3.0,
        on_change: Callable[[str, bool | None], None] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("--backend: no backend URL given")
        self.configured = [normalize_url(u) for u in urls]
        self.resolve_names = resolve_names
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_change = on_change or (lambda url, healthy: None)
        self.backends: dict[str, Backend] = {}
        if not resolve_names:
            self.backends = {u: Backend(u) for u in self.configured}

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.healthy]

    def set_health(self, backend: Backend, healthy: bool) -> None:
        if backend.healthy != healthy:
            logger.info("backend %s is %s", backend.url, "healthy" if healthy else "unhealthy")
            backend.healthy = healthy
            self.on_change(backend.url, healthy)

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        """Resolve the names (if asked to), then check every backend's /health."""
        if self.resolve_names:
            await self._resolve_all()
        await asyncio.gather(*(self._check(session, b) for b in list(self.backends.values())))

    async def _resolve_all(self) -> None:
        found: set[str] = set()
        for url in self.configured:
            try:
                found.update(await resolve(url))
            except OSError as e:  # a name with no ready address yet
                logger.warning("cannot resolve %s: %s", url, e)
        for url in found - set(self.backends):
            self.backends[url] = Backend(url)
        for url in set(self.backends) - found:
            if self.backends[url].in_flight == 0:
                del self.backends[url]
                self.on_change(url, None)

    async def _check(self, session: aiohttp.ClientSession, backend: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        answered = False
        try:
            async with session.get(backend.url + "/health", timeout=timeout) as response:
                healthy, answered = response.status == 200, True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            healthy = False
        self._note_answer(backend, answered)
        if healthy:
            cards = await fetch_model_cards(session, backend.url, timeout)
            backend.models = frozenset(str(c["id"]) for c in cards or ()) or backend.models
        self.set_health(backend, healthy)

    def _note_answer(self, backend: Backend, answered: bool) -> None:
        """Count ``backend``'s unanswered checks; freeze it at ``FROZEN_AFTER_CHECKS``."""
        if answered:
            backend.unanswered = 0
            if backend.frozen.is_set():
                backend.frozen = asyncio.Event()
            return
        backend.unanswered += 1
        if backend.unanswered >= FROZEN_AFTER_CHECKS and not backend.frozen.is_set():
            if backend.in_flight:
                logger.warning(
                    "backend %s has not answered %d health checks: ending its %d requests "
                    "in flight", backend.url, backend.unanswered, backend.in_flight,
                )  # fmt: skip
            backend.frozen.set()

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Check the backends every ``interval_s`` seconds, forever."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh(session)
            except Exception:  # a check must never end the loop
                logger.exception("health check failed")

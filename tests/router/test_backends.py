"""The router's backend pool: health checks and DNS discovery, against a small aiohttp
server on loopback."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from tokenmill.router.backends import BackendPool


async def _serve(status: list[int]) -> tuple[web.AppRunner, int]:
    async def health(_: web.Request) -> web.Response:
        return web.Response(status=status[0])

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def test_health_checks_and_dns_discovery():
    async def scenario() -> None:
        status = [200]
        runner, port = await _serve(status)
        changes: list[tuple[str, bool | None]] = []
        try:
            pool = BackendPool(
                [f"http://localhost:{port}", f"http://127.0.0.1:{port + 1 if port < 65535 else 1}"],
                resolve_names=True,
                timeout_s=2.0,
                on_change=lambda url, healthy: changes.append((url, healthy)),
            )
            async with aiohttp.ClientSession() as session:
                await pool.refresh(session)
                ours = f"http://127.0.0.1:{port}"
                assert ours in pool.backends and pool.backends[ours].healthy
                assert [b.url for b in pool.healthy()] == [ours]  # (nothing on port + 1)
                status[0] = 503
                await pool.refresh(session)
                assert not pool.healthy()
                assert (ours, False) in changes
                pool.configured = [pool.configured[1]]  # the name no longer resolves to us
                await pool.refresh(session)
                assert ours not in pool.backends and (ours, None) in changes
        finally:
            await runner.cleanup()

    asyncio.run(scenario())

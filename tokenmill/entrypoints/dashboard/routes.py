"""Routes of the live web view: ``GET /dashboard``, its static files and its data.

- ``GET /dashboard``: the page (HTML; charts drawn by the vendored uPlot)
- ``GET /dashboard/static/{name}``: the page's script, styles and chart library
- ``GET /dashboard/api/stats``: the model and its configuration, and the engine statistics
  of the last minutes (``DashboardStatLogger.snapshot``)

With ``--api-key`` the routes check the key themselves: a browser cannot send a bearer
token when it opens a page, so besides ``Authorization: Bearer <key>`` they take HTTP Basic
credentials (any user name, the key as password; RFC 7617) and answer 401 with a Basic
challenge, which makes the browser ask for them once and send them with the page's polls.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.entrypoints.dashboard.timeseries import DashboardStatLogger
from tokenmill.version import __version__

DASHBOARD_PATH = "/dashboard"
STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
# The files the page may load (nothing else under the package is served).
STATIC_FILES = frozenset(name for name in os.listdir(STATIC_DIR) if not name.startswith("."))
_MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
CHALLENGE = {"WWW-Authenticate": 'Basic realm="tokenmill dashboard", charset="UTF-8"'}


def is_dashboard_path(path: str) -> bool:
    """Whether ``path`` is one of the dashboard's (which check the API key themselves)."""
    return path == DASHBOARD_PATH or path.startswith(DASHBOARD_PATH + "/")


def key_matches(authorization: str, api_key: str) -> bool:
    """Whether an ``Authorization`` header carries ``api_key``: as a bearer token, or as the
    password of Basic credentials. Compared in constant time."""
    scheme, _, value = authorization.partition(" ")
    scheme = scheme.lower()
    if scheme == "bearer":
        return hmac.compare_digest(value.strip().encode(), api_key.encode())
    if scheme == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            return False
        _, _, password = decoded.partition(b":")
        return hmac.compare_digest(password, api_key.encode())
    return False


def _require_key(request: Request) -> None:
    api_key: str | None = request.app.state.dashboard_api_key
    if api_key and not key_matches(request.headers.get("authorization", ""), api_key):
        raise StarletteHTTPException(
            401,
            "The dashboard needs the server's API key (as a bearer token, or as the "
            "password of HTTP Basic credentials).",
            headers=CHALLENGE,
        )


router = APIRouter(dependencies=[Depends(_require_key)], include_in_schema=False)


@router.get(DASHBOARD_PATH)
async def dashboard_page() -> Response:
    return FileResponse(os.path.join(STATIC_DIR, "index.html"), media_type="text/html")


@router.get(DASHBOARD_PATH + "/static/{name}")
async def dashboard_static(name: str) -> Response:
    if name not in STATIC_FILES:
        raise StarletteHTTPException(404, f"No dashboard file {name!r}.")
    media_type = _MEDIA_TYPES.get(os.path.splitext(name)[1], "text/plain")
    return FileResponse(os.path.join(STATIC_DIR, name), media_type=media_type)


@router.get(DASHBOARD_PATH + "/api/stats")
async def dashboard_stats(request: Request) -> JSONResponse:
    state = request.app.state
    stats: DashboardStatLogger | None = state.dashboard_stats
    return JSONResponse(
        {
            "model": model_info(state.engine),
            "stats": stats.snapshot() if stats is not None else None,
        },
        headers={"Cache-Control": "no-store"},
    )


def model_info(engine: Any) -> dict[str, Any]:
    """The served model and the engine settings a reader of the dashboard wants to see."""
    config = engine.config
    mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
    return {
        "served_model_name": mc.served_model_name,
        "model": mc.model,
        "version": __version__,
        "max_model_len": mc.max_model_len,
        "dtype": str(mc.dtype).removeprefix("torch."),
        "device": config.device_config.device,
        "block_size": cc.block_size,
        "num_kv_blocks": cc.num_blocks,
        "enable_prefix_caching": cc.enable_prefix_caching,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "statistics": not config.disable_log_stats,
    }


def install_dashboard(app: FastAPI, engine: Any, api_key: str | None) -> None:
    """Serve the dashboard of ``engine`` on ``app``.

    Args:
        app: the server's app.
        engine: AsyncLLM (its ``DashboardStatLogger``, if any, feeds the charts) or
            AsyncEmbeddingEngine (configuration only).
        api_key: the server's ``--api-key``; None: the dashboard is open.
    """
    loggers = getattr(engine, "stat_loggers", [])
    app.state.dashboard_stats = next(
        (s for s in loggers if isinstance(s, DashboardStatLogger)), None
    )
    app.state.dashboard_api_key = api_key
    app.include_router(router)

"""How the HTTP server talks to the world, as ``vllm serve``'s flags set it: TLS
(``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs``, ``--ssl-cert-reqs``), extra ASGI
middleware (``--middleware``), and the in-flight request count behind ``GET /load``
(``--enable-server-load-tracking``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import ssl
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.config import ConfigError

# The routes whose requests --enable-server-load-tracking counts: the ones that run the
# model (vLLM counts the same set).
LOAD_TRACKED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/messages", "/tokenize", "/detokenize",
})


def add_transport_args(group: argparse._ArgumentGroup) -> None:
    """TLS, middleware and load-tracking flags (``vllm serve``'s names and meanings)."""
    group.add_argument("--ssl-keyfile", default=None,
                       help="Serve HTTPS: the TLS private key file (PEM).")
    group.add_argument("--ssl-certfile", default=None,
                       help="Serve HTTPS: the TLS certificate chain file (PEM).")
    group.add_argument("--ssl-ca-certs", default=None,
                       help="CA certificates (PEM) that client certificates are checked against.")
    group.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                       choices=[int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL),
                                int(ssl.CERT_REQUIRED)],
                       help="Client certificates: 0 not asked for, 1 checked if sent, 2 "
                       "required (Python's ssl.CERT_* values). (default: 0)")
    group.add_argument("--middleware", action="append", default=[],
                       help="An ASGI middleware to add, as an import path (module.name); a "
                       "class is added with app.add_middleware, a function as an 'http' "
                       "middleware. The flag may repeat; the last given is the outermost.")
    group.add_argument("--enable-server-load-tracking", action="store_true",
                       help="Count the requests in flight on the model's routes; GET /load "
                       "returns the count as {\"server_load\": N} (0 without this flag).")


def check_transport(args: argparse.Namespace) -> None:
    """Check the TLS files and middleware imports before anything starts.

    Raises:
        ConfigError: a TLS file that cannot be read, a key without a certificate (or the
            reverse), CA certificates without TLS, or a middleware that cannot be imported
            or is neither a class nor a function.
    """
    key, cert = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    ca_certs, cert_reqs = getattr(args, "ssl_ca_certs", None), getattr(args, "ssl_cert_reqs", 0)
    if bool(key) != bool(cert):
        raise ConfigError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
    for flag, path in (("--ssl-keyfile", key), ("--ssl-certfile", cert),
                       ("--ssl-ca-certs", ca_certs)):
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{flag}: cannot read {path}")
    if not cert and (ca_certs or cert_reqs):
        raise ConfigError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile")
    if cert_reqs and not ca_certs:
        raise ConfigError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs, the CAs that client "
                          "certificates are checked against")
    if cert:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(cert, key, password=_no_passphrase)
        except _EncryptedKey:
            raise ConfigError(f"--ssl-keyfile {key}: the key is encrypted; give an "
                              "unencrypted one") from None
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"--ssl-certfile/--ssl-keyfile: not a usable pair: {e}") from None
        if ca_certs:
            try:
                context.load_verify_locations(cafile=ca_certs)
            except (ssl.SSLError, OSError) as e:
                raise ConfigError(f"--ssl-ca-certs {ca_certs}: not PEM certificates: {e}"
                                  ) from None
    for path in getattr(args, "middleware", None) or []:
        _import_middleware(path)


def uvicorn_tls(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's TLS keywords for the flags (empty without --ssl-certfile)."""
    if not getattr(args, "ssl_certfile", None):
        return {}
    return dict(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)


def install_transport(app: FastAPI, args: argparse.Namespace) -> None:
    """Add --middleware's middleware, the load counter and ``GET /load`` to ``app``."""
    app.state.server_load = 0

    @app.get("/load")
    async def load() -> JSONResponse:
        return JSONResponse({"server_load": app.state.server_load})

    if getattr(args, "enable_server_load_tracking", False):
        app.add_middleware(LoadTrackingMiddleware, state=app.state)
    for path in getattr(args, "middleware", None) or []:
        obj = _import_middleware(path)
        if inspect.isclass(obj):
            app.add_middleware(obj)
        else:
            app.middleware("http")(obj)


class LoadTrackingMiddleware:
    """Counts the requests in flight on ``LOAD_TRACKED_PATHS`` in ``state.server_load``: up
    when one arrives, down when its response (a whole stream included) has been sent or the
    client went away."""

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # behind --root-path the prefix is still there
            path = path[len(root):]
        if scope["type"] != "http" or path not in LOAD_TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


class _EncryptedKey(Exception):
    pass


def _no_passphrase() -> str:
    # ssl asks for a passphrase only for an encrypted key; a server cannot type one.
    raise _EncryptedKey


def _import_middleware(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"--middleware {path}: not an import path (module.name)")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except Exception as e:  # noqa: BLE001 (the module's own error, whatever it is)
        raise ConfigError(f"--middleware {path}: cannot import it: "
                          f"{type(e).__name__}: {e}") from None
    if inspect.isclass(obj):
        try:  # an ASGI middleware class is built with the app alone
            inspect.signature(obj).bind(object())
        except (TypeError, ValueError):
            raise ConfigError(f"--middleware {path}: the class must be constructible with "
                              "the app as its only argument") from None
    elif not inspect.iscoroutinefunction(obj):
        raise ConfigError(f"--middleware {path}: neither a class nor an async function")
    return obj

"""The API key check (``--api-key``): every route but the probes and the dashboard (which
checks the key itself) needs the key."""

from __future__ import annotations

import hmac
from http import HTTPStatus

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.entrypoints.anthropic.errors import error_response_for
from tokenmill.entrypoints.dashboard.routes import is_dashboard_path
from tokenmill.entrypoints.openai.errors import OpenAIError

# Routes that answer without an API key (probes and scrapers).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
UNAUTHORIZED = (
    "Invalid or missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'."
)


class APIKeyMiddleware:
    """Requires the key, as ``Authorization: Bearer <key>`` (OpenAI's clients) or
    ``x-api-key: <key>`` (Anthropic's), on every route but OPEN_PATHS and the dashboard's
    (``/dashboard``, whose routes check the key themselves, also as HTTP Basic credentials so
    that a browser can ask for it).

    The key is compared in constant time (``hmac.compare_digest``), so response timing does
    not leak how much of a guess was right. CORS preflight (OPTIONS) requests pass. A refusal
    is a 401 in OpenAI's error shape, or Anthropic's on /v1/messages.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if path in OPEN_PATHS or is_dashboard_path(path) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = OpenAIError(UNAUTHORIZED, HTTPStatus.UNAUTHORIZED, code="invalid_api_key")
        await error_response_for(scope, error)(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        bearer = b""
        key = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                bearer = value
            elif name == b"x-api-key":
                key = value
        scheme, _, token = bearer.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
            return True
        return key is not None and hmac.compare_digest(key.strip(), self.api_key)

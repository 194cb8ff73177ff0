"""A cap on request body size: a 413 in the API's error format instead of a body read whole.

Starlette reads a request's body into memory before FastAPI parses it, and the parsed JSON
takes several times the body's bytes again, so one client sending a body of gigabytes could
exhaust the server's memory for everyone. A body past the cap is refused as soon as that is
known: from its ``Content-Length`` before any of it is read, or, for a chunked body, at the
chunk that crosses the cap (the bytes before it are dropped, not parsed). Off with
``TOKENMILL_MAX_REQUEST_BODY_BYTES=0``.
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill import envs
from tokenmill.entrypoints.openai.errors import OpenAIError

# How an error is answered on a request's path (the error body's shape is the API's).
ErrorResponder = Callable[[Scope, OpenAIError], Response]


def add_body_size_limit(app: FastAPI, error_response: ErrorResponder | None = None) -> None:
    """Wrap ``app`` in the limit ``TOKENMILL_MAX_REQUEST_BODY_BYTES`` sets (none at 0). Add it
    after any authentication middleware, so that it runs first: an unauthenticated client
    must not get a large body read either. ``error_response`` answers the 413 (by default
    in OpenAI's format)."""
    max_bytes = envs.max_request_body_bytes()
    if max_bytes > 0:
        app.add_middleware(
            BodySizeLimitMiddleware, max_bytes=max_bytes, error_response=error_response
        )


class BodySizeLimitMiddleware:
    """Refuses HTTP requests whose body is over ``max_bytes`` with a 413.

    A declared ``Content-Length`` over the cap is answered here, before the app runs. A
    chunked body raises ``HTTPException(413)`` from ``receive`` at the chunk that crosses
    the cap, which FastAPI's body parsing passes on to the app's HTTP error handler.

    Args:
        app: the ASGI app to wrap.
        max_bytes: the largest body accepted, in bytes (> 0).
        error_response: answers the 413 of a declared length; None: in OpenAI's format.

    Raises:
        ValueError: ``max_bytes`` is not positive.
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, error_response: ErrorResponder | None = None
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self.error_response = error_response or (lambda _, error: error.to_response())
        self.message = (
            f"The request body is larger than the server's limit of {max_bytes} bytes "
            "(TOKENMILL_MAX_REQUEST_BODY_BYTES)."
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            error = OpenAIError(self.message, HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            response = self.error_response(scope, error)
            # The client may still be sending: close the connection rather than read the rest.
            response.headers.update(_CLOSE)
            await response(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(
                        HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self.message, headers=_CLOSE
                    )
            return message

        await self.app(scope, counting_receive, send)


_CLOSE = {"Connection": "close"}


def _content_length(scope: Scope) -> int | None:
    """The request's ``Content-Length`` in bytes, None when absent or not a number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None

"""ASGI middleware for ``--middleware`` tests: one class, one function, one of neither."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class TagResponses:
    """Adds ``x-tagged: class`` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-tagged", b"class")]
            await send(message)

        await self.app(scope, receive, send if scope["type"] != "http" else tagged)


async def tag_function(request, call_next):
    """Adds ``x-function: yes`` to every HTTP response."""
    response = await call_next(request)
    response.headers["x-function"] = "yes"
    return response


NOT_MIDDLEWARE = 42


class NeedsArgs:
    """A middleware class that cannot be built from the app alone."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app = app
        self.secret = secret

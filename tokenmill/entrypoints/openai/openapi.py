"""The server's OpenAPI document: what each route answers, with which content type.

FastAPI builds the document from the same pydantic models that validate the requests (their
bounds included, see protocol.py). This module adds what FastAPI cannot infer from a route
that returns a ``Response``: each response's model and content type (a stream's
``text/event-stream`` beside the JSON body, /health's empty body, /metrics' Prometheus text),
and the errors the server answers in OpenAI's format (Anthropic's on /v1/messages). FastAPI's
own 422 is dropped: the server answers an invalid body with a 400.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tokenmill.entrypoints.openai.protocol import ErrorResponse

_ERROR_DESCRIPTIONS = {
    400: "Invalid request (OpenAI's error body, whose `param` names the field at fault; on "
    "/v1/messages Anthropic's, whose message starts with it).",
    401: "Missing or wrong API key (only when the server was started with --api-key).",
    404: "No such model (on /v1/responses also: no such stored response).",
    413: "The request body is larger than the server accepts.",
    429: "The grammar compilers are busy with other structured-output constraints: retry.",
    503: "The engine is not running, or the server is shutting down.",
}


def event_stream(description: str) -> dict[str, Any]:
    """The ``text/event-stream`` content of a route that streams. Its schema describes one
    event (OpenAPI 3.1 has no schema for a stream as a whole): its ``data`` text, and the
    ``event`` name where the API sends one."""
    event = {
        "type": "object",
        "description": description,
        "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
        "required": ["data"],
    }
    return {"text/event-stream": {"schema": event}}


SSE_CONTENT = event_stream(
    "With `stream: true`: server-sent events, each `data: ` and one JSON chunk (or an error "
    "body), ending with `data: [DONE]`."
)


def errors(*statuses: int, body: type[BaseModel] = ErrorResponse) -> dict[int | str, dict]:
    """The documented error responses of a route, each with the error ``body`` (OpenAI's)."""
    return {s: {"model": body, "description": _ERROR_DESCRIPTIONS[s]} for s in statuses}


def answers(
    model: type[BaseModel],
    *statuses: int,
    stream: bool | dict[str, Any] = False,
    error_body: type[BaseModel] = ErrorResponse,
) -> dict:
    """A route's documented responses: ``model`` as its JSON body (and server-sent events
    when it can ``stream``: chat's chunks, or the ``event_stream`` given), and the errors
    ``statuses`` with ``error_body``."""
    ok: dict[str, Any] = {"model": model, "description": "Success."}
    if stream:
        ok["content"] = SSE_CONTENT if stream is True else stream
    return {200: ok, **errors(400, 401, 413, *statuses, body=error_body)}


def install_openapi(app: FastAPI) -> None:
    """Serve ``app``'s document without FastAPI's 422 responses and their schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title, version=app.version, routes=app.routes, servers=app.servers
            )
            for operations in doc.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = doc.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

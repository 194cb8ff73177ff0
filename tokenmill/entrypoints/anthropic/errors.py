"""Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}`` with the HTTP
status, the ``type`` named as Anthropic's API names it for that status."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import Scope

from tokenmill.entrypoints.openai.errors import OpenAIError

# The Messages API's routes: their errors take Anthropic's shape, also those answered before
# a route runs (the API key check, the body size limit).
MESSAGES_PATH = "/v1/messages"

_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
}


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    """The error body for ``status`` (``api_error`` for server-side failures)."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def from_openai_error(error: OpenAIError) -> tuple[dict[str, Any], int]:
    """An error of the shared handlers in Anthropic's shape: the field it names leads the
    message (Anthropic's body has no ``param``)."""
    message = error.message
    if error.param and not message.startswith(error.param):
        message = f"{error.param}: {message}"
    return anthropic_error_body(message, error.status), error.status


def error_response(error: OpenAIError) -> JSONResponse:
    body, status = from_openai_error(error)
    return JSONResponse(body, status_code=status)


def error_event(error: OpenAIError) -> str:
    """The error as a streamed ``error`` event (after the stream has begun)."""
    body, _ = from_openai_error(error)
    return f"event: error\ndata: {json.dumps(body)}\n\n"


def error_response_for(scope: Scope, error: OpenAIError) -> JSONResponse:
    """``error`` answered in the shape of the API that ``scope``'s path belongs to:
    Anthropic's on the Messages API's routes, OpenAI's elsewhere."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :] or "/"
    if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):
        return error_response(error)
    return error.to_response()

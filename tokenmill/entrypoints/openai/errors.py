"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every failing route of the server answers with this body (the OpenAI API's error format), so
SDKs raise their usual typed exceptions (``BadRequestError``, ``AuthenticationError``,
``NotFoundError``...).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

# The `type` field for each status, as the OpenAI API fills it.
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "invalid_request_error",
    HTTPStatus.NOT_FOUND: "invalid_request_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.UNPROCESSABLE_ENTITY: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.INTERNAL_SERVER_ERROR: "server_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "server_error",
}


class OpenAIError(Exception):
    """An error to return to the client as an OpenAI error body.

    Args:
        message: what went wrong, for the user.
        status: the HTTP status (400 by default).
        param: the request field at fault, if one.
        code: a short machine-readable code (e.g. ``model_not_found``), if one.
        err_type: the OpenAI error type; derived from ``status`` when None.
    """

    def __init__(
        self,
        message: str,
        status: int = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.code = code
        self.err_type = err_type or error_type(self.status)

    def to_dict(self) -> dict[str, Any]:
        """The ``{"error": {...}}`` body."""
        return error_body(self.message, self.err_type, self.param, self.code)

    def to_response(self) -> JSONResponse:
        """A JSON response with the error body and status."""
        return JSONResponse(self.to_dict(), status_code=self.status)

    def to_sse(self) -> str:
        """The error as one server-sent event (for failures after a stream has begun)."""
        return f"data: {json.dumps(self.to_dict())}\n\n"


def error_type(status: int) -> str:
    """The OpenAI error ``type`` for an HTTP status."""
    try:
        return _ERROR_TYPES.get(HTTPStatus(status), "invalid_request_error")
    except ValueError:
        return "invalid_request_error"


def error_body(
    message: str, err_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``.

    A message that quotes the request (a model name, say) may hold text that UTF-8 cannot
    encode (lone surrogates): those characters are escaped, so the error itself can be sent.
    """
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 ``invalid_request_error``."""
    return OpenAIError(message, HTTPStatus.BAD_REQUEST, param, code)


# Longest piece of a client's text quoted back in an error message (characters).
MAX_QUOTED_CHARS = 256


def model_not_found(model: str) -> OpenAIError:
    """A 404 for a model name that is not served (the OpenAI API's wording and code); a name
    longer than ``MAX_QUOTED_CHARS`` is quoted shortened."""
    if len(model) > MAX_QUOTED_CHARS:
        model = f"{model[:MAX_QUOTED_CHARS]}... ({len(model)} characters)"
    return OpenAIError(
        f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "model", "model_not_found"
    )


def engine_dead(detail: str) -> OpenAIError:
    """A 503: the engine process is gone, so no request can be served."""
    return OpenAIError(
        f"The engine is not running: {detail}",
        HTTPStatus.SERVICE_UNAVAILABLE,
        code="engine_dead",
    )

"""Routes of Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

The body is read and checked here rather than by FastAPI, so that every error, a malformed
body included, answers in Anthropic's shape (``errors.py``); the OpenAPI document describes
the body, the answers and those errors all the same.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.entrypoints.anthropic.errors import anthropic_error_body, error_response
from tokenmill.entrypoints.anthropic.protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from tokenmill.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from tokenmill.entrypoints.openai.errors import OpenAIError, bad_request
from tokenmill.entrypoints.openai.openapi import answers, event_stream
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_engine import cancel_on_disconnect, to_openai_error

router = APIRouter()
EVENTS = event_stream(
    "With `stream: true`: Anthropic's server-sent events, each `event: <type>` and `data: ` "
    "with its JSON, from `message_start` to `message_stop` (or an `error` event)."
)


def _documented(
    request: type[BaseModel], answer: type[BaseModel], *statuses: int, stream: bool = False
) -> dict[str, Any]:
    """A route's arguments for the OpenAPI document: its JSON ``request`` body (read by the
    route itself), its ``answer`` and its errors in Anthropic's shape."""
    return {
        "responses": answers(
            answer, *statuses, stream=EVENTS if stream else False,
            error_body=AnthropicErrorResponse,
        ),
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": request.model_json_schema()}},
            }
        },
    }  # fmt: skip


async def _parse(raw_request: Request, model: type[MessagesRequest]) -> MessagesRequest:
    """The request body as a MessagesRequest.

    Raises:
        OpenAIError: 400 for a body that is not JSON or not a Messages request (naming the
            first field at fault, e.g. a missing ``max_tokens``).
    """
    try:
        body = json.loads(await raw_request.body())
    except StarletteHTTPException as e:  # the body is over the size limit (a 413)
        raise OpenAIError(str(e.detail), e.status_code) from None
    except ValueError as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        loc = ".".join(str(p) for p in error.get("loc", ()))
        raise bad_request(f"{loc}: {error.get('msg')}", loc or None) from None


async def _answer(
    raw_request: Request,
    handler: Callable[[Any], Awaitable[Any]],
    watch: bool,
    model: type[MessagesRequest] = MessagesRequest,
) -> Response:
    """Read the body, run ``handler`` on it (cancelled if the client leaves, when
    ``watch``); every error in Anthropic's shape."""
    try:
        request = await _parse(raw_request, model)  # before the disconnect watch reads the socket
        if watch:
            result = await cancel_on_disconnect(raw_request, handler(request))
        else:
            result = await handler(request)
    except Exception as e:
        error = e if isinstance(e, OpenAIError) else to_openai_error(e)
        return error_response(error)
    return result if isinstance(result, Response) else JSONResponse(result)


@router.post(
    "/v1/messages", **_documented(MessagesRequest, MessageResponse, 404, 429, 503, stream=True)
)
async def create_message(raw_request: Request) -> Response:
    serving: AnthropicServingMessages = raw_request.app.state.serving_messages
    return await _answer(raw_request, serving.create, watch=True)


@router.post(
    "/v1/messages/count_tokens", **_documented(CountTokensRequest, CountTokensResponse, 404, 503)
)
async def count_message_tokens(raw_request: Request) -> Response:
    serving: AnthropicServingMessages = raw_request.app.state.serving_messages
    return await _answer(raw_request, serving.count_tokens, False, CountTokensRequest)


def add_messages_api(app: FastAPI, chat: OpenAIServingChat) -> None:
    """Serve Anthropic's Messages API on ``app`` through the chat handler ``chat``."""
    app.state.serving_messages = AnthropicServingMessages(chat)
    app.include_router(router)


__all__ = ["add_messages_api", "anthropic_error_body"]

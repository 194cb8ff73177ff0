"""Routes of the Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.openai.agent_args import DEFAULT_STORED_RESPONSES
from tokenmill.entrypoints.openai.openapi import answers, event_stream
from tokenmill.entrypoints.openai.responses_input import ResponsesRequest
from tokenmill.entrypoints.openai.responses_output import ResponseDeleted, ResponseObject
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_engine import cancel_on_disconnect
from tokenmill.entrypoints.openai.serving_responses import OpenAIServingResponses

router = APIRouter()
EVENTS = event_stream(
    "With `stream: true`: the Responses API's server-sent events, each `event: <type>` and "
    "`data: ` with its JSON, from `response.created` to `response.completed` (or "
    "`response.failed`)."
)


def _serving(raw_request: Request) -> OpenAIServingResponses:
    return raw_request.app.state.serving_responses


@router.post("/v1/responses", responses=answers(ResponseObject, 404, 429, 503, stream=EVENTS))
async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
    return await cancel_on_disconnect(raw_request, _serving(raw_request).create(request))


@router.get("/v1/responses/{response_id}", responses=answers(ResponseObject, 404))
async def retrieve_response(response_id: str, raw_request: Request) -> Response:
    return JSONResponse(_serving(raw_request).get(response_id))


@router.delete("/v1/responses/{response_id}", responses=answers(ResponseDeleted, 404))
async def delete_response(response_id: str, raw_request: Request) -> Response:
    return JSONResponse(_serving(raw_request).delete(response_id))


def add_responses_api(
    app: FastAPI, chat: OpenAIServingChat, max_stored_responses: int | None = None
) -> None:
    """Serve the Responses API on ``app`` through the chat handler ``chat``."""
    if max_stored_responses is None:
        max_stored_responses = DEFAULT_STORED_RESPONSES
    app.state.serving_responses = OpenAIServingResponses(chat, max_stored_responses)
    app.include_router(router)

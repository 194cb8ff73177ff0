"""Sleep mode and weight updates over HTTP (vLLM's routes), served with
``--enable-sleep-mode``:

- ``POST /sleep?level=1|2``: free the weights (level 1 keeps them in host memory) and the
  KV cache. Requests in flight pause and finish after ``/wake_up``; new generation
  requests get a 503 while the engine sleeps.
- ``POST /wake_up`` (``?tags=weights`` / ``?tags=kv_cache`` for one part): bring them back.
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``.
- ``POST /update_weights`` with ``{"model_path": ...}``: load new weights in place from a
  model folder or ``.safetensors`` file (or a ``.gguf`` file); the prefix cache is emptied.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from tokenmill.engine.async_llm import AsyncLLM, EngineCallError, EngineDeadError
from tokenmill.entrypoints.openai.errors import OpenAIError, bad_request, engine_dead
from tokenmill.entrypoints.openai.openapi import errors

router = APIRouter()
# An empty 200, or OpenAI's error body (400 also when the server runs without sleep mode).
_EMPTY = {200: {"description": "Done (an empty body)."}, **errors(400, 401, 503)}


class IsSleepingResponse(BaseModel):
    """``GET /is_sleeping``."""

    is_sleeping: bool


class UpdateWeightsRequest(BaseModel):
    """``POST /update_weights``: where the new weights are."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model_path: str


def _engine(raw_request: Request) -> AsyncLLM:
    engine = raw_request.app.state.engine
    if not engine.config.enable_sleep_mode:
        raise bad_request("sleep mode is off: start the server with --enable-sleep-mode.")
    return engine


async def _call(call) -> Response:
    try:
        await call
    except EngineCallError as e:
        raise bad_request(str(e)) from None
    except EngineDeadError as e:
        raise engine_dead(str(e)) from None
    return Response(status_code=200)


@router.post("/sleep", response_class=Response, responses=_EMPTY)
async def sleep(raw_request: Request, level: Annotated[int, Query()] = 1) -> Response:
    if level not in (1, 2):
        raise bad_request(f"level must be 1 or 2, got {level}.", "level")
    return await _call(_engine(raw_request).sleep(level))


@router.post("/wake_up", response_class=Response, responses=_EMPTY)
async def wake_up(
    raw_request: Request, tags: Annotated[list[str] | None, Query()] = None
) -> Response:
    return await _call(_engine(raw_request).wake_up(tags))


@router.get(
    "/is_sleeping",
    responses={
        200: {"model": IsSleepingResponse, "description": "Success."},
        **errors(400, 401, 503),
    },
)
async def is_sleeping(raw_request: Request) -> JSONResponse:
    try:
        sleeping = await _engine(raw_request).is_sleeping()
    except EngineDeadError as e:
        raise engine_dead(str(e)) from None
    return JSONResponse({"is_sleeping": sleeping})


@router.post(
    "/update_weights",
    response_class=Response,
    responses={**_EMPTY, **errors(400, 401, 413, 503)},
)
async def update_weights(request: UpdateWeightsRequest, raw_request: Request) -> Response:
    return await _call(_engine(raw_request).update_weights(request.model_path))


def asleep_error() -> OpenAIError:
    """The 503 of a generation request that arrives while the engine sleeps."""
    return OpenAIError(
        "The engine is sleeping; it serves requests again after POST /wake_up.", 503
    )

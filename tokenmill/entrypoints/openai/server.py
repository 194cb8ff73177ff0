"""The OpenAI-compatible routes and the error handlers every route shares.

- POST /v1/chat/completions, /v1/completions (streaming or not), GET /v1/models
- POST /v1/embeddings, when the model is an embedding model (then the two above answer 400);
  its engine (AsyncEmbeddingEngine) runs in an engine process too
- POST /tokenize, /detokenize
- GET /health (200 while the engine runs, 503 once it is dead), /metrics (Prometheus), /version

Every error answers with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
The app that serves these beside the other APIs, and its run loop, are in
``entrypoints/api_server.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import re
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_llm import AsyncLLM, EngineDeadError
from tokenmill.engine.input_processor import InvalidRequestError
from tokenmill.entrypoints.openai.chat_images import attach_images, check_model_takes_images
from tokenmill.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    engine_dead,
    error_body,
    error_type,
    model_not_found,
)
from tokenmill.entrypoints.openai.openapi import answers, errors
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.entrypoints.openai.serving_embedding import (
    OpenAIServingEmbedding,
    not_generative,
)
from tokenmill.entrypoints.openai.serving_engine import (
    cancel_on_disconnect,
    to_openai_error,
)
from tokenmill.version import __version__

logger = logging.getLogger("tokenmill.entrypoints.openai.server")


router = APIRouter()


# ---- routes ------------------------------------------------------------------------------------


@router.get(
    "/health",
    response_class=Response,
    responses={200: {"description": "The engine runs (an empty body)."}, **errors(503)},
)
@router.head("/health", include_in_schema=False)  # one operation id in the schema, not two
async def health(raw_request: Request) -> Response:
    """200 while the engine process runs; 503 (with the reason) once it has died."""
    try:
        raw_request.app.state.engine.check_health()
    except EngineDeadError as e:
        return engine_dead(str(e)).to_response()
    return Response(status_code=HTTPStatus.OK)


class VersionResponse(BaseModel):
    version: str


@router.get("/version", responses={200: {"model": VersionResponse, "description": "Success."}})
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus text format; names start with tokenmill:."}},
)
async def metrics(raw_request: Request) -> Response:
    """Prometheus text format."""
    registry: CollectorRegistry = raw_request.app.state.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _model_cards(raw_request: Request) -> list[ModelCard]:
    """One card per served name (``--served-model-name a b``), the responses' name first,
    then one per LoRA adapter."""
    models = getattr(raw_request.app.state, "models", None)
    if models is not None:
        return models.cards()
    mc = raw_request.app.state.engine.model_config
    return [
        ModelCard(id=name, root=mc.model, max_model_len=mc.max_model_len)
        for name in mc.served_model_names
    ]


@router.get("/v1/models", responses=answers(ModelList))
async def list_models(raw_request: Request) -> Response:
    cards = _model_cards(raw_request)
    return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")


@router.get("/v1/models/{model:path}", responses=answers(ModelCard, 404))
async def retrieve_model(model: str, raw_request: Request) -> Response:
    """The card of one of the served names; 404 (model_not_found) for any other id."""
    for card in _model_cards(raw_request):
        if card.id == model:
            return Response(card.model_dump_json(), media_type="application/json")
    raise model_not_found(model)


@router.post(
    "/v1/chat/completions",
    responses=answers(ChatCompletionResponse, 404, 429, 503, stream=True),
)
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    serving: OpenAIServingChat | None = raw_request.app.state.serving_chat
    if serving is None:
        raise not_generative(raw_request.app.state.engine.model_config.served_model_name)
    return await cancel_on_disconnect(
        raw_request, serving.create_chat_completion(request, raw_request)
    )


@router.post(
    "/v1/completions", responses=answers(CompletionResponse, 404, 429, 503, stream=True)
)
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    serving: OpenAIServingCompletion | None = raw_request.app.state.serving_completion
    if serving is None:
        raise not_generative(raw_request.app.state.engine.model_config.served_model_name)
    return await cancel_on_disconnect(raw_request, serving.create_completion(request, raw_request))


@router.post("/v1/embeddings", responses=answers(EmbeddingResponse, 404, 503))
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    serving: OpenAIServingEmbedding | None = raw_request.app.state.serving_embedding
    if serving is None:
        _tokenizing_serving(raw_request).check_model(request.model)  # an unknown one: 404
        name = raw_request.app.state.engine.model_config.served_model_name
        raise bad_request(
            f"The model `{name}` generates text; it is not an embedding model.", "model"
        )
    return await cancel_on_disconnect(raw_request, serving.create_embedding(request, raw_request))


def _tokenizing_serving(raw_request: Request) -> OpenAIServingChat | OpenAIServingEmbedding:
    """The handler whose tokenizer /tokenize and /detokenize use (the model's, either way)."""
    state = raw_request.app.state
    return state.serving_chat or state.serving_embedding


@router.post("/tokenize", responses=answers(TokenizeResponse, 404, 503))
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    """Token ids of a text ``prompt`` or of chat ``messages`` rendered with the template."""
    serving = _tokenizing_serving(raw_request)
    serving.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("Give exactly one of prompt and messages.", "prompt")
    # Off the event loop where the engine has a tokenizer pool, as generation requests are.
    off_loop = isinstance(serving.engine, AsyncLLM)
    try:
        if request.messages is not None:
            if off_loop and isinstance(serving, OpenAIServingChat):
                check_model_takes_images(serving.engine, request.messages)
                images: list[tuple[str, str]] = []
                tokens = await serving.render_prompt_async(request.messages, request, images)
                if images:  # the prompt as the engine gets it: each image's placeholders
                    tokens, _ = await attach_images(serving.engine, tokens, images)
            else:
                tokens = serving.render_prompt(request.messages, request)
        elif off_loop:
            tokens = await serving.engine.encode(request.prompt, request.add_special_tokens)
        else:
            tokens = serving.tokenizer.encode(
                request.prompt, add_special_tokens=request.add_special_tokens
            )
    except (TypeError, ValueError) as e:  # text the tokenizer rejects (a lone surrogate)
        param = "messages" if request.messages is not None else "prompt"
        if isinstance(e, InvalidRequestError):
            raise bad_request(str(e), e.param or param) from None
        raise bad_request(f"The text could not be tokenized: {e}", param) from None
    strs = serving.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
    response = TokenizeResponse(
        count=len(tokens),
        max_model_len=serving.model_config.max_model_len,
        tokens=tokens,
        token_strs=strs,
    )
    return Response(response.model_dump_json(), media_type="application/json")


@router.post("/detokenize", responses=answers(DetokenizeResponse, 404))
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    serving = _tokenizing_serving(raw_request)
    serving.check_model(request.model)
    vocab_size = serving.model_config.vocab_size
    bad = [t for t in request.tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"Token ids {bad[:5]} are out of the vocabulary [0, {vocab_size}).", "tokens"
        )
    # Off the event loop: decoding millions of ids takes seconds, and other requests wait.
    text = await asyncio.to_thread(serving.tokenizer.decode, request.tokens)
    return Response(
        DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json"
    )


# ---- errors ------------------------------------------------------------------------------------

# pydantic marks which member of a union it tried (``str``, ``list[ContentPart]``...) in an
# error's location; such tags are not request fields.
_UNION_TAG_RE = re.compile(r"^(str|int|float|bool|dict|list|none|function-\w+)(\[.*\])?$")


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """A 400 naming the first field at fault, for a body that is not a valid request."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request body.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return bad_request(f"The request body is not valid JSON: {detail}".rstrip(": "))
    if tuple(first.get("loc", ())) == ("body",) and isinstance(first.get("input"), str | bytes):
        # FastAPI parses a body as JSON only under a JSON content type (curl -d sends a form).
        return bad_request(
            "The request body must be a JSON object sent with Content-Type: application/json."
        )
    messages = []
    param = None
    for error in errors[:3]:
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        fields = [p for p in loc if not _UNION_TAG_RE.match(p)]
        path = ".".join(fields)
        if param is None and path:
            param = path
        text = error.get("msg", "invalid value")
        if error.get("type") == "missing" and not path:
            text = "A JSON request body is required."
        bound = _bound_text(error)
        entry = f"{path} {bound}" if bound and path else f"{path}: {text}" if path else text
        if entry not in messages:
            messages.append(entry)
    return bad_request("; ".join(messages), param)


# pydantic's bound errors, phrased as SamplingParams phrases its own checks.
_BOUNDS = {
    "greater_than_equal": ("ge", "greater than or equal to"),
    "greater_than": ("gt", "greater than"),
    "less_than_equal": ("le", "less than or equal to"),
    "less_than": ("lt", "less than"),
}


def _bound_text(error: dict[str, Any]) -> str | None:
    """``must be greater than or equal to 1, got 0.`` for a value past a field's bound."""
    kind = _BOUNDS.get(error.get("type", ""))
    ctx = error.get("ctx") or {}
    if kind is None or kind[0] not in ctx:
        return None
    value = error.get("input")
    if isinstance(value, float) and math.isnan(value):  # fails every bound: say what is wrong
        return f"must be a finite number, got {value!r}."
    return f"must be {kind[1]} {ctx[kind[0]]}, got {value!r}."


def add_error_handlers(app: FastAPI) -> None:
    async def on_openai_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return exc.to_response()

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc).to_response()

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        body = error_body(str(exc.detail), error_type(exc.status_code))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def on_invalid_request(_: Request, exc: Exception) -> Response:
        # Raised outside a handler's own error mapping (e.g. by the tokenizer): still a 400.
        return to_openai_error(exc).to_response()

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        err = OpenAIError(f"Internal server error: {type(exc).__name__}: {exc}", 500)
        return err.to_response()

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(InvalidRequestError, on_invalid_request)
    app.add_exception_handler(Exception, on_unexpected)


def parse_json_list(value: str) -> list[str]:
    """A flag given as a JSON list of strings (``--allowed-origins '["*"]'``).

    Raises:
        argparse.ArgumentTypeError: not a JSON list of strings.
    """
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed

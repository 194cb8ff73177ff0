"""The OpenAI-compatible HTTP server: FastAPI app, routes, auth, CORS, error handlers, run loop.

The HTTP server (this process) tokenizes, detokenizes and talks HTTP; the model loop runs in
the engine process (``AsyncLLM``), so neither stalls the other. Routes:

- POST /v1/chat/completions, /v1/completions (streaming or not), GET /v1/models
- POST /v1/embeddings, when the model is an embedding model (then the two above answer 400);
  its engine (AsyncEmbeddingEngine) runs in an engine process too
- POST /tokenize, /detokenize
- GET /health (200 while the engine runs, 503 once it is dead), /metrics (Prometheus), /version
- GET /dashboard, the live web view (``entrypoints/dashboard``; ``observability.py``)

Every error answers with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
SIGTERM or SIGINT stops accepting connections and gives running requests
``--shutdown-timeout`` seconds (default 0) to finish; the rest are aborted (their clients get an
error, in the stream or as the response), then the engine is shut down and the process exits
with 0. A second signal exits at once (code 128 + signal number).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import signal
import socket
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any, NoReturn

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.config import EngineConfig
from tokenmill.engine.async_llm import AsyncLLM, EngineDeadError
from tokenmill.engine.embedding_engine import AsyncEmbeddingEngine
from tokenmill.engine.input_processor import InvalidRequestError
from tokenmill.entrypoints.dashboard.routes import is_dashboard_path
from tokenmill.entrypoints.openai.body_limit import add_body_size_limit
from tokenmill.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    engine_dead,
    error_body,
    error_type,
    model_not_found,
)
from tokenmill.entrypoints.openai.observability import install_observability, make_stat_loggers
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    ErrorResponse,
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
    RequestLogger,
    cancel_on_disconnect,
    to_openai_error,
)
from tokenmill.gc_freeze import freeze_startup_heap
from tokenmill.metrics import make_registry
from tokenmill.version import __version__

logger = logging.getLogger("tokenmill.entrypoints.openai.server")

# After the shutdown timeout has aborted the running requests, how long their responses may
# take to end before uvicorn cancels them (a client that stopped reading, say) (seconds).
ABORTED_RESPONSE_GRACE_S = 5
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# On a second stop signal, how long aborted streams get to send their error event (seconds).
ABORT_FLUSH_S = 0.2
# Routes that answer without an API key (probes and scrapers).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})

router = APIRouter()
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 503)
}


# ---- routes ------------------------------------------------------------------------------------


@router.get("/health")
@router.head("/health", include_in_schema=False)  # one operation id in the schema, not two
async def health(raw_request: Request) -> Response:
    """200 while the engine process runs; 503 (with the reason) once it has died."""
    try:
        raw_request.app.state.engine.check_health()
    except EngineDeadError as e:
        return engine_dead(str(e)).to_response()
    return Response(status_code=HTTPStatus.OK)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    """Prometheus text format."""
    registry: CollectorRegistry = raw_request.app.state.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _model_cards(raw_request: Request) -> list[ModelCard]:
    """One card per served name (``--served-model-name a b``), the responses' name first."""
    mc = raw_request.app.state.engine.model_config
    return [
        ModelCard(id=name, root=mc.model, max_model_len=mc.max_model_len)
        for name in mc.served_model_names
    ]


@router.get("/v1/models", responses=_ERROR_RESPONSES)
async def list_models(raw_request: Request) -> Response:
    cards = _model_cards(raw_request)
    return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")


@router.get("/v1/models/{model:path}", responses=_ERROR_RESPONSES)
async def retrieve_model(model: str, raw_request: Request) -> Response:
    """The card of one of the served names; 404 (model_not_found) for any other id."""
    for card in _model_cards(raw_request):
        if card.id == model:
            return Response(card.model_dump_json(), media_type="application/json")
    raise model_not_found(model)


@router.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    serving: OpenAIServingChat | None = raw_request.app.state.serving_chat
    if serving is None:
        raise not_generative(raw_request.app.state.engine.model_config.served_model_name)
    return await cancel_on_disconnect(
        raw_request, serving.create_chat_completion(request, raw_request)
    )


@router.post("/v1/completions", responses=_ERROR_RESPONSES)
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    serving: OpenAIServingCompletion | None = raw_request.app.state.serving_completion
    if serving is None:
        raise not_generative(raw_request.app.state.engine.model_config.served_model_name)
    return await cancel_on_disconnect(raw_request, serving.create_completion(request, raw_request))


@router.post("/v1/embeddings", responses=_ERROR_RESPONSES)
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


@router.post("/tokenize", responses=_ERROR_RESPONSES)
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
                tokens = await serving.render_prompt_async(request.messages, request)
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


@router.post("/detokenize", responses=_ERROR_RESPONSES)
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
        entry = f"{path}: {text}" if path else text
        if entry not in messages:
            messages.append(entry)
    return bad_request("; ".join(messages), param)


def _add_error_handlers(app: FastAPI) -> None:
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


# ---- auth --------------------------------------------------------------------------------------


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every route but OPEN_PATHS.

    The key is compared in constant time (``hmac.compare_digest``), so response timing does
    not leak how much of a guess was right. CORS preflight (OPTIONS) requests pass.
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
        # (the dashboard's routes check the key themselves, also as Basic credentials)
        if path in OPEN_PATHS or is_dashboard_path(path) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = error_body(
            "Invalid or missing API key: send it as 'Authorization: Bearer <key>'.",
            "invalid_request_error",
            code="invalid_api_key",
        )
        response = JSONResponse(body, status_code=HTTPStatus.UNAUTHORIZED)
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)


# ---- app ---------------------------------------------------------------------------------------


def build_app(
    engine: AsyncLLM | AsyncEmbeddingEngine,
    args: argparse.Namespace,
    registry: CollectorRegistry,
    chat_template: str | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: the running AsyncLLM, or AsyncEmbeddingEngine for an embedding model.
        args: the server flags (api_key, allowed_origins/methods/headers, allow_credentials,
            disable_log_requests, max_log_len, response_role).
        registry: the Prometheus registry exposed at /metrics.
        chat_template: template text replacing the tokenizer's own, if given.
    """
    app = FastAPI(title="tokenmill", version=__version__)
    app.include_router(router)
    _add_error_handlers(app)
    api_key = getattr(args, "api_key", None)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    add_body_size_limit(app)  # outside the key check
    # Added last, so it is the outermost layer: preflight answers never need a key.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=getattr(args, "allowed_origins", ["*"]),
        allow_credentials=getattr(args, "allow_credentials", False),
        allow_methods=getattr(args, "allowed_methods", ["*"]),
        allow_headers=getattr(args, "allowed_headers", ["*"]),
    )
    request_logger = None
    if not getattr(args, "disable_log_requests", False):
        request_logger = RequestLogger(getattr(args, "max_log_len", None))
    state = app.state
    state.engine = engine
    state.registry = registry
    state.serving_chat = state.serving_completion = state.serving_embedding = None
    install_observability(app, engine, args, registry)
    if isinstance(engine, AsyncEmbeddingEngine):
        state.serving_embedding = OpenAIServingEmbedding(engine, request_logger)
        return app
    state.serving_chat = OpenAIServingChat(
        engine, request_logger, chat_template, getattr(args, "response_role", "assistant")
    )
    state.serving_completion = OpenAIServingCompletion(engine, request_logger)
    return app


async def run_server(
    args: argparse.Namespace,
    config: EngineConfig,
    chat_template: str | None = None,
    listeners: list[socket.socket] | None = None,
) -> None:
    """Start the engine, serve HTTP until SIGTERM/SIGINT, then shut the engine down.

    Args:
        args: the server flags (host, port, shutdown_timeout, ...; see build_app).
        config: the engine configuration.
        chat_template: template text replacing the tokenizer's own, if given.
        listeners: sockets bound to host:port (``cli.serve.bind_listeners``); None: uvicorn
            binds them itself.

    Raises:
        EngineDeadError: the engine failed to start.
    """
    registry = make_registry()
    engine: AsyncLLM | AsyncEmbeddingEngine
    if config.model_config.is_pooling_model:
        engine = AsyncEmbeddingEngine(config)
    else:
        engine = AsyncLLM(config, stat_loggers=make_stat_loggers(config, registry))
    shutdown: GracefulShutdown | None = None
    try:
        app = build_app(engine, args, registry, chat_template)
        timeout_s = getattr(args, "shutdown_timeout", 0)
        uv_config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            root_path=args.root_path or "",
            timeout_graceful_shutdown=timeout_s + ABORTED_RESPONSE_GRACE_S,
            timeout_keep_alive=5,
        )
        server = _Server(uv_config)
        servings = [app.state.serving_chat, app.state.serving_completion]
        shutdown = GracefulShutdown(server, engine, [s for s in servings if s], timeout_s)
        shutdown.install()
        freeze_startup_heap("API server")
        logger.info(
            "Serving %s on %s (max_model_len=%d)",
            config.model_config.served_model_name,
            _listen_url(args.host, args.port, listeners),
            engine.model_config.max_model_len,
        )
        await server.serve(sockets=listeners)
    finally:
        if shutdown is not None:
            shutdown.uninstall()
        engine.shutdown()
        logger.info("Engine shut down.")


def _listen_url(host: str, port: int, listeners: list[socket.socket] | None) -> str:
    if listeners:
        port = listeners[0].getsockname()[1]  # the chosen one, for --port 0
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# ---- shutdown ----------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn's server, leaving SIGTERM and SIGINT to GracefulShutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: uvicorn's own handlers end a drain that runs out of time by cancelling the
        # requests' tasks (truncated streams, a traceback each) and re-raise the signal once
        # done; GracefulShutdown aborts the requests in the engine instead.
        yield


class GracefulShutdown:
    """What SIGTERM and SIGINT do while the server runs.

    The first signal makes uvicorn stop accepting connections; running requests get
    ``timeout_s`` seconds to finish, then the rest are aborted, so their clients get an
    error (an error event and ``[DONE]`` in a stream, else the response) rather than wait.
    The server then returns from ``serve`` once every response has ended. A second signal
    exits the process at once.

    Args:
        server: the uvicorn server.
        engine: the engine, killed by a second signal.
        servings: the handlers whose running requests are aborted.
        timeout_s: grace period of running requests (seconds); 0 aborts them at once.
    """

    def __init__(
        self,
        server: uvicorn.Server,
        engine: AsyncLLM | AsyncEmbeddingEngine,
        servings: list[Any],
        timeout_s: float,
    ) -> None:
        self.server = server
        self.engine = engine
        self.servings = servings
        self.timeout_s = timeout_s
        self.stopping = False
        self._exit_signal: int | None = None  # a second signal came: exit, do not drain
        self._abort_task: asyncio.Task | None = None

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.on_signal, sig)

    def uninstall(self) -> None:
        """Leave the event loop: from now on (engine shutdown) a signal exits at once."""
        if self._exit_signal is not None:  # the responses ended before ABORT_FLUSH_S
            exit_now(self.engine, self._exit_signal)
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
            signal.signal(sig, lambda signum, _: exit_now(self.engine, signum))
        if self._abort_task is not None:
            self._abort_task.cancel()

    def num_running(self) -> int:
        return sum(s.num_running() for s in self.servings)

    def on_signal(self, signum: int) -> None:
        """First signal: stop accepting, abort what still runs after the grace period.
        Second: abort what runs and exit, after a moment for the aborts to reach clients."""
        if self.stopping:
            self._abort_running()
            self._exit_signal = signum
            loop = asyncio.get_running_loop()
            loop.call_later(ABORT_FLUSH_S, exit_now, self.engine, signum)
            return
        self.stopping = True
        logger.info(
            "%s: shutting down; not accepting new requests; %d running request(s) get %g s "
            "to finish (a second signal exits at once)",
            signal.Signals(signum).name,
            self.num_running(),
            self.timeout_s,
        )
        self.server.should_exit = True
        self._abort_task = asyncio.get_running_loop().create_task(self._abort_after_timeout())

    async def _abort_after_timeout(self) -> None:
        if self.timeout_s > 0:
            await asyncio.sleep(self.timeout_s)
        aborted = self._abort_running()
        if aborted:
            logger.warning(
                "Shutdown timeout (%g s) reached: aborted %d running request(s)",
                self.timeout_s,
                aborted,
            )

    def _abort_running(self) -> int:
        return sum(s.abort_running() for s in self.servings)


def exit_now(engine: AsyncLLM | AsyncEmbeddingEngine, signum: int) -> NoReturn:
    """End the process at once (a second stop signal): kill the engine process, exit with
    128 + ``signum``, without unwinding the running requests (no tracebacks)."""
    logger.warning("%s again: exiting now", signal.Signals(signum).name)
    for proc in getattr(engine, "engine_procs", []):
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    with contextlib.suppress(Exception):
        engine.shutdown()  # sockets and the IPC folder (idempotent)
    logging.shutdown()
    os._exit(128 + signum)


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

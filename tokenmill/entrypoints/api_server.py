"""The API server: one FastAPI app serving the OpenAI API, the Responses API, Anthropic's
Messages API and the live dashboard behind one API key check, and its run loop.

The HTTP server (this process) tokenizes, detokenizes and talks HTTP; the model loop runs in
the engine process (``AsyncLLM``), so neither stalls the other. Routes:

- OpenAI's (``openai/server.py``): POST /v1/chat/completions, /v1/completions,
  /v1/embeddings, /tokenize, /detokenize; GET /v1/models, /health, /metrics, /version
- POST /v1/responses, GET and DELETE /v1/responses/{id} (``openai/responses_router.py``)
- POST /v1/messages, /v1/messages/count_tokens (``anthropic/router.py``), whose errors take
  Anthropic's shape
- GET /dashboard, the live web view (``dashboard/``; ``openai/observability.py``)
- POST /sleep, /wake_up, /update_weights, GET /is_sleeping with ``--enable-sleep-mode``
  (``openai/sleep_routes.py``)
- GET /openapi.json, the document of them all (``openai/openapi.py``)

With ``--api-key`` every route but the probes and the dashboard needs the key (``auth.py``).
How the server stops (signals, the engine's death) is in ``openai/shutdown.py``.
"""

from __future__ import annotations

import argparse
import logging
import socket

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CollectorRegistry

from tokenmill import envs
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.engine.async_llm import AsyncLLM, EngineDeadError
from tokenmill.engine.embedding_engine import AsyncEmbeddingEngine
from tokenmill.entrypoints.anthropic.errors import error_response_for
from tokenmill.entrypoints.anthropic.router import add_messages_api
from tokenmill.entrypoints.auth import APIKeyMiddleware
from tokenmill.entrypoints.openai import sleep_routes
from tokenmill.entrypoints.openai.body_limit import add_body_size_limit
from tokenmill.entrypoints.openai.observability import install_observability, make_stat_loggers
from tokenmill.entrypoints.openai.openapi import install_openapi
from tokenmill.entrypoints.openai.responses_router import add_responses_api
from tokenmill.entrypoints.openai.server import add_error_handlers
from tokenmill.entrypoints.openai.server import router as openai_router
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from tokenmill.entrypoints.openai.serving_engine import RequestLogger
from tokenmill.entrypoints.openai.serving_models import ServingModels, lora_router
from tokenmill.entrypoints.openai.shutdown import (
    ABORTED_RESPONSE_GRACE_S,
    GracefulShutdown,
    Server,
    exit_on_engine_death,
)
from tokenmill.entrypoints.openai.transport import install_transport, uvicorn_tls
from tokenmill.gc_freeze import freeze_startup_heap
from tokenmill.metrics import make_registry
from tokenmill.version import __version__

# The server's log lines keep one name, which shutdown.py logs under too.
logger = logging.getLogger("tokenmill.entrypoints.openai.server")


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
            disable_log_requests, max_log_len, response_role, tool_settings,
            max_stored_responses, and the observability flags).
        registry: the Prometheus registry exposed at /metrics.
        chat_template: template text replacing the tokenizer's own, if given.
    """
    app = FastAPI(title="tokenmill", version=__version__)
    app.include_router(openai_router)
    install_openapi(app)
    add_error_handlers(app)
    api_key = getattr(args, "api_key", None)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    add_body_size_limit(app, error_response_for)  # outside the key check
    install_transport(app, args)  # --middleware, --enable-server-load-tracking, GET /load
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
    state.models = None
    install_observability(app, engine, args, registry)
    if isinstance(engine, AsyncEmbeddingEngine):
        state.serving_embedding = OpenAIServingEmbedding(engine, request_logger)
        return app
    state.serving_chat = OpenAIServingChat(
        engine,
        request_logger,
        chat_template,
        getattr(args, "response_role", "assistant"),
        getattr(args, "tool_settings", None),
    )
    state.serving_completion = OpenAIServingCompletion(engine, request_logger)
    as_ids = bool(getattr(args, "return_tokens_as_token_ids", False))
    state.serving_chat.return_tokens_as_token_ids = as_ids
    state.serving_completion.return_tokens_as_token_ids = as_ids
    state.models = state.serving_chat.models = state.serving_completion.models = (
        ServingModels(engine)
    )
    if envs.allow_runtime_lora_updating():
        app.include_router(lora_router)
    add_responses_api(app, state.serving_chat, getattr(args, "max_stored_responses", None))
    add_messages_api(app, state.serving_chat)
    app.include_router(sleep_routes.router)
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
        EngineDeadError: the engine failed to start, or died while serving (the server then
            stops, unless ``--keep-alive-on-engine-death``).
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
        if app.state.models is not None:
            try:
                await app.state.models.load_startup_adapters()
            except ValueError as e:
                raise ConfigError(str(e)) from None
        timeout_s = getattr(args, "shutdown_timeout", 0)
        tls = uvicorn_tls(args)
        uv_config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            root_path=args.root_path or "",
            timeout_graceful_shutdown=timeout_s + ABORTED_RESPONSE_GRACE_S,
            timeout_keep_alive=5,
            **tls,
        )
        server = Server(uv_config)
        servings = [app.state.serving_chat, app.state.serving_completion]
        shutdown = GracefulShutdown(server, engine, [s for s in servings if s], timeout_s)
        shutdown.install()
        keep_alive = getattr(args, "keep_alive_on_engine_death", False)
        if isinstance(engine, AsyncLLM):
            if not keep_alive:
                exit_on_engine_death(server, engine)
            engine.watch_engine_processes()  # an idle server notices a dead engine too
        freeze_startup_heap("API server")
        logger.info(
            "Serving %s on %s (max_model_len=%d)",
            config.model_config.served_model_name,
            _listen_url(args.host, args.port, listeners, bool(tls)),
            engine.model_config.max_model_len,
        )
        await server.serve(sockets=listeners)
        if isinstance(engine, AsyncLLM) and engine.errored and not shutdown.stopping:
            raise EngineDeadError(f"the engine died: {engine.dead_error}")
    finally:
        if shutdown is not None:
            shutdown.uninstall()
        engine.shutdown()
        logger.info("Engine shut down.")


def _listen_url(
    host: str, port: int, listeners: list[socket.socket] | None, tls: bool = False
) -> str:
    if listeners:
        port = listeners[0].getsockname()[1]  # the chosen one, for --port 0
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"

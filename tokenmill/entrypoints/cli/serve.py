"""``tokenmill serve [MODEL] [flags]``: the OpenAI-compatible server.

Flags follow ``vllm serve``: every engine flag (generated from EngineArgs) plus the server
flags below. vLLM flags that tokenmill does not implement yet are recognised and rejected
with one line (exit code 2), so that a copied command line never silently does something
else.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import signal
import socket
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from tokenmill import __version__, envs
from tokenmill.config import ConfigError, UnsupportedQuantizationError
from tokenmill.engine_args import EngineArgs
from tokenmill.entrypoints.openai.agent_args import AgentArgs
from tokenmill.entrypoints.openai.observability import add_observability_args
from tokenmill.entrypoints.openai.transport import add_transport_args, check_transport
from tokenmill.hf_config import ModelLoadError

logger = logging.getLogger(__name__)

T = TypeVar("T")

API_KEY_ENV = "TOKENMILL_API_KEY"

# vLLM flags with no tokenmill implementation yet.
UNIMPLEMENTED_FLAGS = (
    "--guided-decoding-backend",
    "--structured-outputs-config",
    "--kv-transfer-config",
    "--calculate-kv-scales",
    "--kv-events-config",
    # data parallelism across nodes (one node's engine cores are -dp)
    "--data-parallel-size-local",
    "--data-parallel-address",
    "--data-parallel-rpc-port",
    "--data-parallel-start-rank",
    "--data-parallel-backend",
    "--data-parallel-hybrid-lb",
    "--data-parallel-external-lb",
    # ranks across nodes without Ray (several nodes are --distributed-executor-backend ray)
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--cpu-offload-gb",
    "--swap-space",
    "--enable-ssl-refresh",
    "--rope-scaling",
    "--uds",
    "--api-server-count",
    "--headless",
    # torch.compile and CUDA-graph settings: tokenmill compiles no torch graphs, and its CUDA
    # graphs are on unless --enforce-eager
    "--compilation-config",
    "-O",
    "--cudagraph-capture-sizes",
    "--max-cudagraph-capture-size",
    "--skip-tokenizer-init",
    "--enable-prompt-embeds",
    "--logits-processors",
    "--max-num-partial-prefills",
    "--max-long-partial-prefills",
    "--otlp-traces-endpoint",
    "--enable-eplb",
    "--eplb-config",
    "--model-impl",
)

# vLLM flags about fetching a model from the Hugging Face Hub, which tokenmill never does:
# refused with the reason, so a copied command line is not half obeyed.
HUB_FLAGS = ("--revision", "--code-revision", "--tokenizer-revision", "--download-dir",
             "--hf-token")


class _Unimplemented(argparse.Action):
    """Rejects a known vLLM flag that tokenmill does not implement (one line, exit 2), or
    only the values it does not: ``accepted`` are the values that mean what tokenmill does
    anyway."""

    def __init__(
        self, option_strings: list[str], dest: str, accepted: tuple[str, ...] = (), **kwargs: Any
    ) -> None:
        super().__init__(
            option_strings, dest, nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
        self.accepted = accepted

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if self.accepted and len(values) == 1 and values[0] in self.accepted:
            return
        if option_string in HUB_FLAGS:
            parser.exit(2, f"{parser.prog}: error: {option_string}: tokenmill never downloads "
                           "models; give a local folder or .gguf file\n")
        shown = f"{option_string} {' '.join(values)}" if self.accepted else option_string
        also = f" (only {', '.join(self.accepted)})" if self.accepted else ""
        parser.exit(2, f"{parser.prog}: error: tokenmill does not implement {shown} yet{also}\n")


def _json_list(value: str) -> list[str]:
    from tokenmill.entrypoints.openai.server import parse_json_list

    return parse_json_list(value)


def port_number(value: str) -> int:
    """``--port``: a TCP port, 0-65535 (0: any free port).

    Raises:
        argparse.ArgumentTypeError: not an integer in that range.
    """
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0-65535, got {port}")
    return port


def non_negative_seconds(value: str) -> int:
    """A whole number of seconds, 0 or more (``--shutdown-timeout``).

    Raises:
        argparse.ArgumentTypeError: not a non-negative integer.
    """
    try:
        seconds = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of seconds: {value!r}") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {seconds}")
    return seconds


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's flags (``vllm serve`` names and defaults)."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="0.0.0.0", help="Address to listen on. (default: 0.0.0.0)")
    group.add_argument(
        "--port", type=port_number, default=8000, help="Port to listen on. (default: 8000)"
    )
    group.add_argument(
        "--api-key",
        default=envs.api_key(),
        help=f"Require 'Authorization: Bearer <key>' on /v1 and tokenizer routes "
        f"(default: ${API_KEY_ENV}, else none).",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="Chat template (a file or the Jinja text) replacing the model's own.",
    )
    group.add_argument(
        "--response-role",
        default="assistant",
        help="Role of generated chat messages. (default: assistant)",
    )
    group.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="Do not log a line per request at arrival and finish.",
    )
    group.add_argument(
        "--enable-log-requests",
        dest="disable_log_requests",
        action="store_false",
        help="Log a line per request at arrival and finish (the default).",
    )
    group.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="Most prompt characters / token ids printed in request logs (default: all).",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level. (default: info)",
    )
    group.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="Do not log a line per HTTP request (uvicorn's access log).",
    )
    group.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=["*"],
        help='CORS allowed origins, a JSON list. (default: ["*"])',
    )
    group.add_argument(
        "--allowed-methods",
        type=_json_list,
        default=["*"],
        help='CORS allowed methods, a JSON list. (default: ["*"])',
    )
    group.add_argument(
        "--allowed-headers",
        type=_json_list,
        default=["*"],
        help='CORS allowed headers, a JSON list. (default: ["*"])',
    )
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    group.add_argument(
        "--shutdown-timeout",
        type=non_negative_seconds,
        default=0,
        metavar="SECONDS",
        help="On SIGTERM/SIGINT, stop accepting requests and give running ones up to this "
        "many seconds to finish, then abort the rest; 0 aborts them at once. A second "
        "signal exits immediately. (default: 0)",
    )
    group.add_argument(
        "--keep-alive-on-engine-death",
        action="store_true",
        help="When the engine process dies, keep the server up answering 503 (and /health "
        "503) instead of exiting with code 1 for an orchestrator to restart it, as vLLM "
        "does with VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1.",
    )
    group.add_argument(
        "--root-path",
        default=None,
        help="URL prefix when served behind a path-based reverse proxy.",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="With logprobs, name tokens \"token_id:<id>\" instead of by their text (the "
        "default of the request field of that name).",
    )
    group.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="Accepted as vLLM's flag: usage always carries prompt_tokens_details "
        "(cached_tokens: prompt tokens served from the prefix cache).",
    )
    add_transport_args(group)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``tokenmill`` command's subparsers."""
    parser = subparsers.add_parser(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Serve a model over an OpenAI-compatible HTTP API (flags as vllm serve).",
        allow_abbrev=False,
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct).",
    )
    parser.add_argument("--model", dest="model", default=None, help="Same as MODEL.")
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="Flags read from a YAML file of flag names and values (as vllm serve --config); "
        "flags on the command line win over the file's.",
    )
    add_server_args(parser)
    add_observability_args(parser)
    AgentArgs.add_cli_args(parser)
    EngineArgs.add_cli_args(parser, positional_model=True)
    for flag in UNIMPLEMENTED_FLAGS + HUB_FLAGS:
        parser.add_argument(flag, action=_Unimplemented)
    parser.set_defaults(dispatch=run)
    return parser


# uvicorn's default backlog.
BACKLOG = 2048


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """TCP sockets bound to ``port`` on every address ``host`` resolves to, listening.

    Binding before the engine starts makes a busy port fail at once, not after the model has
    loaded; uvicorn then serves on these sockets. As asyncio's ``create_server``: sockets
    have SO_REUSEADDR (a restart need not wait out TIME_WAIT), IPv6 ones are IPv6-only, and
    an address family the machine has disabled is skipped. They listen at once: with
    SO_REUSEADDR, Linux lets a second socket bind a port that is bound but not listening, so
    two servers started together would both load their models and one would then fail to
    listen, unseen. Connections made while the model loads wait in the backlog.

    Raises:
        OSError: ``host`` does not resolve, or the port is in use or not permitted.
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    listeners: list[socket.socket] = []
    skipped: OSError | None = None
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as e:  # a family without kernel support
                skipped = e
                continue
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and listeners:  # one free port for every address
                address = (address[0], listeners[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as e:
                sock.close()
                if e.errno != errno.EADDRNOTAVAIL:  # (not: a family that is turned off)
                    raise
                skipped = e
                continue
            listeners.append(sock)
            sock.listen(BACKLOG)
    except OSError:
        for sock in listeners:
            sock.close()
        raise
    if not listeners:
        raise skipped or OSError(errno.EADDRNOTAVAIL, f"{host} has no address to listen on")
    return listeners


def _fail(message: str, code: int) -> int:
    print(f"tokenmill serve: error: {message}", file=sys.stderr)
    return code


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on uvloop's event loop, or asyncio's if uvloop is missing.

    The API server's time goes into per-chunk socket writes and callbacks: uvloop (libuv)
    does that work in C, which leaves more of the front end's one core to the streams.
    """
    try:
        import uvloop
    except ImportError:  # not on this platform (e.g. Windows): asyncio's own loop
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def configure_logging() -> None:
    """One format for tokenmill's logs: level, time, module, message."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``tokenmill serve``; returns the exit code.

    Start-up errors (invalid settings, an unreadable model, a port that cannot be bound, an
    engine that fails to start) are reported in one line with exit code 1; flag errors and
    a quantization method or layout tokenmill does not run exit with 2. The settings are
    checked, then the port bound, before the engine starts: a busy port fails in a second,
    not after the model has loaded, and a bad flag is reported as such on a busy port.
    """
    from tokenmill.engine.async_llm import EngineDeadError
    from tokenmill.tokenizer import ChatTemplateError, load_chat_template

    if args.model_tag and args.model and args.model_tag != args.model:
        return _fail(f"two models given: {args.model_tag} and --model {args.model}", 2)
    args.model = args.model_tag or args.model
    if args.max_log_len is not None and args.max_log_len < 0:
        return _fail(f"--max-log-len must be non-negative, got {args.max_log_len}", 2)
    try:
        args.tool_settings = AgentArgs.from_cli_args(args).tool_settings()
        check_transport(args)
    except ConfigError as e:
        return _fail(str(e), 2)
    chat_template = None
    if args.chat_template:
        try:
            chat_template = load_chat_template(args.chat_template)
        except ChatTemplateError as e:
            return _fail(f"--chat-template: {e}", 2)
    configure_logging()
    # NOTE: until the server installs its own handlers, SIGTERM exits through Python's normal
    # path, whose atexit hooks terminate the (daemonic) engine process instead of orphaning it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    listeners = []
    try:
        # The settings first (no weights are read), so that a bad flag is reported as such
        # even when the port is busy; then the port, before the engine starts.
        config = EngineArgs.from_cli_args(args).create_engine_config("server")
        if chat_template is not None:
            config.model_config.chat_template = chat_template
        try:
            listeners = bind_listeners(args.host, args.port)
        except OSError as e:
            return _fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}", 1)
        logger.info(
            "tokenmill %s serve: starting for %s", __version__, config.model_config.model
        )
        from tokenmill.entrypoints.api_server import run_server

        run_event_loop(run_server(args, config, chat_template, listeners))
    except UnsupportedQuantizationError as e:
        return _fail(str(e), 2)
    except (ConfigError, ModelLoadError, EngineDeadError) as e:
        return _fail(str(e), 1)
    except KeyboardInterrupt:
        return 0
    finally:
        for sock in listeners:
            sock.close()
    return 0

"""``tokenmill router --backend URL [--backend URL ...]``: route requests across replicas.

See ``tokenmill.router`` for what it does. Flag names follow vLLM production-stack's router
(``--routing-logic``, ``--session-key``) and SGLang's (``--balance-abs-threshold``,
``--balance-rel-threshold``) where they mean the same.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from tokenmill.entrypoints.cli.serve import port_number

logger = logging.getLogger("tokenmill.router")


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def _int_at_least(low: int) -> Any:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
        if number < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return number

    return parse


_positive_int = _int_at_least(1)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``router`` to the ``tokenmill`` command's subparsers."""
    parser = subparsers.add_parser(
        "router",
        help="Route OpenAI API requests across engine replicas (prefix-aware).",
        description="Route OpenAI API requests across engine replicas: prefix-aware, by "
        "session or round-robin, with health checks, unbuffered streams and /metrics.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="URL",
        help="An engine server's URL, e.g. http://10.0.0.5:8000; repeat it, or give a "
        "comma-separated list.",
    )
    parser.add_argument(
        "--resolve-backends",
        action="store_true",
        help="Each backend's host name stands for every address it resolves to, looked up "
        "again at each health check (a Kubernetes headless Service: one backend per pod).",
    )
    parser.add_argument("--host", default="0.0.0.0", help="(default: 0.0.0.0)")
    parser.add_argument("--port", type=port_number, default=8000, help="(default: 8000)")
    _add_routing_args(parser)
    parser.add_argument(
        "--health-check-interval",
        type=_positive_float,
        default=5.0,
        metavar="SECONDS",
        help="Seconds between checks of each backend's /health. (default: 5)",
    )
    parser.add_argument(
        "--health-check-timeout",
        type=_positive_float,
        default=3.0,
        metavar="SECONDS",
        help="A backend whose /health takes longer is unhealthy. (default: 3)",
    )
    parser.set_defaults(dispatch=run)
    return parser


def _add_routing_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the routing policies."""
    from tokenmill.router.policy import ROUTING_LOGICS

    parser.add_argument(
        "--routing-logic",
        choices=ROUTING_LOGICS,
        default="prefixaware",
        help="prefixaware: the replica holding the longest prefix of the prompt, balanced "
        "against load; session: by the --session-key header; roundrobin. "
        "(default: prefixaware)",
    )
    parser.add_argument(
        "--session-key",
        default="x-session-id",
        metavar="HEADER",
        help="Header naming a session (--routing-logic session). (default: x-session-id)",
    )
    parser.add_argument(
        "--balance-abs-threshold",
        type=_int_at_least(0),
        default=16,
        help="prefixaware: a replica holding the prefix is passed over when it has more than "
        "this many requests in flight above the least loaded one... (default: 16)",
    )
    parser.add_argument(
        "--balance-rel-threshold",
        type=_positive_float,
        default=1.5,
        help="...and more than this many times as many. (default: 1.5)",
    )
    parser.add_argument(
        "--prefix-block-chars",
        type=_positive_int,
        default=64,
        help="prefixaware: characters per hashed block of a completion prompt (chat "
        "messages are hashed one by one). (default: 64, about one KV block of tokens)",
    )
    parser.add_argument(
        "--prefix-max-blocks",
        type=_positive_int,
        default=1 << 18,
        help="prefixaware: most prompt segments remembered, least recently used dropped "
        "first. (default: 262144)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``tokenmill router``; returns the exit code (1, with one line, on a bad flag
    value or a port that cannot be bound)."""
    from aiohttp import web

    from tokenmill.router.backends import BackendPool
    from tokenmill.router.policy import make_policy
    from tokenmill.router.proxy import Router

    urls = [u.strip() for value in args.backend for u in value.split(",") if u.strip()]
    try:
        pool = BackendPool(
            urls, args.resolve_backends, args.health_check_interval, args.health_check_timeout
        )
        policy = make_policy(
            args.routing_logic,
            args.prefix_max_blocks,
            args.balance_abs_threshold,
            args.balance_rel_threshold,
        )
    except ValueError as e:
        print(f"tokenmill router: error: {e}", file=sys.stderr)
        return 2
    router = Router(pool, policy, args.session_key.lower(), args.prefix_block_chars)
    logger.info(
        "routing (%s) to %s on http://%s:%d",
        args.routing_logic,
        ", ".join(pool.configured),
        args.host,
        args.port,
    )
    try:
        web.run_app(
            router.build_app(),
            host=args.host,
            port=args.port,
            handler_cancellation=True,  # a client that leaves cancels its request's handler
            access_log=None,
            print=None,
        )
    except OSError as e:
        print(
            f"tokenmill router: error: cannot listen on {args.host}:{args.port}: {e}",
            file=sys.stderr,
        )
        return 1
    return 0

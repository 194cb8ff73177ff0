"""The ``tokenmill`` command: ``serve``, ``router``, ``bench``, ``version``; ``--version``;
``--config FILE.yaml`` reads a command's flags from a file (``config_file``).

Errors in the command line are reported in one line (no usage dump, no traceback) with
exit code 2, as a script calling the command can show them as they are.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from typing import NoReturn

from tokenmill.entrypoints.cli.config_file import ConfigFileError, expand_config_file
from tokenmill.version import __version__


class CLIParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``prog: error: message`` (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _run_version(_: argparse.Namespace) -> int:
    print(__version__)
    return 0


def build_parser() -> CLIParser:
    """The ``tokenmill`` parser with its subcommands."""
    parser = CLIParser(
        prog="tokenmill",
        description="tokenmill: a high-throughput LLM inference and serving engine.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=__version__)
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")

    from tokenmill.entrypoints.cli import router, serve

    serve.add_parser(subparsers)
    router.add_parser(subparsers)
    # The benchmark command lives in its own module, present in full installs only.
    if importlib.util.find_spec("tokenmill.entrypoints.cli.bench") is not None:
        bench = importlib.import_module("tokenmill.entrypoints.cli.bench")
        bench.add_parser(subparsers)
        bench_parser = subparsers.choices.get("bench")
        if bench_parser is not None and bench_parser.get_default("dispatch") is None:
            bench_parser.set_defaults(dispatch=bench.run)
    version_parser = subparsers.add_parser("version", help="Print the version.")
    version_parser.set_defaults(dispatch=_run_version)
    return parser


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> CLIParser:
    """The (sub)command parser the command line chose, e.g. ``tokenmill bench serve``'s."""
    chosen = parser
    while True:
        # NOTE: argparse lists subcommands only in these private fields.
        actions = [a for a in chosen._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, actions[0].dest, None) if actions and actions[0].dest else None
        if name is None or name not in actions[0].choices:
            return chosen  # type: ignore[return-value]
        chosen = actions[0].choices[name]


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, but an unknown argument is reported by the subcommand it was
    given to (``tokenmill serve: error: unrecognized arguments: ...``), as its other errors.
    """
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tokenmill`` command; returns the exit code."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        argv = expand_config_file(parser, argv)
    except ConfigFileError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    args = parse_args(parser, argv)
    dispatch = getattr(args, "dispatch", None)
    if dispatch is None:
        parser.print_help()
        return 2
    from tokenmill.entrypoints.cli.serve import configure_logging

    configure_logging()  # start-up facts (KV blocks, graphs, memory) go to the log
    code = dispatch(args)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())

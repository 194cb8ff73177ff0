"""``tokenmill bench throughput | latency | serve | compare``.

The first three take the flags of ``vllm bench`` (the same workload for the same flags);
``compare`` puts result files of either engine side by side. Also runnable on its own:
``python -m tokenmill.entrypoints.cli.bench serve --base-url ... --model ...``.

Errors in the benchmark's settings are reported in one line (exit code 2); failing requests
of ``serve`` are part of its result, and a run whose every request failed exits with 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

_SUBCOMMANDS = {
    "throughput": "Offline throughput of the in-process engine (as vllm bench throughput).",
    "latency": "End-to-end latency of one batch, in-process (as vllm bench latency).",
    "serve": "Load an OpenAI-compatible server and measure TTFT, TPOT, ITL, throughput "
    "(as vllm bench serve).",
    "compare": "Compare result files side by side, with ratios and an optional plot.",
}


class _OneLineErrorParser(argparse.ArgumentParser):
    """Reports command-line errors in one line (``prog: error: message``, exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _module(name: str) -> Any:
    import importlib

    return importlib.import_module(f"tokenmill.benchmarks.{name}")


def _add_subcommands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(title="benchmarks", dest="bench_command", metavar="BENCHMARK")
    for name, help_text in _SUBCOMMANDS.items():
        child = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        _module(name).add_cli_args(child)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` (and its four benchmarks) to the ``tokenmill`` command's subparsers."""
    parser = subparsers.add_parser(
        "bench",
        help="Benchmark tokenmill or any OpenAI-compatible server.",
        description="Benchmarks with the flags of vllm bench.",
        allow_abbrev=False,
    )
    _add_subcommands(parser)
    parser.set_defaults(dispatch=run)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m tokenmill.entrypoints.cli.bench``."""
    parser = _OneLineErrorParser(
        prog="tokenmill bench",
        description="Benchmarks with the flags of vllm bench.",
        allow_abbrev=False,
    )
    _add_subcommands(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark; returns the exit code.

    0: done (a serve run whose requests failed included: the failures are in its summary);
    1: the engine could not start or the model could not be read;
    2: invalid benchmark settings or a quantization tokenmill does not run; 130: interrupted.
    """
    from tokenmill.benchmarks.common import BenchmarkError
    from tokenmill.config import ConfigError, UnsupportedQuantizationError
    from tokenmill.hf_config import ModelLoadError

    command = getattr(args, "bench_command", None)
    if command is None:
        print(f"tokenmill bench: choose a benchmark: {', '.join(_SUBCOMMANDS)}", file=sys.stderr)
        return 2
    prog = f"tokenmill bench {command}"
    try:
        _module(command).main(args)
    except (BenchmarkError, UnsupportedQuantizationError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except (ConfigError, ModelLoadError, ValueError) as e:
        # ValueError: the engine refused a request of the workload (e.g. too long).
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m tokenmill.entrypoints.cli.bench``."""
    args = build_parser().parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

"""``tokenmill bench compare A.json B.json [...]``: result files side by side, with ratios.

Reads the files of ``bench serve`` (``--save-result``), ``bench throughput`` and ``bench
latency`` (``--output-json``) — tokenmill's or vLLM's, whose keys are the same — and prints
one row per metric: each file's value and, for every file after the first, its ratio to the
first, marked ``better`` or ``worse`` by the metric's direction (throughput up, latency down).
Rows that describe the workload (token totals, request counts) have no direction: a ratio
other than 1 there means the runs did not do the same work.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from typing import Any

from tokenmill.benchmarks.common import BenchmarkError, read_json
from tokenmill.benchmarks.serve_metrics import METRIC_TITLES

HIGHER, LOWER, NEUTRAL = 1, -1, 0
# Differences smaller than this are reported as "same".
_SAME_WITHIN = 0.01

# (key, row name, direction); rows missing from every file are left out.
_SUMMARY_ROWS: list[tuple[str, str, int]] = [
    ("num_prompts", "Requests", NEUTRAL),
    ("completed", "Successful requests", HIGHER),
    ("failed", "Failed requests", LOWER),
    ("total_input_tokens", "Total input tokens", NEUTRAL),
    ("total_output_tokens", "Total generated tokens", NEUTRAL),
    ("duration", "Benchmark duration (s)", LOWER),
    ("request_throughput", "Request throughput (req/s)", HIGHER),
    ("request_goodput", "Request goodput (req/s)", HIGHER),
    ("output_throughput", "Output token throughput (tok/s)", HIGHER),
    ("max_output_tokens_per_s", "Peak output token throughput (tok/s)", HIGHER),
    ("total_token_throughput", "Total token throughput (tok/s)", HIGHER),
    # bench throughput
    ("num_requests", "Requests", NEUTRAL),
    ("total_num_tokens", "Total tokens", NEUTRAL),
    ("elapsed_time", "Elapsed time (s)", LOWER),
    ("requests_per_second", "Throughput (requests/s)", HIGHER),
    ("tokens_per_second", "Throughput (total tokens/s)", HIGHER),
    ("output_tokens_per_second", "Throughput (output tokens/s)", HIGHER),
    # bench latency
    ("avg_latency", "Avg latency (s)", LOWER),
]
_PERCENTILE_KEY = re.compile(r"^p(\d+(?:\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tokenmill bench compare``."""
    parser.add_argument(
        "results", nargs="+", metavar="RESULT.json", help="Result files; ratios are to the first."
    )
    parser.add_argument(
        "--labels",
        nargs="+",
        default=None,
        help="A name per file (default: the file's label, else its name).",
    )
    parser.add_argument(
        "--plot", default=None, metavar="FILE.png", help="Also draw all runs into one figure."
    )


def _flatten(result: dict[str, Any]) -> dict[str, Any]:
    flat = dict(result)
    percentiles = result.get("percentiles")
    if isinstance(percentiles, dict):  # bench latency: {"50": seconds, ...}
        for p, value in percentiles.items():
            flat[f"percentiles.{p}"] = value
    return flat


def comparison_rows(results: Sequence[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """The rows to show for these results: (key, row name, direction), in display order."""
    flats = [_flatten(r) for r in results]

    def present(key: str) -> bool:
        return any(
            isinstance(f.get(key), (int, float)) and not isinstance(f.get(key), bool) for f in flats
        )

    rows = [row for row in _SUMMARY_ROWS if present(row[0])]
    for metric, (_, short) in METRIC_TITLES.items():
        keys = [
            (f"mean_{metric}_ms", f"Mean {short} (ms)"),
            (f"median_{metric}_ms", f"Median {short} (ms)"),
        ]
        found = {
            float(m.group(1)): key
            for f in flats
            for key in f
            if (m := _PERCENTILE_KEY.match(key)) and m.group(2) == metric
        }
        for p in sorted(found):
            name = found[p][1:].split("_", 1)[0]
            keys.append((found[p], f"P{name} {short} (ms)"))
        rows += [(key, name, LOWER) for key, name in keys if present(key)]
    latency_keys = sorted(
        {k for f in flats for k in f if k.startswith("percentiles.")},
        key=lambda k: float(k.split(".", 1)[1]),
    )
    rows += [(k, f"P{k.split('.', 1)[1]} latency (s)", LOWER) for k in latency_keys if present(k)]
    return rows


def _verdict(ratio: float, direction: int) -> str:
    if direction == NEUTRAL:
        return ""
    if abs(ratio - 1.0) < _SAME_WITHIN:
        return "same"
    return "better" if (ratio > 1.0) == (direction == HIGHER) else "worse"


def _number(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.2f}"


def format_comparison(labels: Sequence[str], results: Sequence[dict[str, Any]]) -> str:
    """The side-by-side table (plain text)."""
    flats = [_flatten(r) for r in results]
    header = ["metric", *labels] + [f"{label}/{labels[0]}" for label in labels[1:]]
    table = [header]
    for key, name, direction in comparison_rows(results):
        values = [f.get(key) for f in flats]
        row = [name, *(_number(v) for v in values)]
        base = values[0]
        for value in values[1:]:
            numeric = all(isinstance(v, (int, float)) for v in (base, value))
            if numeric and base:
                ratio = value / base
                row.append(f"{ratio:.3f}x {_verdict(ratio, direction)}".rstrip())
            else:
                row.append("-")
        table.append(row)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for n, row in enumerate(table):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _label(path: str, result: dict[str, Any]) -> str:
    label = result.get("label")
    return str(label) if label else os.path.splitext(os.path.basename(path))[0]


def main(args: argparse.Namespace) -> str:
    """Run ``tokenmill bench compare``; prints and returns the table.

    Raises:
        BenchmarkError: an unreadable file, ``--labels`` of the wrong length, files that
            share no metric (results of different benchmarks), or one file with none.
    """
    results = [read_json(path) for path in args.results]
    if args.labels is not None and len(args.labels) != len(results):
        raise BenchmarkError(f"{len(results)} result files but {len(args.labels)} --labels")
    flats = [_flatten(r) for r in results]
    shared = any(
        all(isinstance(f.get(key), (int, float)) for f in flats)
        for key, _, _ in comparison_rows(results)
    )
    if not shared:
        benchmarks = "bench serve, bench throughput or bench latency"
        raise BenchmarkError(
            f"{args.results[0]} holds no metric of {benchmarks}"
            if len(results) == 1
            else "the result files share no metric: compare results of one benchmark "
            f"({benchmarks}) with each other"
        )
    labels = (
        list(args.labels)
        if args.labels
        else [_label(path, result) for path, result in zip(args.results, results, strict=True)]
    )
    # Two runs of one backend carry the same label: keep the columns apart.
    if len(set(labels)) < len(labels):
        labels = [f"{label}#{i + 1}" for i, label in enumerate(labels)]
    table = format_comparison(labels, results)
    print(table)
    if args.plot:
        from tokenmill.benchmarks.plot import plot_results

        plot_results(list(zip(labels, results, strict=True)), args.plot)
        print(f"Plot written to {args.plot}")
    return table

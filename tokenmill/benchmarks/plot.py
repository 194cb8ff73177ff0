"""Pictures of benchmark results: latency CDFs, output tokens/s over time, throughput bars.

One figure holds one or several runs (one line or bar each), so two servers or two
configurations are compared at a glance. It reads tokenmill's result files and, as far as
they go, vLLM's (``--save-detailed`` serve files give TTFT and ITL samples; latency files
give end-to-end samples; throughput files give bars only).

Drawing uses matplotlib's Agg canvas directly (no pyplot, no GUI backend, no global state).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.benchmarks.common import BenchmarkError
from tokenmill.benchmarks.serve_metrics import (
    BUCKET_S,
    METRIC_TITLES,
    RequestRecord,
    latency_samples_ms,
    output_tokens_per_bucket,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

NamedResult = tuple[str, dict[str, Any]]

_RECORD_FIELDS = {f.name for f in dataclasses.fields(RequestRecord)}


def records_of(result: dict[str, Any]) -> list[RequestRecord]:
    """The per-request records of a tokenmill serve result (empty for other files)."""
    rows = result.get("requests")
    if not isinstance(rows, list):
        return []
    records = []
    for row in rows:
        if isinstance(row, dict) and {"index", "prompt_len", "expected_output_len"} <= row.keys():
            records.append(RequestRecord(**{k: v for k, v in row.items() if k in _RECORD_FIELDS}))
    return records


def latency_samples(result: dict[str, Any]) -> dict[str, np.ndarray]:
    """Samples in ms of ttft, tpot, itl and e2el that a result file holds (missing: empty)."""
    empty = np.zeros(0)
    records = records_of(result)
    if records:
        return latency_samples_ms(records)
    samples = {name: empty for name in METRIC_TITLES}
    ttfts, itls = result.get("ttfts"), result.get("itls")
    if isinstance(ttfts, list) and isinstance(itls, list) and len(ttfts) == len(itls):
        # vLLM's --save-detailed lists (seconds). E2E latency is taken as the last chunk's
        # arrival, TPOT from it and the output lengths.
        outs = result.get("output_lens") or [0] * len(ttfts)
        done = [(t, gaps or [], n) for t, gaps, n in zip(ttfts, itls, outs, strict=False) if t]
        samples["ttft"] = np.array([t for t, _, _ in done], dtype=np.float64) * 1e3
        samples["itl"] = np.array([x for _, g, _ in done for x in g], dtype=np.float64) * 1e3
        samples["e2el"] = np.array([t + sum(g) for t, g, _ in done], dtype=np.float64) * 1e3
        tpots = [sum(g) / (n - 1) for _, g, n in done if n and n > 1]
        samples["tpot"] = np.array(tpots, dtype=np.float64) * 1e3
    if isinstance(result.get("latencies"), list):  # bench latency: one batch per sample
        samples["e2el"] = np.array(result["latencies"], dtype=np.float64) * 1e3
    return samples


def _throughputs(result: dict[str, Any]) -> tuple[float | None, float | None]:
    """(output tokens/s, total tokens/s) of any result file, None where absent."""
    output = result.get("output_throughput", result.get("output_tokens_per_second"))
    total = result.get("total_token_throughput", result.get("tokens_per_second"))
    return output, total


def _plot_cdf(
    ax: Axes, results: Sequence[NamedResult], samples: list[dict[str, np.ndarray]], metric: str
) -> None:
    title, short = METRIC_TITLES[metric]
    drawn = False
    for i, ((label, _), per_metric) in enumerate(zip(results, samples, strict=True)):
        values = np.sort(per_metric[metric])
        if values.size:
            # start the curve at 0 so that a run with few samples still reads as a CDF
            x = np.concatenate([values[:1], values])
            y = np.arange(values.size + 1) / values.size
            ax.step(x, y, where="post", label=label, color=f"C{i}")
            drawn = True
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(f"{short} (ms)")
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)


def _plot_rate(ax: Axes, results: Sequence[NamedResult]) -> None:
    drawn = False
    for i, (label, result) in enumerate(results):
        records = records_of(result)
        duration = result.get("duration")
        if not records or not duration:
            continue
        counts = output_tokens_per_bucket(records, float(duration))
        ax.step(
            np.arange(counts.size + 1) * BUCKET_S,
            np.append(counts, counts[-1]) / BUCKET_S,
            where="post",
            label=label,
            color=f"C{i}",
        )
        drawn = True
    ax.set_title("Output tokens/s over time", fontsize=10)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    else:
        ax.text(
            0.5, 0.5, "no per-request records", ha="center", va="center", transform=ax.transAxes
        )


def _plot_bars(ax: Axes, results: Sequence[NamedResult]) -> None:
    labels = [label for label, _ in results]
    pairs = [_throughputs(result) for _, result in results]
    x = np.arange(len(results))
    width = 0.38
    for offset, (name, column) in zip(
        (-width / 2, width / 2), (("output", 0), ("total", 1)), strict=True
    ):
        heights = [p[column] or 0.0 for p in pairs]
        bars = ax.bar(x + offset, heights, width, label=f"{name} tok/s")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(x, labels, fontsize=8, rotation=15)
    ax.set_title("Token throughput", fontsize=10)
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)


def plot_results(results: Sequence[NamedResult], path: str) -> None:
    """Draw one figure of ``results`` into the PNG file ``path``.

    Panels: CDFs of TTFT, TPOT, ITL and E2E latency; output tokens per second over time
    (1-second buckets); output and total token throughput per run.

    Raises:
        BenchmarkError: nothing to draw, or the file cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not results:
        raise BenchmarkError("no result to plot")
    fig = Figure(figsize=(15, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    samples = [latency_samples(result) for _, result in results]
    for ax, metric in zip(
        (axes[0][0], axes[0][1], axes[0][2], axes[1][0]), METRIC_TITLES, strict=True
    ):
        _plot_cdf(ax, results, samples, metric)
    _plot_rate(axes[1][1], results)
    _plot_bars(axes[1][2], results)
    fig.suptitle(" vs ".join(label for label, _ in results))
    try:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        fig.savefig(path, format="png", dpi=90)
    except OSError as e:
        raise BenchmarkError(f"cannot write the plot {path}: {e}") from e

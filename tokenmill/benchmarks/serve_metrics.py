"""Serving metrics from per-request records: TTFT, TPOT, ITL, E2E latency, throughput, goodput.

Definitions (those of ``vllm bench serve``, so that numbers from both tools compare):

- TTFT: time from sending a request to receiving its first chunk of a generated choice.
- TPOT: per request, ``(e2e latency - TTFT) / (output tokens - 1)``: the mean time per
  output token after the first; requests with one output token have none.
- ITL: the gaps between consecutive streamed chunks of a choice, over all requests (a chunk
  counts whether or not it carries text: a token whose text the detokenizer holds back is
  still a token arrival).
- E2E latency (``e2el``): time from sending a request to the end of its response.
- Goodput: completed requests per second that met every ``--goodput`` target (ms).

Times in records are seconds; metrics are reported in milliseconds (``*_ms`` keys).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenmill.benchmarks.common import BenchmarkError, percentile_name

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
# Width of the time buckets behind the peak token rate and the tokens/s plot.
BUCKET_S = 1.0


@dataclass
class RequestRecord:
    """What the client saw of one request.

    Attributes:
        index: position in the workload.
        prompt_len: prompt tokens by the benchmark's tokenizer.
        expected_output_len: ``max_tokens`` sent.
        success: the response finished without error.
        error: why it failed (one line), else None.
        start_s: send time, seconds after the benchmark started.
        ttft_s: time to the first chunk of a choice (s).
        latency_s: time to the end of the response or to the failure (s).
        itl_s: gaps between chunks of a choice (s), one fewer than the chunks.
        prompt_tokens: prompt tokens (the server's usage when reported).
        output_tokens: generated tokens (the server's usage when reported, else counted
            with the tokenizer from the text).
        usage_reported: the counts come from the server.
        generated_text: the streamed text.
    """

    index: int
    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str | None = None
    start_s: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    usage_reported: bool = False
    generated_text: str = ""

    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (s), or None with < 2 tokens."""
        if not self.success or not self.output_tokens or self.output_tokens < 2:
            return None
        assert self.latency_s is not None and self.ttft_s is not None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds).

    Raises:
        BenchmarkError: an item is not ``NAME:MS`` with NAME in ttft, tpot, e2el and MS >= 0.
    """
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise BenchmarkError(
                f"--goodput {item!r}: expected NAME:MILLISECONDS with NAME one of "
                f"{', '.join(GOODPUT_METRICS)} (e.g. ttft:500 tpot:50)"
            )
        try:
            slos[name] = float(value)
        except ValueError:
            raise BenchmarkError(f"--goodput {item!r}: {value!r} is not a number") from None
        if slos[name] < 0:
            raise BenchmarkError(f"--goodput {item!r}: the target must be non-negative")
    return slos


def parse_metric_names(text: str) -> list[str]:
    """``"ttft,tpot,itl"`` -> its list; raises BenchmarkError on an unknown name."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        raise BenchmarkError(f"--percentile-metrics {text!r}: choose from {', '.join(METRICS)}")
    return names


def latency_samples_ms(records: Sequence[RequestRecord]) -> dict[str, np.ndarray]:
    """Per-metric samples in ms over the successful requests (float64 arrays)."""
    done = [r for r in records if r.success]
    tpots = [t for t in (r.tpot_s() for r in done) if t is not None]
    return {
        "ttft": np.array([r.ttft_s for r in done], dtype=np.float64) * 1000.0,
        "tpot": np.array(tpots, dtype=np.float64) * 1000.0,
        "itl": np.array([x for r in done for x in r.itl_s], dtype=np.float64) * 1000.0,
        "e2el": np.array([r.latency_s for r in done], dtype=np.float64) * 1000.0,
    }


def token_events(record: RequestRecord) -> tuple[np.ndarray, float]:
    """Arrival times (s after the benchmark start) of a request's text chunks, and the
    tokens each stands for (``output_tokens / chunks``; servers may pack several tokens
    into one chunk)."""
    if not record.success or record.ttft_s is None:
        return np.zeros(0), 0.0
    gaps = np.concatenate([[record.start_s + record.ttft_s], np.asarray(record.itl_s)])
    times = np.cumsum(gaps)
    weight = (record.output_tokens or 0) / len(times)
    return times, weight


def output_tokens_per_bucket(
    records: Sequence[RequestRecord], duration_s: float, bucket_s: float = BUCKET_S
) -> np.ndarray:
    """Output tokens received in each ``bucket_s`` interval of the run (float64 array)."""
    num_buckets = max(1, int(np.ceil(duration_s / bucket_s)))
    counts = np.zeros(num_buckets, dtype=np.float64)
    for record in records:
        times, weight = token_events(record)
        if times.size:
            idx = np.minimum((times / bucket_s).astype(np.int64), num_buckets - 1)
            np.add.at(counts, idx, weight)
    return counts


def max_concurrent_requests(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at one time (sweep over send and end times)."""
    events = []
    for r in records:
        if r.latency_s is not None:
            events.append((r.start_s, 1))
            events.append((r.start_s + r.latency_s, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def _meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    values_ms = {
        "ttft": (record.ttft_s or 0.0) * 1000.0,
        "tpot": (record.tpot_s() or 0.0) * 1000.0,
        "e2el": (record.latency_s or 0.0) * 1000.0,
    }
    return all(values_ms[name] <= target for name, target in slos.items())


def compute_summary(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float],
    goodput_slos: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Aggregate metrics of a run, under the key names of ``vllm bench serve``.

    Args:
        records: every request of the run (failed ones included).
        duration_s: wall time of the run (s).
        percentiles: e.g. ``[90, 99]``; each gives ``p90_<metric>_ms`` keys for every metric.
        goodput_slos: targets in ms by metric name; adds ``request_goodput``.

    Returns:
        ``duration``, ``completed``, ``failed``, ``total_input_tokens``,
        ``total_output_tokens``, ``request_throughput``, ``request_goodput``,
        ``output_throughput``, ``total_token_throughput``, ``max_output_tokens_per_s``,
        ``max_concurrent_requests``, and ``mean_/median_/std_/p<P>_<metric>_ms`` for ttft,
        tpot, itl, e2el (None where there are no samples), plus ``error_counts``
        (message -> requests).
    """
    done = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens or 0 for r in done)
    total_out = sum(r.output_tokens or 0 for r in done)
    duration_s = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "request_goodput": None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": float(
            output_tokens_per_bucket(records, duration_s).max() / BUCKET_S
        ),
        "max_concurrent_requests": max_concurrent_requests(records),
    }
    if goodput_slos:
        good = sum(_meets_slos(r, goodput_slos) for r in done)
        summary["request_goodput"] = good / duration_s
    for name, values in latency_samples_ms(records).items():
        has = values.size > 0
        summary[f"mean_{name}_ms"] = float(values.mean()) if has else None
        summary[f"median_{name}_ms"] = float(np.median(values)) if has else None
        summary[f"std_{name}_ms"] = float(values.std()) if has else None
        for p in percentiles:
            key = f"p{percentile_name(p)}_{name}_ms"
            summary[key] = float(np.percentile(values, p)) if has else None
    summary["error_counts"] = dict(Counter(r.error for r in records if not r.success))
    return summary


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {'n/a' if value is None else value:<10}"


def format_summary(
    summary: dict[str, Any],
    metrics: Sequence[str],
    percentiles: Sequence[float],
    max_concurrency: int | None = None,
    request_rate: float = float("inf"),
    max_errors: int = 5,
) -> str:
    """The result block of ``vllm bench serve`` (same row names), then the errors."""
    lines = [
        "{:=^50}".format(" Serving Benchmark Result "),
        _row("Successful requests:", summary["completed"]),
        _row("Failed requests:", summary["failed"]),
    ]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_row("Request rate configured (RPS):", float(request_rate)))
    lines += [
        _row("Benchmark duration (s):", summary["duration"]),
        _row("Total input tokens:", summary["total_input_tokens"]),
        _row("Total generated tokens:", summary["total_output_tokens"]),
        _row("Request throughput (req/s):", summary["request_throughput"]),
    ]
    if summary.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", summary["request_goodput"]))
    lines += [
        _row("Output token throughput (tok/s):", summary["output_throughput"]),
        _row("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"]),
        _row("Peak concurrent requests:", summary["max_concurrent_requests"]),
        _row("Total token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    for name in metrics:
        title, short = METRIC_TITLES[name]
        lines.append(f"{title:-^50}")
        lines.append(_row(f"Mean {short} (ms):", summary[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {short} (ms):", summary[f"median_{name}_ms"]))
        for p in percentiles:
            p_name = percentile_name(p)
            lines.append(_row(f"P{p_name} {short} (ms):", summary[f"p{p_name}_{name}_ms"]))
    lines.append("=" * 50)
    errors = summary.get("error_counts") or {}
    if errors:
        lines.append(f"Errors ({summary['failed']} failed requests):")
        ranked = sorted(errors.items(), key=lambda kv: -kv[1])
        for message, count in ranked[:max_errors]:
            lines.append(f"  {count} x {message}")
        if len(ranked) > max_errors:
            lines.append(f"  ... and {len(ranked) - max_errors} other errors (see the result file)")
    return "\n".join(lines)

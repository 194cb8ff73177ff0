"""The dashboard's memory of recent engine statistics: fixed-width time buckets.

A stat logger of ``AsyncLLM`` (``record`` after every engine step, ``log`` every few
seconds), like the Prometheus one: it runs on the server's event loop, as do the routes that
read it, so it needs no lock. Memory is bounded: ``history_s / interval_s`` buckets, each
keeping at most ``MAX_SAMPLES`` latency samples.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.engine_io import SchedulerStats
from tokenmill.engine.request_stats import IterationStats

# Latency samples kept per bucket (a percentile of more adds little to a chart).
MAX_SAMPLES = 2048
# The "current" throughput figures average the buckets of the last this many seconds.
RATE_WINDOW_S = 10.0


@dataclass
class Bucket:
    """What the engine did during one interval (``start`` .. ``start + interval_s``)."""

    start: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    ttft: list[float] = field(default_factory=list)  # seconds, requests' first tokens
    tpot: list[float] = field(default_factory=list)  # seconds, finished requests' mean TPOT
    # the scheduler's state at the bucket's last step
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values`` by linear interpolation (numpy's
    default method), or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class DashboardStatLogger:
    """Engine statistics of the last ``history_s`` seconds, in ``interval_s`` buckets.

    Args:
        interval_s: width of one bucket (one chart point), seconds.
        history_s: how far back the charts reach, seconds.
        clock: ``time.time``-like clock (tests pass their own).
    """

    def __init__(
        self, interval_s: float = 2.0, history_s: float = 600.0, clock: Any = time.time
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.buckets: deque[Bucket] = deque(maxlen=max(2, int(history_s / interval_s)))
        self.total_requests = 0
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        self._state = SchedulerStats()

    def _bucket(self) -> Bucket:
        """The bucket of now, opening it (and the empty ones since the last) if needed."""
        now = self.clock()
        start = now - now % self.interval_s
        last = self.buckets[-1] if self.buckets else None
        if last is not None and abs(last.start - start) < 1e-6:
            return last
        maxlen = self.buckets.maxlen or 2
        next_start = start if last is None else last.start + self.interval_s
        # after a long idle spell, only the buckets still within the history
        next_start = max(next_start, start - (maxlen - 1) * self.interval_s)
        while next_start < start - 1e-6:
            self.buckets.append(self._carry(next_start))
            next_start += self.interval_s
        bucket = self._carry(start)
        self.buckets.append(bucket)
        return bucket

    def _carry(self, start: float) -> Bucket:
        """An empty bucket holding the scheduler's last known state."""
        s = self._state
        return Bucket(
            start,
            running=s.num_running_reqs,
            waiting=s.num_waiting_reqs,
            kv_cache_usage=s.kv_cache_usage,
        )

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        """Add one engine step's statistics to the current bucket."""
        bucket = self._bucket()
        if scheduler_stats is not None:
            self._state = scheduler_stats
            bucket.running = scheduler_stats.num_running_reqs
            bucket.waiting = scheduler_stats.num_waiting_reqs
            bucket.kv_cache_usage = scheduler_stats.kv_cache_usage
            bucket.preemptions += scheduler_stats.num_preemptions
            bucket.prefix_queries += scheduler_stats.prefix_cache_queries
            bucket.prefix_hits += scheduler_stats.prefix_cache_hits
        if iteration_stats is None:
            return
        bucket.prompt_tokens += iteration_stats.num_prompt_tokens
        bucket.generation_tokens += iteration_stats.num_generation_tokens
        self.total_prompt_tokens += iteration_stats.num_prompt_tokens
        self.total_generation_tokens += iteration_stats.num_generation_tokens
        _extend(bucket.ttft, iteration_stats.time_to_first_tokens)
        for finished in iteration_stats.finished_requests:
            bucket.finished += 1
            self.total_requests += 1
            if finished.mean_time_per_output_token is not None:
                _extend(bucket.tpot, [finished.mean_time_per_output_token])

    def log(self) -> None:
        """Open the current bucket, so an idle engine still draws points."""
        self._bucket()

    def snapshot(self) -> dict[str, Any]:
        """The JSON the page polls: one point per bucket (rates in tokens/s, latencies in
        ms) and the current figures (rates over the last ``RATE_WINDOW_S`` seconds)."""
        self._bucket()
        points = [self._point(b) for b in self.buckets]
        now = self.clock()
        recent = [b for b in self.buckets if b.start + self.interval_s > now - RATE_WINDOW_S]
        span = max(now - recent[0].start, self.interval_s) if recent else RATE_WINDOW_S
        recent_ttft = [x for b in recent for x in b.ttft]
        recent_tpot = [x for b in recent for x in b.tpot]
        queries = sum(b.prefix_queries for b in self.buckets)
        hits = sum(b.prefix_hits for b in self.buckets)
        state = self._state
        current = {
            "running": state.num_running_reqs,
            "waiting": state.num_waiting_reqs,
            "kv_cache_usage": state.kv_cache_usage,
            "prompt_tokens_per_s": sum(b.prompt_tokens for b in recent) / span,
            "generation_tokens_per_s": sum(b.generation_tokens for b in recent) / span,
            "ttft_p50_ms": _ms(percentile(recent_ttft, 50)),
            "tpot_p50_ms": _ms(percentile(recent_tpot, 50)),
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "requests_total": self.total_requests,
            "prompt_tokens_total": self.total_prompt_tokens,
            "generation_tokens_total": self.total_generation_tokens,
        }
        return {"time": now, "interval_s": self.interval_s, "current": current, "points": points}

    def _point(self, b: Bucket) -> dict[str, Any]:
        return {
            "t": b.start,
            "prompt_tokens_per_s": b.prompt_tokens / self.interval_s,
            "generation_tokens_per_s": b.generation_tokens / self.interval_s,
            "running": b.running,
            "waiting": b.waiting,
            "kv_cache_usage": b.kv_cache_usage,
            "finished": b.finished,
            "preemptions": b.preemptions,
            "ttft_p50_ms": _ms(percentile(b.ttft, 50)),
            "ttft_p90_ms": _ms(percentile(b.ttft, 90)),
            "tpot_p50_ms": _ms(percentile(b.tpot, 50)),
            "tpot_p90_ms": _ms(percentile(b.tpot, 90)),
        }


def _extend(samples: list[float], values: list[float]) -> None:
    room = MAX_SAMPLES - len(samples)
    if room > 0:
        samples.extend(values[:room])


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0

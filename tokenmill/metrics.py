"""Engine metrics: Prometheus collectors and a periodic log line.

Both are *stat loggers* of ``AsyncLLM``: ``record(scheduler_stats, iteration_stats)`` is called
after every engine step, ``log()`` every few seconds. Metric names carry the ``tokenmill:``
prefix and a ``model_name`` label, mirroring vLLM's ``vllm:`` metrics so dashboards carry over:

- ``tokenmill:num_requests_running`` (gauge): requests in the running batch
- ``tokenmill:num_requests_waiting`` (gauge): requests queued for admission
- ``tokenmill:kv_cache_usage_perc`` (gauge): fraction of KV blocks in use (0-1)
- ``tokenmill:prefix_cache_queries_total`` (counter): prompt tokens looked up in the prefix cache
- ``tokenmill:prefix_cache_hits_total`` (counter): of those, tokens found in the cache
- ``tokenmill:num_preemptions_total`` (counter): requests preempted (recomputed later)
- ``tokenmill:prompt_tokens_total`` / ``generation_tokens_total`` (counters): tokens processed
- ``tokenmill:request_success_total`` (counter): finished requests, by ``finished_reason``
- ``tokenmill:time_to_first_token_seconds`` (histogram): arrival -> first token (TTFT)
- ``tokenmill:inter_token_latency_seconds`` (histogram): between two tokens of a request (ITL)
- ``tokenmill:e2e_request_latency_seconds`` (histogram): arrival -> finish
- ``tokenmill:request_queue_time_seconds`` (histogram): arrival -> first scheduled
"""

from __future__ import annotations

import logging
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from tokenmill.core.engine_io import SchedulerStats
from tokenmill.engine.output_processor import IterationStats

logger = logging.getLogger("tokenmill.metrics")

PREFIX = "tokenmill:"

# Bucket bounds in seconds, from sub-millisecond GPU decode steps to minutes-long requests.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class PrometheusStatLogger:
    """Feeds the engine's per-step stats into Prometheus collectors.

    Args:
        model_name: the served model name (the ``model_name`` label).
        registry: where the collectors are registered (one registry per server, so that
            several engines in one process do not collide).
    """

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self.registry = registry
        labels = {"model_name": model_name}
        names = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, names, registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, names, registry=registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=registry).labels(
                **labels
            )

        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)."
        )
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (to be recomputed).")
        self.constraint_failures = counter(
            "structured_output_failures",
            "Requests ended for their structured-output constraint: it failed to compile, or "
            "a token mask took too long.",
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            [*names, "finished_reason"],
            registry=registry,
        )
        self._model_name = model_name
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name=model_name, finished_reason=reason)
        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token (seconds).", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between two tokens of a request (seconds).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to finish (seconds).", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Arrival to first scheduled (seconds).",
            REQUEST_LATENCY_BUCKETS,
        )

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        """Update the collectors with one engine step's stats."""
        if scheduler_stats is not None:
            self.num_running.set(scheduler_stats.num_running_reqs)
            self.num_waiting.set(scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            self.prefix_queries.inc(scheduler_stats.prefix_cache_queries)
            self.prefix_hits.inc(scheduler_stats.prefix_cache_hits)
            self.preemptions.inc(scheduler_stats.num_preemptions)
            self.constraint_failures.inc(scheduler_stats.num_constraint_failures)
        if iteration_stats is None:
            return
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.itl.observe(itl)
        for finished in iteration_stats.finished_requests:
            self._success.labels(
                model_name=self._model_name, finished_reason=finished.finish_reason
            ).inc()
            self.e2e.observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self.queue_time.observe(finished.queue_time)

    def log(self) -> None:
        """Nothing to do: Prometheus pulls the values."""


class LoggingStatLogger:
    """Logs the engine's load every few seconds, as vLLM does.

    One line per ``log()`` call: prompt and generation throughput over the interval
    (tokens/s), running and waiting requests, KV-cache usage and the prefix-cache hit rate
    (of prompt tokens looked up since start-up). Nothing is logged while the engine stays idle.
    """

    def __init__(self) -> None:
        self._last_time = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._scheduler_stats = SchedulerStats()
        self._logged_idle = False

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        if scheduler_stats is not None:
            self._scheduler_stats = scheduler_stats
            self._prefix_queries += scheduler_stats.prefix_cache_queries
            self._prefix_hits += scheduler_stats.prefix_cache_hits
        if iteration_stats is not None:
            self._prompt_tokens += iteration_stats.num_prompt_tokens
            self._generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-6)
        stats = self._scheduler_stats
        idle = (
            self._prompt_tokens == 0
            and self._generation_tokens == 0
            and stats.num_running_reqs == 0
            and stats.num_waiting_reqs == 0
        )
        if not (idle and self._logged_idle):
            hit_rate = self._prefix_hits / self._prefix_queries if self._prefix_queries else 0.0
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                self._prompt_tokens / elapsed,
                self._generation_tokens / elapsed,
                stats.num_running_reqs,
                stats.num_waiting_reqs,
                stats.kv_cache_usage * 100.0,
                hit_rate * 100.0,
            )
        self._logged_idle = idle
        self._last_time = now
        self._prompt_tokens = 0
        self._generation_tokens = 0


def make_registry() -> CollectorRegistry:
    """A registry with the process and Python collectors that the default one has.

    Also turns off prometheus_client's ``*_created`` series (a process-wide switch).
    """
    from prometheus_client import (
        GC_COLLECTOR,
        PLATFORM_COLLECTOR,
        PROCESS_COLLECTOR,
        disable_created_metrics,
    )

    # NOTE: the ``*_created`` timestamp series double the output and no dashboard reads them.
    disable_created_metrics()
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        try:
            registry.register(collector)
        except ValueError:  # already registered with this registry
            pass
    return registry

"""Engine metrics: Prometheus collectors and a periodic log line.

Both are *stat loggers* of ``AsyncLLM``: ``record(scheduler_stats, iteration_stats)`` is called
after every engine step, ``log()`` every few seconds. Metric names carry the ``tokenmill:``
prefix and a ``model_name`` label, mirroring vLLM's ``vllm:`` metrics so dashboards carry over:

- ``tokenmill:num_requests_running`` (gauge): requests in the running batch
- ``tokenmill:num_requests_waiting`` (gauge): requests queued for admission
- ``tokenmill:kv_cache_usage_perc`` (gauge): fraction of KV blocks in use (0-1)
- ``tokenmill:prefix_cache_queries_total`` (counter): prompt tokens looked up in the prefix cache
- ``tokenmill:prefix_cache_hits_total`` (counter): of those, tokens found in the cache
- ``tokenmill:mm_cache_queries_total`` (counter): images looked up in the encoder cache
- ``tokenmill:mm_cache_hits_total`` (counter): of those, found (not encoded again)
- ``tokenmill:num_preemptions_total`` (counter): requests preempted (recomputed later)
- ``tokenmill:prompt_tokens_total`` / ``generation_tokens_total`` (counters): tokens processed
- ``tokenmill:request_success_total`` (counter): finished requests, by ``finished_reason``
- ``tokenmill:time_to_first_token_seconds`` (histogram): arrival -> first token (TTFT)
- ``tokenmill:inter_token_latency_seconds`` (histogram): between two tokens of a request (ITL)
- ``tokenmill:e2e_request_latency_seconds`` (histogram): arrival -> finish
- ``tokenmill:request_queue_time_seconds`` (histogram): arrival -> first scheduled
- ``tokenmill:request_prefill_time_seconds`` / ``request_decode_time_seconds`` /
  ``request_inference_time_seconds`` (histograms): first scheduled -> first token, first
  token -> finish, first scheduled -> finish
- ``tokenmill:request_time_per_output_token_seconds`` (histogram): a request's mean TPOT
- ``tokenmill:request_prompt_tokens`` / ``request_generation_tokens`` (histograms): tokens of
  each finished request
- ``tokenmill:iteration_tokens_total`` (histogram): tokens of an engine step that produced
  output: its generated tokens plus the prompts of the requests whose first token it was
- ``tokenmill:request_params_n`` / ``request_params_max_tokens`` (histograms): the requests'
  ``n`` and ``max_tokens``
- ``tokenmill:cache_config_info`` (gauge, always 1): the KV cache's configuration as labels
- ``tokenmill:kv_offload_hit_tokens_total`` (counter, ``tier`` host|disk): prompt tokens
  loaded back from an offload tier instead of being computed (``--kv-offloading-size``)
- ``tokenmill:kv_offload_bytes_total`` (counter, ``tier``, ``direction`` store|load): KV bytes
  moved into and out of each tier
- ``tokenmill:kv_offload_seconds_total`` (counter, ``tier``): time spent moving them
- with speculative decoding, ``tokenmill:spec_decode_num_drafts_total``,
  ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
  ``..._num_accepted_tokens_per_pos_total{position}`` (``tokenmill.spec_decode.metrics``)
- ``tokenmill:lora_requests_info`` (gauge, with ``--enable-lora``): the time of the last
  update, labelled ``max_lora`` and the adapters of the running and the waiting requests
  (``running_lora_adapters``, ``waiting_lora_adapters``: comma-separated names), as vLLM's

``--metrics-compat vllm`` exports each of these under vLLM's ``vllm:`` name as well
(``VllmNamesCollector``), so dashboards, alerts and autoscalers written for vLLM read them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from tokenmill.config import CacheConfig, SpeculativeConfig
from tokenmill.core.engine_io import SchedulerStats
from tokenmill.engine.request_stats import FinishedRequestStats, IterationStats
from tokenmill.spec_decode.metrics import SpecDecodingLogging, SpecDecodingProm

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


def _one_two_five(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


# Token counts of one request, up to a million-token context.
REQUEST_TOKENS_BUCKETS = _one_two_five(1_000_000)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


class PrometheusStatLogger:
    """Feeds the engine's per-step stats into Prometheus collectors.

    The collectors live in their own registry (``engine_registry``), itself registered in
    ``registry``, so that ``VllmNamesCollector`` can read them without reading itself.

    Args:
        model_name: the served model name (the ``model_name`` label).
        registry: where the collectors are exposed (one registry per server, so that
            several engines in one process do not collide).
        cache_config: the engine's KV cache configuration, read at each scrape for
            ``cache_config_info`` (its block count is known once the engine has started).
        speculative_config: with speculative decoding, its counters are exported too.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry,
        cache_config: CacheConfig | None = None,
        speculative_config: SpeculativeConfig | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.registry = registry
        self.engine_registry = engine_registry = CollectorRegistry()
        registry.register(engine_registry)
        labels = {"model_name": model_name}
        names = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, names, registry=engine_registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, names, registry=engine_registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                PREFIX + name, doc, names, buckets=buckets, registry=engine_registry
            ).labels(**labels)

        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)."
        )
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.mm_queries = counter("mm_cache_queries", "Images looked up in the encoder cache.")
        self.mm_hits = counter("mm_cache_hits", "Images found in the encoder cache.")
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
            registry=engine_registry,
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
        self._init_request_histograms(histogram)
        self._init_offload_counters(engine_registry, names, model_name)
        if cache_config is not None:
            engine_registry.register(CacheConfigInfo(cache_config))
        self.spec_decoding = None
        if speculative_config is not None:
            self.spec_decoding = SpecDecodingProm(
                speculative_config.num_speculative_tokens, PREFIX, labels, engine_registry
            )
        self.lora_info = LoRARequestsInfo(max_loras) if max_loras else None
        if self.lora_info is not None:
            engine_registry.register(self.lora_info)

    def _init_offload_counters(
        self, engine_registry: CollectorRegistry, names: list[str], model_name: str
    ) -> None:
        """The KV offload tiers' counters, by tier (and direction)."""
        tier = [*names, "tier"]
        self._offload_hits = Counter(
            PREFIX + "kv_offload_hit_tokens",
            "Prompt tokens loaded back from a KV offload tier instead of being computed.",
            tier,
            registry=engine_registry,
        )
        self._offload_bytes = Counter(
            PREFIX + "kv_offload_bytes",
            "KV bytes moved into (store) and out of (load) a KV offload tier.",
            [*tier, "direction"],
            registry=engine_registry,
        )
        self._offload_seconds = Counter(
            PREFIX + "kv_offload_seconds",
            "Seconds spent moving KV blocks into and out of a KV offload tier.",
            tier,
            registry=engine_registry,
        )
        self._offload_metrics: dict[str, Counter] = {}
        for t in ("host", "disk"):
            labels = {"model_name": model_name, "tier": t}
            self._offload_metrics[f"{t}_hit_tokens"] = self._offload_hits.labels(**labels)
            self._offload_metrics[f"{t}_seconds"] = self._offload_seconds.labels(**labels)
            for direction in ("store", "load"):
                self._offload_metrics[f"{t}_{direction}_bytes"] = self._offload_bytes.labels(
                    **labels, direction=direction
                )

    def _init_request_histograms(self, histogram: Callable[..., Histogram]) -> None:
        """The per-request and per-step histograms vLLM exports beside the latencies."""
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "First scheduled to first token (seconds).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "First token to finish (seconds).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "First scheduled to finish (seconds).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Mean time between a request's output tokens (seconds).",
            ITL_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens",
            "Prompt tokens of each finished request.",
            REQUEST_TOKENS_BUCKETS,
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Tokens generated by each finished request.",
            REQUEST_TOKENS_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Prompt and generated tokens of an engine step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.params_n = histogram(
            "request_params_n", "The n parameter of each finished request.", PARAMS_N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "request_params_max_tokens",
            "The max_tokens parameter of each finished request.",
            REQUEST_TOKENS_BUCKETS,
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
            self.mm_queries.inc(scheduler_stats.mm_cache_queries)
            self.mm_hits.inc(scheduler_stats.mm_cache_hits)
            self.preemptions.inc(scheduler_stats.num_preemptions)
            self.constraint_failures.inc(scheduler_stats.num_constraint_failures)
            for key, value in scheduler_stats.kv_offload_stats.items():
                if value and key in self._offload_metrics:
                    self._offload_metrics[key].inc(value)
            spec = scheduler_stats.spec_decoding_stats
            if spec is not None and self.spec_decoding is not None:
                self.spec_decoding.observe(spec)
            if self.lora_info is not None:
                self.lora_info.update(scheduler_stats)
        if iteration_stats is None:
            return
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        step_tokens = iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
        if step_tokens:
            self.iteration_tokens.observe(step_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.itl.observe(itl)
        for finished in iteration_stats.finished_requests:
            self._record_finished(finished)

    def _record_finished(self, finished: FinishedRequestStats) -> None:
        self._success.labels(
            model_name=self._model_name, finished_reason=finished.finish_reason
        ).inc()
        self.e2e.observe(finished.e2e_latency)
        self.request_prompt_tokens.observe(finished.num_prompt_tokens)
        self.request_generation_tokens.observe(finished.num_generation_tokens)
        optional = (
            (self.queue_time, finished.queue_time),
            (self.prefill_time, finished.prefill_time),
            (self.decode_time, finished.decode_time),
            (self.inference_time, finished.inference_time),
            (self.tpot, finished.mean_time_per_output_token),
            (self.params_max_tokens, finished.max_tokens),
            (self.params_n, finished.params_n),
        )
        for histogram, value in optional:
            if value is not None:
                histogram.observe(value)

    def log(self) -> None:
        """Nothing to do: Prometheus pulls the values."""


class CacheConfigInfo:
    """``tokenmill:cache_config_info``: 1, with the KV cache's configuration as labels (as
    vLLM's ``cache_config_info``), read at each scrape so the block count is the sized one."""

    def __init__(self, cache_config: CacheConfig) -> None:
        self.cache_config = cache_config

    def collect(self) -> Iterator[Metric]:
        cc = self.cache_config
        labels = {
            "block_size": str(cc.block_size),
            "cache_dtype": cc.cache_dtype,
            "enable_prefix_caching": str(cc.enable_prefix_caching),
            "gpu_memory_utilization": str(cc.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(cc.kv_cache_memory or ""),
            "num_gpu_blocks": str(cc.num_blocks or 0),
        }
        family = GaugeMetricFamily(
            PREFIX + "cache_config_info", "The KV cache's configuration.", labels=list(labels)
        )
        family.add_metric(list(labels.values()), 1.0)
        yield family


class LoRARequestsInfo:
    """``tokenmill:lora_requests_info`` (vLLM's ``lora_requests_info``): the time of the last
    update (seconds since the epoch), labelled with ``max_lora`` and the comma-separated names
    of the adapters the running and the waiting requests use."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.running = self.waiting = ""
        self.updated = time.time()

    def update(self, stats: SchedulerStats) -> None:
        self.running = ",".join(sorted(stats.running_lora_adapters))
        self.waiting = ",".join(sorted(stats.waiting_lora_adapters))
        self.updated = time.time()

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            PREFIX + "lora_requests_info",
            "Running and waiting LoRA adapters (value: the time of the last update).",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        family.add_metric([str(self.max_loras), self.waiting, self.running], self.updated)
        yield family


VLLM_PREFIX = "vllm:"
# tokenmill metrics that vLLM does not have: not exported under a vllm: name.
TOKENMILL_ONLY = frozenset(
    {
        "structured_output_failures",
        "kv_offload_hit_tokens",
        "kv_offload_bytes",
        "kv_offload_seconds",
    }
)


class VllmNamesCollector:
    """The engine's metrics once more under vLLM's names (``vllm:`` for ``tokenmill:``),
    for ``--metrics-compat vllm``: tokenmill names its metrics, labels and buckets as vLLM
    does, so only the prefix changes.

    Args:
        source: the registry holding the ``tokenmill:`` collectors
            (``PrometheusStatLogger.engine_registry``), not the one this is registered in.
    """

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if not family.name.startswith(PREFIX) or family.name[len(PREFIX) :] in TOKENMILL_ONLY:
                continue
            alias = Metric(
                VLLM_PREFIX + family.name[len(PREFIX) :],
                family.documentation,
                family.type,
                family.unit,
            )
            for sample in family.samples:
                alias.add_sample(
                    VLLM_PREFIX + sample.name[len(PREFIX) :],
                    sample.labels,
                    sample.value,
                    sample.timestamp,
                    sample.exemplar,
                )
            yield alias


class LoggingStatLogger:
    """Logs the engine's load every few seconds, as vLLM does.

    One line per ``log()`` call: prompt and generation throughput over the interval
    (tokens/s), running and waiting requests, KV-cache usage and the prefix-cache hit rate
    (of prompt tokens looked up since start-up). Nothing is logged while the engine stays idle.
    With speculative decoding, a second line gives the interval's acceptance
    (``SpecDecodingLogging``).
    """

    def __init__(self) -> None:
        self._last_time = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._scheduler_stats = SchedulerStats()
        self._logged_idle = False
        self._spec_decoding = SpecDecodingLogging()

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        if scheduler_stats is not None:
            self._scheduler_stats = scheduler_stats
            self._prefix_queries += scheduler_stats.prefix_cache_queries
            self._prefix_hits += scheduler_stats.prefix_cache_hits
            if scheduler_stats.spec_decoding_stats is not None:
                self._spec_decoding.observe(scheduler_stats.spec_decoding_stats)
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
        self._spec_decoding.log()
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

"""Engine metrics: vLLM's per-request histograms, cache_config_info, the ``vllm:`` names of
``--metrics-compat vllm``, the dashboard's time buckets, and the Grafana dashboard's and
alert rules' queries naming only metrics that tokenmill exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.config import CacheConfig
from tokenmill.core.engine_io import SchedulerStats
from tokenmill.engine.request_stats import FinishedRequestStats, IterationStats
from tokenmill.entrypoints.dashboard.timeseries import DashboardStatLogger, percentile
from tokenmill.metrics import TOKENMILL_ONLY, PrometheusStatLogger, VllmNamesCollector
from tokenmill.router.metrics import RouterMetrics

REPO = Path(__file__).resolve().parents[1]


def samples(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def finished(**kw) -> FinishedRequestStats:
    base = dict(request_id="r", finish_reason="length", e2e_latency=2.0, queue_time=0.5,
                num_prompt_tokens=30, num_generation_tokens=5, prefill_time=0.25,
                decode_time=1.0, inference_time=1.5, mean_time_per_output_token=0.25,
                max_tokens=5, params_n=2)  # fmt: skip
    return FinishedRequestStats(**{**base, **kw})


@pytest.fixture
def logged():
    registry = CollectorRegistry()
    cache = CacheConfig(block_size=16, cache_dtype="fp8")
    stat_logger = PrometheusStatLogger("m", registry, cache)
    stats = IterationStats(iteration_timestamp=0.0, num_prompt_tokens=30, num_generation_tokens=2)
    stats.finished_requests = [finished(), finished(request_id="r-1", params_n=None)]
    stat_logger.record(SchedulerStats(num_running_reqs=1), stats)
    cache.num_blocks = 364  # sized once the engine has started
    return registry, stat_logger


def test_request_histograms(logged):
    registry, _ = logged
    s = samples(registry)
    assert s["tokenmill:request_prompt_tokens_count"] == 2
    assert s["tokenmill:request_prompt_tokens_sum"] == 60
    assert s["tokenmill:request_generation_tokens_sum"] == 10
    assert s["tokenmill:request_prefill_time_seconds_sum"] == 0.5
    assert s["tokenmill:request_decode_time_seconds_sum"] == 2.0
    assert s["tokenmill:request_inference_time_seconds_sum"] == 3.0
    assert s["tokenmill:request_time_per_output_token_seconds_sum"] == 0.5
    assert s["tokenmill:request_params_max_tokens_sum"] == 10
    # n counts once per user request (the second engine request is its sibling)
    assert s["tokenmill:request_params_n_count"] == 1 and s["tokenmill:request_params_n_sum"] == 2
    assert s["tokenmill:iteration_tokens_total_count"] == 1
    assert s["tokenmill:iteration_tokens_total_sum"] == 32
    assert s["tokenmill:request_prompt_tokens_bucket{le=50.0}"] == 2
    info = [k for k in s if k.startswith("tokenmill:cache_config_info")]
    assert len(info) == 1 and "num_gpu_blocks=364" in info[0] and "block_size=16" in info[0]
    assert "cache_dtype=fp8" in info[0]


def test_vllm_names(logged):
    registry, stat_logger = logged
    registry.register(VllmNamesCollector(stat_logger.engine_registry))
    s = samples(registry)
    ours = {k: v for k, v in s.items() if k.startswith("tokenmill:")}
    for key, value in ours.items():
        base = key.split("{")[0].removeprefix("tokenmill:")
        if any(base.startswith(name) for name in TOKENMILL_ONLY):
            assert "vllm:" + key.removeprefix("tokenmill:") not in s
        else:
            assert s["vllm:" + key.removeprefix("tokenmill:")] == value, key
    assert s["vllm:num_requests_running"] == 1


def exported_names() -> set[str]:
    """The sample names of the engine's and the router's metrics (labelled families have no
    samples before their first labels, so names come from the families' types)."""
    registry = CollectorRegistry()
    PrometheusStatLogger("m", registry, CacheConfig())
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names = set()
    for source in (registry, RouterMetrics().registry):
        for family in source.collect():
            names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def queries() -> list[str]:
    dashboard = json.loads((REPO / "deploy" / "grafana" / "tokenmill.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "tokenmill-rules.yaml").read_text())
    return exprs + [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_dashboard_and_rules_read_exported_metrics():
    names = exported_names()
    used = {m for q in queries() for m in re.findall(r"tokenmill:[a-z0-9_]+", q)}
    assert len(used) >= 15
    assert used <= names, used - names


def test_dashboard_covers_what_operators_watch():
    text = " ".join(queries())
    watched = (
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "request_time_per_output_token_seconds_bucket",
        "inter_token_latency",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        'finished_reason="abort"',
        "router_requests_total",
    )
    for metric in watched:
        assert metric in text, metric


def test_dashboard_buckets_with_a_clock():
    now = [1000.0]
    logger = DashboardStatLogger(interval_s=2.0, history_s=20.0, clock=lambda: now[0])
    stats = IterationStats(iteration_timestamp=0.0, num_prompt_tokens=10, num_generation_tokens=4)
    stats.time_to_first_tokens = [0.1, 0.3]
    stats.finished_requests = [finished()]
    logger.record(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5), stats)
    now[0] = 1005.0  # two idle buckets, then this one
    logger.record(SchedulerStats(num_running_reqs=1), None)
    snap = logger.snapshot()
    points = snap["points"]
    assert [p["t"] for p in points] == [1000.0, 1002.0, 1004.0]
    assert points[0]["generation_tokens_per_s"] == 2.0 and points[0]["finished"] == 1
    assert points[0]["ttft_p50_ms"] == pytest.approx(200.0)
    assert points[1]["running"] == 2 and points[1]["generation_tokens_per_s"] == 0
    assert snap["current"]["running"] == 1 and snap["current"]["requests_total"] == 1
    assert snap["current"]["generation_tokens_total"] == 4
    now[0] = 10_000.0  # a long idle spell keeps only the history's worth of buckets
    assert len(logger.snapshot()["points"]) == 10


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)

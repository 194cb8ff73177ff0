"""Spec-decode metrics: vLLM's counters in ``/metrics`` (and under ``vllm:`` names), the
periodic log line, and the acceptance the benchmarks report (offline from the engine's
counters, against a server from its ``/metrics``)."""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tokenmill.benchmarks.spec_decode_report import acceptance, format_acceptance, parse_metrics
from tokenmill.config import SpeculativeConfig
from tokenmill.core.engine_io import SchedulerStats, SpecDecodingStats
from tokenmill.entrypoints.cli.bench import main as bench_main
from tokenmill.metrics import LoggingStatLogger, PrometheusStatLogger, VllmNamesCollector


def _stats() -> SpecDecodingStats:
    stats = SpecDecodingStats.new(3)
    stats.observe_draft(3, 3)
    stats.observe_draft(3, 1)
    stats.observe_draft(2, 0)
    return stats


def test_prometheus_counters_under_both_names():
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger("m", registry, None, SpeculativeConfig("ngram", 3))
    registry.register(VllmNamesCollector(stat_logger.engine_registry))
    stat_logger.record(SchedulerStats(spec_decoding_stats=_stats()), None)
    text = generate_latest(registry).decode()
    for prefix in ("tokenmill", "vllm"):
        assert f'{prefix}:spec_decode_num_drafts_total{{model_name="m"}} 3.0' in text
        assert f'{prefix}:spec_decode_num_draft_tokens_total{{model_name="m"}} 8.0' in text
        assert f'{prefix}:spec_decode_num_accepted_tokens_total{{model_name="m"}} 4.0' in text
        per_pos = f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total"
        assert f'{per_pos}{{model_name="m",position="0"}} 2.0' in text
        assert f'{per_pos}{{model_name="m",position="2"}} 1.0' in text
    parsed = parse_metrics(text)  # tokenmill's names win over the copies
    assert parsed is not None
    assert (parsed.num_drafts, parsed.num_accepted_tokens_per_pos) == (3, [2, 1, 1])
    plain = CollectorRegistry()
    PrometheusStatLogger("m", plain).record(SchedulerStats(), None)
    assert "spec_decode" not in generate_latest(plain).decode()
    assert parse_metrics(generate_latest(plain).decode()) is None


def test_the_log_line_as_vllms(caplog):
    stat_logger = LoggingStatLogger()
    stat_logger.record(SchedulerStats(spec_decoding_stats=_stats()), None)
    with caplog.at_level(logging.INFO, logger="tokenmill.metrics"):
        stat_logger.log()
        stat_logger.log()  # nothing verified since: no second line
    lines = [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("SpecDecoding metrics: Mean acceptance length: 2.33, ")
    assert "Accepted: 4 tokens, Drafted: 8 tokens" in lines[0]
    rates = "Per-position acceptance rate: 0.667, 0.333, 0.333, Avg Draft acceptance rate: 50.0%"
    assert rates in lines[0]


def test_acceptance_over_a_run():
    before = _stats()
    after = _stats()
    after.add(_stats())
    result = acceptance(before, after)
    assert result["spec_decode_acceptance_length"] == pytest.approx(1 + 4 / 3)
    assert result["spec_decode_acceptance_rate"] == pytest.approx(0.5)
    per_position = result["spec_decode_per_position_acceptance_rate"]
    assert per_position == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert "Mean acceptance length: 2.33" in format_acceptance(result)
    assert acceptance(after, after) == {} and format_acceptance({}) == ""


@pytest.mark.slow
def test_bench_latency_reports_the_acceptance_length(tiny_model_dir, tmp_path, capsys):
    # The model as its own (greedy) draft; the bench samples at temperature 1 from a
    # near-uniform dummy model, so drafts are rarely accepted, but they are counted.
    spec = json.dumps({"model": tiny_model_dir, "num_speculative_tokens": 2})
    out_json = tmp_path / "latency.json"
    code = bench_main(
        ["latency", "--model", tiny_model_dir, "--load-format", "dummy", "--kv-cache-memory",
         "32MiB", "--max-model-len", "128", "--input-len", "8", "--output-len", "10",
         "--batch-size", "2", "--num-iters-warmup", "0", "--num-iters", "1",
         "--speculative-config", spec, "--output-json", str(out_json)]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out_json.read_text())
    assert result["spec_decode_num_drafts"] > 0
    assert 1.0 <= result["spec_decode_acceptance_length"] <= 3.0
    length = result["spec_decode_acceptance_length"]
    assert f"Mean acceptance length: {length:.2f}" in capsys.readouterr().out

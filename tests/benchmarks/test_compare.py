"""``tokenmill bench compare``: tables with ratios across tokenmill and vLLM result files, and
the combined plot."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.benchmarks.pngcheck import assert_matplotlib_png
from tokenmill.benchmarks.compare import comparison_rows
from tokenmill.benchmarks.plot import latency_samples, records_of
from tokenmill.benchmarks.serve_metrics import RequestRecord, compute_summary
from tokenmill.entrypoints.cli.bench import main as bench_main


def _serve_result(label: str, ttft_s: float, gap_s: float) -> dict:
    """A tokenmill serve result of 4 requests of 5 tokens each."""
    records = [
        RequestRecord(
            i,
            16,
            5,
            success=True,
            start_s=0.1 * i,
            ttft_s=ttft_s,
            latency_s=ttft_s + 4 * gap_s,
            itl_s=[gap_s] * 4,
            prompt_tokens=16,
            output_tokens=5,
            usage_reported=True,
        )
        for i in range(4)
    ]
    duration = 0.3 + ttft_s + 4 * gap_s
    return {
        "label": label,
        "num_prompts": 4,
        **compute_summary(records, duration, [50, 99]),
        "requests": [dataclasses.asdict(r) for r in records],
    }


def _vllm_style(result: dict) -> dict:
    """The same run as vLLM would save it: flat keys, detailed lists, no records."""
    flat = {k: v for k, v in result.items() if k not in ("requests", "label", "error_counts")}
    flat["backend"] = "vllm"
    flat["ttfts"] = [r["ttft_s"] for r in result["requests"]]
    flat["itls"] = [r["itl_s"] for r in result["requests"]]
    flat["output_lens"] = [r["output_tokens"] for r in result["requests"]]
    return flat


def _write(tmp_path, name: str, data: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_compare_serve_results_with_plot(tmp_path, capsys):
    fast = _serve_result("tokenmill", ttft_s=0.05, gap_s=0.01)
    slow = _vllm_style(_serve_result("vllm", ttft_s=0.10, gap_s=0.02))
    a, b = _write(tmp_path, "tm.json", fast), _write(tmp_path, "vllm-run.json", slow)
    png = tmp_path / "cmp.png"
    assert bench_main(["compare", a, b, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    header = out.splitlines()[0]
    assert "tokenmill" in header and "vllm-run" in header and "vllm-run/tokenmill" in header
    assert lines["Mean TTFT (ms)"].rstrip().endswith("2.000x worse")
    assert lines["Median ITL (ms)"].rstrip().endswith("2.000x worse")
    assert lines["P99 TPOT (ms)"].rstrip().endswith("2.000x worse")
    assert "better" in lines["Benchmark duration (s)"] or "worse" in lines["Benchmark duration (s)"]
    assert lines["Output token throughput (tok/s)"].rstrip().endswith("worse")
    assert lines["Total generated tokens"].rstrip().endswith("1.000x")  # same work, no verdict
    assert_matplotlib_png(str(png))


def test_compare_throughput_and_latency_files(tmp_path, capsys):
    base = {
        "elapsed_time": 10.0,
        "num_requests": 100,
        "total_num_tokens": 5000,
        "requests_per_second": 10.0,
        "tokens_per_second": 500.0,
    }
    faster = dict(
        base,
        elapsed_time=8.0,
        requests_per_second=12.5,
        tokens_per_second=625.0,
        output_tokens_per_second=125.0,
    )
    a, b = _write(tmp_path, "a.json", base), _write(tmp_path, "b.json", faster)
    assert bench_main(["compare", a, b, "--labels", "old", "new"]) == 0
    out = capsys.readouterr().out
    assert "1.250x better" in out and "0.800x better" in out  # tokens/s up, time down
    assert "Throughput (output tokens/s)" in out  # present in one file only: "-" for the other
    lat = [
        {"avg_latency": v, "latencies": [v] * 3, "percentiles": {"50": v, "99": v}}
        for v in (2.0, 1.0)
    ]
    files = [_write(tmp_path, f"lat{i}.json", d) for i, d in enumerate(lat)]
    assert bench_main(["compare", *files, "--plot", str(tmp_path / "lat.png")]) == 0
    out = capsys.readouterr().out
    assert "Avg latency (s)" in out and "P99 latency (s)" in out and "0.500x better" in out
    assert_matplotlib_png(str(tmp_path / "lat.png"))


def test_same_labels_are_told_apart(tmp_path, capsys):
    result = _serve_result("vllm", 0.05, 0.01)
    files = [_write(tmp_path, f"r{i}.json", result) for i in range(2)]
    assert bench_main(["compare", *files]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "vllm#1" in header and "vllm#2" in header and "1.000x" not in header


def test_compare_errors(tmp_path, capsys):
    good = _write(tmp_path, "good.json", {"avg_latency": 1.0})
    assert bench_main(["compare", good, str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert bench_main(["compare", good, good, "--labels", "one"]) == 2
    assert "--labels" in capsys.readouterr().err
    throughput = _write(tmp_path, "tp.json", {"elapsed_time": 2.0, "tokens_per_second": 9.0})
    assert bench_main(["compare", throughput, good]) == 2
    assert "share no metric" in capsys.readouterr().err
    # One file without a metric printed an empty table and exited 0.
    empty = _write(tmp_path, "empty.json", {"note": "no metric here"})
    assert bench_main(["compare", empty]) == 2
    assert "holds no metric" in capsys.readouterr().err


def test_rows_and_samples_from_either_format():
    result = _serve_result("x", 0.05, 0.01)
    keys = [key for key, _, _ in comparison_rows([result])]
    assert keys.index("request_throughput") < keys.index("mean_ttft_ms")
    assert "p50_ttft_ms" in keys and "p99_e2el_ms" in keys
    assert len(records_of(result)) == 4
    samples = latency_samples(result)
    assert samples["ttft"].tolist() == [50.0] * 4 and samples["itl"].size == 16
    vllm = latency_samples(_vllm_style(result))
    assert vllm["ttft"].tolist() == [50.0] * 4 and vllm["itl"].size == 16
    assert vllm["e2el"].tolist() == pytest.approx([90.0] * 4)  # first chunk + gaps
    assert vllm["tpot"].tolist() == pytest.approx([10.0] * 4)

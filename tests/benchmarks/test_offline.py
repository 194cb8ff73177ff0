"""``tokenmill bench throughput`` and ``bench latency`` on the real SmolLM2 (CPU, tiny sizes)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenmill.entrypoints.cli.bench import main as bench_main

pytestmark = pytest.mark.slow

# Small enough for a 2-core CPU: a 256 MiB KV cache and a 512-token context.
ENGINE_FLAGS = ["--kv-cache-memory", "256MiB", "--max-model-len", "512"]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_THREADS", "1")


def test_throughput(tmp_path, capsys, smollm2_gguf_path):
    out_json = tmp_path / "throughput.json"
    code = bench_main(
        [
            "throughput",
            "--model",
            smollm2_gguf_path,
            *ENGINE_FLAGS,
            "--dataset-name",
            "random",
            "--num-prompts",
            "8",
            "--random-input-len",
            "16",
            "--random-output-len",
            "8",
            "--seed",
            "5",
            "--disable-tqdm",
            "--output-json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out_json.read_text())
    # vLLM's keys, so one script reads both engines' files
    assert result["num_requests"] == 8
    assert result["total_num_tokens"] == 8 * (16 + 8)  # ignore_eos: exact lengths
    assert result["total_num_prompt_tokens"] == 8 * 16
    assert result["total_num_output_tokens"] == 8 * 8
    elapsed = result["elapsed_time"]
    assert elapsed > 0
    assert result["requests_per_second"] == pytest.approx(8 / elapsed)
    assert result["tokens_per_second"] == pytest.approx(192 / elapsed)
    assert result["output_tokens_per_second"] == pytest.approx(64 / elapsed)
    assert result["config"]["random_input_len"] == 16
    assert f"Throughput: {8 / elapsed:.2f} requests/s, {192 / elapsed:.2f} total tokens/s" in out
    assert "Total num output tokens:  64" in out


def test_latency(tmp_path, capsys, smollm2_gguf_path):
    out_json = tmp_path / "latency.json"
    code = bench_main(
        [
            "latency",
            "--model",
            smollm2_gguf_path,
            *ENGINE_FLAGS,
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--batch-size",
            "2",
            "--num-iters-warmup",
            "1",
            "--num-iters",
            "2",
            "--output-json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out_json.read_text())
    assert len(result["latencies"]) == 2 and all(t > 0 for t in result["latencies"])
    assert result["avg_latency"] == pytest.approx(np.mean(result["latencies"]))
    assert list(result["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert result["percentiles"]["50"] == pytest.approx(np.median(result["latencies"]))
    assert f"Avg latency: {result['avg_latency']} seconds" in out
    assert "99% percentile latency:" in out


def test_latency_too_long_for_the_context():
    from types import SimpleNamespace

    from tokenmill.benchmarks.common import BenchmarkError
    from tokenmill.benchmarks.latency import run_latency

    model_config = SimpleNamespace(max_model_len=512)
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(config=SimpleNamespace(model_config=model_config))
    )
    with pytest.raises(BenchmarkError, match="exceed max_model_len 512"):
        run_latency(llm, input_len=500, output_len=100, batch_size=1, num_iters=1)


def test_throughput_refuses_prompts_that_fill_the_context(monkeypatch, capsys):
    """Prompts of max_model_len tokens or more leave no room for an output: refused in one
    line (a warning said their outputs stop at the context length, then the engine failed).
    The engine is shut down all the same."""
    from types import SimpleNamespace

    from tokenmill.benchmarks import throughput

    shutdowns = []
    engine = SimpleNamespace(
        config=SimpleNamespace(model_config=SimpleNamespace(max_model_len=512)),
        shutdown=lambda: shutdowns.append(1),
    )
    llm = SimpleNamespace(llm_engine=engine, get_tokenizer=lambda: None)
    monkeypatch.setattr(throughput, "make_llm", lambda *a, **k: llm)
    fake = [SimpleNamespace(prompt_len=600, expected_output_len=1)]
    monkeypatch.setattr(throughput, "sample_requests", lambda *a, **k: fake)
    argv = ["throughput", "--model", "m", "--random-input-len", "600", "--num-prompts", "1"]
    assert bench_main(argv) == 2
    assert "1 prompts have max_model_len=512 tokens or more" in capsys.readouterr().err
    assert shutdowns == [1]


def test_latency_turns_prefix_caching_off_unless_asked(capsys):
    """Every timed run repeats the same prompts: with prefix caching they would hit the
    cache after the first and time only their last token (vLLM's latency bench turns it
    off for the same reason)."""
    from tokenmill.entrypoints.cli.bench import build_parser

    parser = build_parser()
    assert parser.parse_args(["latency"]).enable_prefix_caching is False
    on = parser.parse_args(["latency", "--enable-prefix-caching"])
    assert on.enable_prefix_caching is True
    assert parser.parse_args(["throughput"]).enable_prefix_caching is True
    with pytest.raises(SystemExit):
        parser.parse_args(["latency", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(automatic prefix caching). (default: False)" in help_text

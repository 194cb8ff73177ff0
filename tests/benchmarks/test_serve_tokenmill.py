"""``tokenmill bench serve`` against a real ``tokenmill serve`` on loopback.

The server runs a tiny random-weight Llama (``--load-format dummy``, 2 layers) with
SmolLM2's tokenizer, so it starts quickly on a CPU. Checked: the result file's schema,
completed + failed = num_prompts, token totals equal to the usage the server reported (and
to its own Prometheus counters), a valid PNG plot, and a summary with the failures (exit
code 0) when every request is refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.benchmarks.pngcheck import assert_matplotlib_png
from tests.benchmarks.test_serve import RECORD_KEYS, VLLM_KEYS
from tokenmill.benchmarks.common import BenchmarkError
from tokenmill.entrypoints.cli.bench import main as bench_main

pytestmark = pytest.mark.slow

SERVER_MODULES = (
    "tokenmill.entrypoints.cli.main",
    "tokenmill.entrypoints.cli.serve",
    "tokenmill.entrypoints.openai.server",
)
START_TIMEOUT_S = 240.0


def _missing_server_module() -> str | None:
    for name in SERVER_MODULES:
        if importlib.util.find_spec(name) is None:
            return name
    return None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_tokenizer) -> str:
    """A 2-layer random Llama folder with SmolLM2's tokenizer (as make_models.py writes)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    smollm2_tokenizer.save_pretrained(path)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 49152,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _get(url: str, timeout: float = 2.0) -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as response:
        return response.read()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """``tokenmill serve`` on a free loopback port; yields its base URL."""
    missing = _missing_server_module()
    if missing:
        pytest.skip(f"tokenmill serve is not available in this checkout ({missing} is missing)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")  # noqa: SIM115 (open for the server's lifetime)
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.entrypoints.cli.main",
        "serve",
        tiny_model,
        "--load-format",
        "dummy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "64MiB",
        "--disable-log-requests",
        "--disable-uvicorn-access-log",
    ]
    env = dict(os.environ, TOKENMILL_CPU_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TOKENMILL_API_KEY", None)
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"tokenmill serve exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}"
                )
            try:
                _get(base_url + "/health")
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(f"tokenmill serve did not start:\n{log_path.read_text()[-4000:]}")
                time.sleep(0.5)
        yield base_url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def _counter(base_url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = _get(base_url + "/metrics", timeout=10).decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def _counters_reach(base_url: str, prompt: int, generated: int) -> tuple[float, float]:
    """The server's token counters, read until they show this run (they are updated right
    after the engine step that produced the tokens, which may trail the response)."""
    for _ in range(50):
        values = (
            _counter(base_url, "tokenmill:prompt_tokens_total"),
            _counter(base_url, "tokenmill:generation_tokens_total"),
        )
        if values[0] >= prompt and values[1] >= generated:
            break
        time.sleep(0.1)
    return values


def test_bench_serve_against_tokenmill(server, tiny_model, tmp_path, capsys):
    png = tmp_path / "tokenmill.png"
    prompt_before = _counter(server, "tokenmill:prompt_tokens_total")
    generated_before = _counter(server, "tokenmill:generation_tokens_total")
    code = bench_main(
        [
            "serve",
            "--base-url",
            server,
            "--model",
            tiny_model,
            "--num-prompts",
            "8",
            "--random-input-len",
            "16",
            "--random-output-len",
            "8",
            "--ignore-eos",
            "--max-concurrency",
            "4",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "tokenmill.json",
            "--plot",
            str(png),
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--metric-percentiles",
            "50,90,99",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Traceback" not in out.out + out.err
    result = json.loads((tmp_path / "tokenmill.json").read_text())
    assert VLLM_KEYS <= result.keys() and {"p50_ttft_ms", "p90_itl_ms"} <= result.keys()
    assert result["completed"] + result["failed"] == result["num_prompts"] == 8
    assert result["failed"] == 0, result["error_counts"]
    assert result["label"] == "tokenmill"
    records = result["requests"]
    assert len(records) == 8 and all(RECORD_KEYS <= r.keys() for r in records)
    # the totals are the usage the server reported with each stream
    assert all(r["usage_reported"] for r in records)
    assert result["total_output_tokens"] == sum(r["output_tokens"] for r in records) == 64
    assert result["total_input_tokens"] == sum(r["prompt_tokens"] for r in records)
    assert all(r["prompt_tokens"] >= r["prompt_len"] == 16 for r in records)
    # ... and what the server itself counted
    prompt_now, generated_now = _counters_reach(
        server,
        prompt_before + result["total_input_tokens"],
        generated_before + result["total_output_tokens"],
    )
    assert generated_now - generated_before == result["total_output_tokens"]
    assert prompt_now - prompt_before == result["total_input_tokens"]
    assert result["mean_ttft_ms"] > 0 and result["mean_e2el_ms"] >= result["mean_ttft_ms"]
    assert_matplotlib_png(str(png))


def test_bench_serve_chat_against_tokenmill(server, tiny_model, tmp_path):
    code = bench_main(
        [
            "serve",
            "--base-url",
            server,
            "--model",
            tiny_model,
            "--backend",
            "openai-chat",
            "--endpoint",
            "/v1/chat/completions",
            "--num-prompts",
            "3",
            "--random-input-len",
            "12",
            "--random-output-len",
            "4",
            "--ignore-eos",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "chat.json",
        ]
    )
    result = json.loads((tmp_path / "chat.json").read_text())
    assert code == 0 and (result["completed"], result["failed"]) == (3, 0)
    assert result["total_output_tokens"] == 12
    # the chat template adds tokens around the prompt: the server's count is used
    assert all(r["prompt_tokens"] > r["prompt_len"] for r in result["requests"])


def test_bench_serve_reports_refused_requests(server, tiny_model, tmp_path, capsys):
    code = bench_main(
        [
            "serve",
            "--base-url",
            server,
            "--model",
            tiny_model,
            "--served-model-name",
            "no-such-model",
            "--num-prompts",
            "4",
            "--random-input-len",
            "8",
            "--random-output-len",
            "2",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "refused.json",
        ]
    )
    out = capsys.readouterr()
    assert code == 1 and "Traceback" not in out.out + out.err  # 1: every request failed
    result = json.loads((tmp_path / "refused.json").read_text())
    assert (result["completed"], result["failed"]) == (0, 4)
    (message,) = result["error_counts"]
    assert message.startswith("HTTP 404") and "no-such-model" in message
    assert "Failed requests:                         4" in out.out
    assert f"4 x {message}" in out.out


def test_bench_serve_by_served_name_needs_no_tokenizer(server, tiny_model, tmp_path):
    """``--model NAME`` (the served name, not a path): the tokenizer is the model's root
    folder that /v1/models lists, found on this machine."""
    name = os.path.basename(tiny_model)
    code = bench_main(
        ["serve", "--base-url", server, "--model", name, "--num-prompts", "2",
         "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos",
         "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
         "--result-filename", "r.json"]  # fmt: skip
    )
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 2 and result["tokenizer_id"] == tiny_model


def test_remote_tokenizer_is_the_servers(server, tiny_model, smollm2_tokenizer):
    from tokenmill.benchmarks.bench_tokenizer import RemoteTokenizer, find_tokenizer
    from tokenmill.benchmarks.datasets import decode, encode, token_pool

    name = os.path.basename(tiny_model)
    remote, tokenizer_id = find_tokenizer(None, "/not/on/this/machine", server, name)
    assert isinstance(remote, RemoteTokenizer) and tokenizer_id == server + "/tokenize"
    text = "Benchmarks build prompts of exact lengths: 12 tokens, say."
    ids = encode(remote, text)
    assert ids == smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert decode(remote, ids) == text
    pool = token_pool(remote)
    assert len(pool) > 100 and not set(pool.tolist()) & set(smollm2_tokenizer.all_special_ids)
    with pytest.raises(BenchmarkError, match="pass --tokenizer"):
        RemoteTokenizer(server, "no-such-model")  # the server answers 404


def test_embedded_model_is_found_by_its_served_name():
    from tokenmill.benchmarks.bench_tokenizer import find_tokenizer
    from tokenmill.model_config_args import default_model_path

    tokenizer, tokenizer_id = find_tokenizer(
        None, "SmolLM2-135M-Instruct", "http://127.0.0.1:9", "SmolLM2-135M-Instruct"
    )
    assert tokenizer_id == default_model_path()
    assert tokenizer.encode("Hi", add_special_tokens=False)

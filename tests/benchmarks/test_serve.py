"""``tokenmill bench serve`` end to end against stub OpenAI servers (tests/benchmarks/openai_stub).

Each run goes through the command line (``bench.main``), as a user's would.
"""

from __future__ import annotations

import json
import socket

import pytest

from tests.benchmarks.openai_stub import STUB_MODEL, StubServer, stub_prompt_tokens
from tests.benchmarks.pngcheck import assert_matplotlib_png
from tokenmill.benchmarks.datasets import encode
from tokenmill.entrypoints.cli.bench import main as bench_main

VLLM_KEYS = {
    "date",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
} | {
    f"{stat}_{metric}_ms"
    for stat in ("mean", "median", "std", "p99")
    for metric in ("ttft", "tpot", "itl", "e2el")
}
RECORD_KEYS = {
    "index",
    "prompt_len",
    "expected_output_len",
    "success",
    "error",
    "start_s",
    "ttft_s",
    "latency_s",
    "itl_s",
    "prompt_tokens",
    "output_tokens",
    "usage_reported",
}


def _run(tmp_path, base_url, tokenizer, *extra, num_prompts=6, name="result.json"):
    argv = [
        "serve",
        "--base-url",
        base_url,
        "--model",
        STUB_MODEL,
        "--tokenizer",
        tokenizer,
        "--num-prompts",
        str(num_prompts),
        "--random-input-len",
        "24",
        "--random-output-len",
        "5",
        "--ignore-eos",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        name,
        *extra,
    ]
    code = bench_main(argv)
    path = tmp_path / name
    return code, json.loads(path.read_text()) if path.exists() else None


def test_result_schema_usage_totals_and_plot(
    tmp_path, capsys, smollm2_gguf_path, smollm2_tokenizer
):
    png = tmp_path / "run.png"
    with StubServer("ok") as stub:
        code, result = _run(
            tmp_path,
            stub.base_url,
            smollm2_gguf_path,
            "--max-concurrency",
            "3",
            "--metric-percentiles",
            "50,99",
            "--goodput",
            "ttft:60000",
            "--plot",
            str(png),
            "--metadata",
            "gpu=none",
            num_prompts=12,
        )
    out = capsys.readouterr()
    assert code == 0
    assert "============ Serving Benchmark Result ============" in out.out
    assert "Traceback" not in out.out + out.err
    assert VLLM_KEYS <= result.keys()
    assert (result["completed"], result["failed"], result["num_prompts"]) == (12, 0, 12)
    assert result["max_concurrency"] == 3 and result["request_rate"] == "inf"
    assert result["label"] == "stub"  # the server's owned_by
    assert result["metadata"] == {"gpu": "none"}
    assert result["config"]["random_input_len"] == 24
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    # token totals are the server's usage, not the client's tokenizer count
    assert result["total_input_tokens"] == sum(u["prompt_tokens"] for u in stub.state.reported)
    assert result["total_output_tokens"] == sum(u["completion_tokens"] for u in stub.state.reported)
    assert result["total_output_tokens"] == 12 * 5
    records = result["requests"]
    assert len(records) == 12 and all(RECORD_KEYS <= r.keys() for r in records)
    assert all(r["usage_reported"] and r["success"] and len(r["itl_s"]) == 4 for r in records)
    assert [r["index"] for r in records] == list(range(12))
    # what the server was sent: exact-length text prompts, streaming with usage
    assert stub.state.max_in_flight <= 3
    for body in stub.state.bodies:
        assert body["model"] == STUB_MODEL and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 5
        assert "temperature" not in body  # the server's default, as vLLM's client
        assert len(encode(smollm2_tokenizer, body["prompt"])) == 24
        assert stub_prompt_tokens(body["prompt"]) in {r["prompt_tokens"] for r in records}
    assert assert_matplotlib_png(str(png))[0] > 500


def test_chat_endpoint_with_warmups(tmp_path, smollm2_gguf_path):
    with StubServer("ok") as stub:
        code, result = _run(
            tmp_path,
            stub.base_url,
            smollm2_gguf_path,
            "--backend",
            "openai-chat",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--num-warmups",
            "2",
        )
    assert code == 0 and result["completed"] == 6
    assert len(stub.state.bodies) == 8 and len(result["requests"]) == 6  # warm-ups not counted
    body = stub.state.bodies[0]
    assert body["messages"][0]["role"] == "user"
    assert body["max_completion_tokens"] == 5 and body["top_p"] == 0.9
    assert body["temperature"] == 0.7
    # the role-only first chunk is the first arrival, as vLLM's client counts it (our
    # server sends it with the first token): 6 chunks, 5 gaps
    assert all(len(r["itl_s"]) == 5 for r in result["requests"])
    assert result["endpoint"] == "/v1/chat/completions"


def test_erroring_endpoint_gives_a_summary_not_a_traceback(tmp_path, capsys, smollm2_gguf_path):
    png = tmp_path / "errors.png"
    with StubServer("error") as stub:
        code, result = _run(tmp_path, stub.base_url, smollm2_gguf_path, "--plot", str(png))
    out = capsys.readouterr()
    assert code == 1  # every request failed: the run says so, after its summary
    assert "Traceback" not in out.out + out.err
    assert "Failed requests:                         6" in out.out
    assert "6 x HTTP 500: engine exploded" in out.out
    assert out.err.splitlines()[-1] == (
        "tokenmill bench serve: error: all 6 requests failed (errors listed above)"
    )
    assert (result["completed"], result["failed"]) == (0, 6)
    assert result["error_counts"] == {"HTTP 500: engine exploded": 6}
    assert result["mean_ttft_ms"] is None and result["total_output_tokens"] == 0
    assert all(not r["success"] for r in result["requests"])
    assert_matplotlib_png(str(png))


def test_mixed_failures_are_counted(tmp_path, capsys, smollm2_gguf_path):
    with StubServer("flaky") as stub:
        code, result = _run(
            tmp_path, stub.base_url, smollm2_gguf_path, "--max-concurrency", "1", num_prompts=9
        )
    out = capsys.readouterr().out
    assert code == 0
    assert result["completed"] + result["failed"] == 9
    assert (result["completed"], result["failed"]) == (3, 6)
    assert result["error_counts"] == {
        "HTTP 400: prompt is too long": 3,
        "error in the stream: worker died": 3,
    }
    assert result["total_output_tokens"] == sum(u["completion_tokens"] for u in stub.state.reported)
    assert result["total_input_tokens"] == sum(u["prompt_tokens"] for u in stub.state.reported)
    assert "3 x HTTP 400: prompt is too long" in out


def test_dropped_connection_and_unreachable_server(tmp_path, capsys, smollm2_gguf_path):
    with StubServer("drop") as stub:
        code, result = _run(tmp_path, stub.base_url, smollm2_gguf_path, num_prompts=3)
    assert code == 1 and (result["completed"], result["failed"]) == (0, 3)
    assert all(r["error"] for r in result["requests"])
    capsys.readouterr()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    url = f"http://127.0.0.1:{closed_port}"
    for model in (["--model", STUB_MODEL], []):  # with --model, and asking the server
        code = bench_main(["serve", "--base-url", url, *model, "--num-prompts", "3"])
        out = capsys.readouterr()
        assert code == 2 and out.out == "" and "Traceback" not in out.err
        assert out.err == (
            f"tokenmill bench serve: error: the server at {url} is unreachable (Connection "
            "refused); start it, or point --base-url (or --host/--port) at it\n"
        )


def test_a_server_that_wants_an_api_key_is_named_as_such(capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with StubServer("unauthorized") as stub:
        code = bench_main(["serve", "--base-url", stub.base_url, "--num-prompts", "1"])
    out = capsys.readouterr()
    assert code == 2 and "Traceback" not in out.err
    assert out.err == (
        f"tokenmill bench serve: error: the server at {stub.base_url} refused the request "
        "(HTTP 401): it needs an API key, and OPENAI_API_KEY is not set; set it to the "
        "server's --api-key\n"
    )


def test_counts_with_the_tokenizer_without_usage(tmp_path, smollm2_gguf_path, smollm2_tokenizer):
    with StubServer("no_usage") as stub:
        code, result = _run(
            tmp_path,
            stub.base_url,
            smollm2_gguf_path,
            "--save-detailed",
            "--request-rate",
            "500",
            "--seed",
            "3",
        )
    assert code == 0 and result["completed"] == 6
    text_tokens = len(encode(smollm2_tokenizer, " w0 w1 w2 w3 w4"))
    assert result["total_output_tokens"] == 6 * text_tokens
    assert result["total_input_tokens"] == 6 * 24  # the workload's exact lengths
    assert not any(r["usage_reported"] for r in result["requests"])
    assert result["generated_texts"] == [" w0 w1 w2 w3 w4"] * 6
    assert result["request_rate"] == 500.0
    assert len(result["ttfts"]) == len(result["itls"]) == 6


def test_model_from_the_server_and_default_file_name(tmp_path, monkeypatch, smollm2_gguf_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    with StubServer("ok") as stub:
        code = bench_main(
            [
                "serve",
                "--base-url",
                stub.base_url + "/",
                "--tokenizer",
                smollm2_gguf_path,
                "--num-prompts",
                "2",
                "--random-input-len",
                "8",
                "--random-output-len",
                "2",
                "--disable-tqdm",
                "--save-result",
                "--max-concurrency",
                "2",
            ]
        )
    assert code == 0
    (path,) = tmp_path.glob("stub-infqps-concurrency2-stub-model-*.json")
    result = json.loads(path.read_text())
    assert result["model_id"] == STUB_MODEL and result["completed"] == 2
    assert all(body["model"] == STUB_MODEL for body in stub.state.bodies)
    assert stub.state.authorizations == ["Bearer sk-test"] * 2


def test_sharegpt_and_prefix_repetition_workloads(tmp_path, smollm2_gguf_path, smollm2_tokenizer):
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": f"Question number {i}: why is the sky blue?"},
                {"from": "gpt", "value": "Because of Rayleigh scattering. " * (i + 1)},
            ]
        }
        for i in range(3)
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    with StubServer("ok") as stub:
        code, result = _run(
            tmp_path,
            stub.base_url,
            smollm2_gguf_path,
            "--dataset-name",
            "sharegpt",
            "--dataset-path",
            str(path),
            "--disable-shuffle",
            num_prompts=3,
        )
    assert code == 0 and result["completed"] == 3
    sent = [(b["prompt"], b["max_tokens"]) for b in stub.state.bodies]
    expected = [
        (
            c["conversations"][0]["value"],
            len(encode(smollm2_tokenizer, c["conversations"][1]["value"])),
        )
        for c in conversations
    ]
    assert sorted(sent) == sorted(expected)
    with StubServer("ok") as stub:
        code, result = _run(
            tmp_path,
            stub.base_url,
            smollm2_gguf_path,
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            "32",
            "--prefix-repetition-suffix-len",
            "8",
            "--prefix-repetition-num-prefixes",
            "2",
            "--prefix-repetition-output-len",
            "3",
            num_prompts=6,
            name="prefix.json",
        )
    assert code == 0 and result["completed"] == 6
    prompts = [b["prompt"] for b in stub.state.bodies]
    assert len({p[:40] for p in prompts}) == 2
    assert all(len(encode(smollm2_tokenizer, p)) == 40 for p in prompts)
    assert all(b["max_tokens"] == 3 for b in stub.state.bodies)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--goodput", "itl:5"], "--goodput"),
        (["--metric-percentiles", "0"], "percentile"),
        (["--request-rate", "0"], "--request-rate"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--endpoint", "/v1/embeddings"], "--endpoint"),
        (["--tokenizer", "/does/not/exist"], "pass --tokenizer"),
    ],
)
def test_bad_settings_fail_in_one_line(flags, message, capsys, smollm2_gguf_path):
    with StubServer("ok") as stub:  # (an unreachable server would be reported first)
        argv = [
            "serve",
            "--base-url",
            stub.base_url,
            "--model",
            "m",
            "--tokenizer",
            smollm2_gguf_path,
            "--num-prompts",
            "1",
            *flags,
        ]
        assert bench_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith("tokenmill bench serve: error:")


def test_random_mm_sends_each_request_its_images_as_chat_parts(tmp_path, smollm2_gguf_path):
    import base64
    import io

    from PIL import Image

    with StubServer("ok") as stub:
        code, result = _run(
            tmp_path, stub.base_url, smollm2_gguf_path, "--backend", "openai-chat",
            "--dataset-name", "random-mm", "--random-mm-base-items-per-request", "2",
            "--random-mm-bucket-config", "{(64, 48, 1): 1.0}", num_prompts=3,
        )  # fmt: skip
    assert code == 0 and result["completed"] == 3
    urls = []
    for body in stub.state.bodies:
        parts = body["messages"][0]["content"]
        assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
        urls += [p["image_url"]["url"] for p in parts[:2]]
    assert len(set(urls)) == 6  # distinct random images
    data = base64.b64decode(urls[0].split(",", 1)[1])
    assert Image.open(io.BytesIO(data)).size == (48, 64)  # (width, height)


def test_random_mm_needs_the_chat_endpoint(tmp_path, capsys, smollm2_gguf_path):
    with StubServer("ok") as stub:
        code, _ = _run(tmp_path, stub.base_url, smollm2_gguf_path, "--dataset-name", "random-mm")
    assert code == 2 and "openai-chat" in capsys.readouterr().err


def test_lora_modules_name_an_adapter_per_request():
    """``--lora-modules a b``: each request's ``model`` is one of the adapters, seeded;
    warm-up requests (index -1) and runs without the flag name the model."""
    from tokenmill.benchmarks.datasets import SampleRequest
    from tokenmill.benchmarks.serve import lora_models
    from tokenmill.benchmarks.serve_client import ClientConfig, build_payload

    models = lora_models(["a", "b"], 40, seed=0)
    assert len(models) == 40 and set(models) == {"a", "b"}
    assert models == lora_models(["a", "b"], 40, seed=0)
    assert lora_models(None, 40, seed=0) == ()
    config = ClientConfig("http://x/v1/completions", False, "base", {}, {}, models)
    sample = SampleRequest([1, 2], "hi", 2, 3)
    assert [build_payload(config, sample, i)["model"] for i in range(40)] == list(models)
    assert build_payload(config, sample, -1)["model"] == "base"


def test_a_request_on_a_connection_the_server_closed_is_sent_again():
    """llama-server closes keep-alive connections after a few requests; a request written to
    such a pooled connection never reached the server and is sent again, while other
    connection errors are not retried."""
    import asyncio

    import aiohttp

    from tokenmill.benchmarks import serve_client
    from tokenmill.benchmarks.datasets import SampleRequest

    class Session:
        def __init__(self, failures: list[Exception]) -> None:
            self.failures, self.calls = failures, 0

        async def post(self, url, json, headers):
            self.calls += 1
            if self.failures:
                raise self.failures.pop(0)
            return "response"

    config = serve_client.ClientConfig(
        api_url="http://x/v1/completions", chat=False, model_name="m", sampling={}, headers={}
    )
    sample = SampleRequest(prompt_token_ids=[1], prompt="hi", prompt_len=1, expected_output_len=4)
    stale = aiohttp.ClientOSError(None, "Can not write request body for http://x")
    session = Session([stale, stale])
    assert asyncio.run(serve_client._post(session, config, sample, 0)) == "response"
    assert session.calls == 3
    session = Session([aiohttp.ClientOSError(None, "Connection reset by peer")])
    with pytest.raises(aiohttp.ClientOSError):
        asyncio.run(serve_client._post(session, config, sample, 0))
    assert session.calls == 1

"""``tokenmill serve --speculative-config``: answers (streamed too) equal those of a server
without it, ``/metrics`` carries the spec-decode counters from the engine process, and
``tokenmill bench serve`` reports the acceptance length it reads there.

The model is a tiny dummy-weight Llama serving as its own draft: every greedy draft is
accepted, so a verified draft yields k + 1 tokens.
"""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.conftest import RemoteServer
from tokenmill.benchmarks.spec_decode_report import parse_metrics
from tokenmill.entrypoints.cli.bench import main as bench_main

pytestmark = pytest.mark.slow

K = 2


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    common = [tiny_model_dir, "--load-format", "dummy", "--kv-cache-memory", "32MiB"]
    spec = json.dumps({"model": tiny_model_dir, "num_speculative_tokens": K})
    speculating = RemoteServer([*common, "--speculative-config", spec])
    try:
        plain = RemoteServer(common)
    except BaseException:
        speculating.stop()
        raise
    yield speculating, plain
    speculating.stop()
    plain.stop()


def _complete(server: RemoteServer, stream: bool) -> tuple[str, list[str]]:
    body = {"model": server.get("/v1/models").json()["data"][0]["id"], "prompt": "Hello there",
            "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"][0]["text"], []
    chunks = [
        json.loads(line[len("data: ") :])["choices"][0]["text"]
        for line in response.text.splitlines()
        if line.startswith("data: {") and '"choices":[{' in line.replace(" ", "")
    ]
    return "".join(chunks), chunks


def test_answers_and_counters(servers):
    speculating, plain = servers
    text, _ = _complete(plain, stream=False)
    assert _complete(speculating, stream=False)[0] == text
    streamed, chunks = _complete(speculating, stream=True)
    assert streamed == text and len(chunks) < 12  # several tokens per step
    stats = parse_metrics(speculating.get("/metrics").text)
    assert stats is not None and stats.num_drafts > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert parse_metrics(plain.get("/metrics").text) is None


def test_bench_serve_reports_the_acceptance_length(servers, tmp_path, capsys):
    # 10 tokens: the prompt's step gives 1, then three steps verify 2 drafts and add 1.
    speculating, _ = servers
    out = tmp_path / "serve.json"
    code = bench_main(
        ["serve", "--base-url", speculating.url, "--dataset-name", "random",
         "--random-input-len", "8", "--random-output-len", "10", "--num-prompts", "4",
         "--temperature", "0", "--ignore-eos", "--disable-tqdm", "--result-filename", str(out)]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert result["spec_decode_acceptance_length"] == pytest.approx(K + 1)
    assert f"Mean acceptance length: {K + 1:.2f}" in capsys.readouterr().out

"""``tokenmill bench serve --base-url URL --model SmolLM2-135M-Instruct`` against the default
server, with no --tokenizer: the benchmark finds the embedded model's tokenizer itself."""

from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.cli.bench import main as bench_main

pytestmark = pytest.mark.slow


def test_bench_serve_by_the_embedded_models_name(default_server, tmp_path):
    code = bench_main(
        ["serve", "--base-url", default_server.url, "--model", "SmolLM2-135M-Instruct",
         "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4",
         "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
         "--result-filename", "r.json"]  # fmt: skip
    )
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 2 and result["failed"] == 0
    assert result["tokenizer_id"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")

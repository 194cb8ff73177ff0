"""LoRA adapters over HTTP: ``--lora-modules`` in /v1/models, ``"model": "<adapter>"``
routing (outputs as transformers + peft give them), one slot shared by two adapters in
flight, run-time loading and unloading with vLLM's error cases, and /metrics."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from tests.entrypoints.conftest import RemoteServer
from tests.lora.test_lora_llm import MAX_TOKENS, _reference

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def references(peft_model, smollm2_tokenizer) -> dict[str | None, str]:
    """peft's greedy text of ``PROMPT`` per adapter (None: the base model), computed before
    the server starts so that the two do not compete for the CPU."""
    texts = {}
    for adapter in ("qv", "all", "mlp", None):
        tokens, _ = _reference(peft_model, smollm2_tokenizer, PROMPT, adapter)
        texts[adapter] = smollm2_tokenizer.decode(tokens, skip_special_tokens=True)
    return texts


@pytest.fixture(scope="module")
def server(smollm2_float_dir, adapter_dirs, references):
    args = [
        smollm2_float_dir, "--served-model-name", "smol", "--dtype", "float32",
        "--max-model-len", "512", "--kv-cache-memory", "64MiB",
        "--enable-lora", "--max-loras", "1", "--max-lora-rank", "16", "--max-cpu-loras", "2",
        "--lora-modules", f"qv={adapter_dirs['qv']}",
        json.dumps({"name": "all", "path": adapter_dirs["all"], "base_model_name": "smol-base"}),
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        srv = RemoteServer(args)
    try:
        yield srv
    finally:
        srv.stop()


def _complete(server, model: str) -> str:
    """Greedy text; it ends at EOS, as transformers' ``generate`` does."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]


def test_models_lists_adapters_with_parent(server, adapter_dirs):
    cards = {c["id"]: c for c in server.get("/v1/models").json()["data"]}
    assert set(cards) == {"smol", "qv", "all"}
    assert cards["qv"]["parent"] == "smol" and cards["qv"]["root"] == adapter_dirs["qv"]
    assert cards["all"]["parent"] == "smol-base"
    assert cards["smol"]["parent"] is None


def test_model_routes_to_the_adapter(server, references):
    for model, adapter in [("qv", "qv"), ("all", "all"), ("smol", None)]:
        assert _complete(server, model) == references[adapter], model
    chat = {"model": "qv", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = server.post("/v1/chat/completions", chat)
    assert r.status_code == 200 and r.json()["model"] == "qv", r.text
    r = server.post("/v1/messages", {**chat, "model": "all"})
    assert r.status_code == 200 and r.json()["model"] == "all", r.text
    r = server.post("/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_one_slot_two_adapters_in_flight_all_complete(server):
    client = server.async_openai()

    async def run():
        calls = [
            client.completions.create(model=m, prompt=f"{PROMPT} {i}", max_tokens=6,
                                      temperature=0)
            for i, m in enumerate(["qv", "all", "smol", "qv", "all", "all"])
        ]  # fmt: skip
        return await asyncio.gather(*calls)

    results = asyncio.run(run())
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    metrics = server.metrics()
    info = [k for k in metrics if k.startswith("tokenmill:lora_requests_info{")]
    assert info and "max_lora=1" in info[0]


def test_load_and_unload_at_run_time(server, adapter_dirs, references, tmp_path):
    load = {"lora_name": "mlp", "lora_path": adapter_dirs["mlp"]}
    r = server.post("/v1/load_lora_adapter", load)
    assert r.status_code == 200, r.text
    assert _complete(server, "mlp") == references["mlp"]
    # vLLM's error cases: already loaded, bad folder, rank above the limit: 400.
    assert server.post("/v1/load_lora_adapter", load).status_code == 400
    bad = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    big = tmp_path / "big"
    big.mkdir()
    config = json.load(open(os.path.join(adapter_dirs["qv"], "adapter_config.json")))
    (big / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    (big / "adapter_model.safetensors").write_bytes(b"")
    r = server.post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
    assert r.status_code == 400 and "max_lora_rank" in r.json()["error"]["message"]
    assert server.post("/v1/load_lora_adapter", {"lora_name": "y"}).status_code == 400
    base = {"lora_name": "smol", "lora_path": adapter_dirs["qv"]}
    assert server.post("/v1/load_lora_adapter", base).status_code == 400
    # Unloading: unknown -> 404; then the name is gone.
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "zzz"}).status_code == 404
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "mlp"}).status_code == 200
    r = server.post("/v1/completions", {"model": "mlp", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404
    assert "mlp" not in {c["id"] for c in server.get("/v1/models").json()["data"]}


def test_adapter_folder_gone_after_eviction_is_a_400(server, adapter_dirs, tmp_path):
    """An adapter evicted from host memory is read again from its folder when next named;
    with the folder deleted, the request gets a 400 with the reason (the server goes on)."""
    import shutil

    folder = shutil.copytree(adapter_dirs["mlp"], tmp_path / "gone")
    load = {"lora_name": "gone", "lora_path": str(folder)}
    assert server.post("/v1/load_lora_adapter", load).status_code == 200
    _complete(server, "gone")
    for model in ("qv", "all"):  # --max-cpu-loras 2: "gone" leaves host memory
        _complete(server, model)
    shutil.rmtree(folder)
    r = server.post("/v1/completions", {"model": "gone", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert "no adapter folder" in r.json()["error"]["message"]
    # Streamed, the refusal comes as a status code too, before any event.
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = server.post(path, {"model": "gone", "max_tokens": 1, "stream": True, **body})
        assert r.status_code == 400, r.text
        assert "no adapter folder" in r.json()["error"]["message"]
    assert _complete(server, "qv")
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "gone"}).status_code == 200


def test_a_request_running_when_its_adapter_is_unloaded_names_the_adapter(server, adapter_dirs):
    """Unloading lets a running request finish with its adapter; its (non-streamed) response
    still names the adapter, not the base model."""
    import threading
    import time

    load = {"lora_name": "late", "lora_path": adapter_dirs["mlp"]}
    assert server.post("/v1/load_lora_adapter", load).status_code == 200
    body = {"model": "late", "prompt": PROMPT, "max_tokens": 120, "ignore_eos": True}
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(r=server.post("/v1/completions", body, timeout=120)))
    thread.start()
    deadline = time.monotonic() + 60
    while server.metrics().get("tokenmill:num_requests_running", 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    thread.join()
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["model"] == "late"
    assert result["r"].json()["usage"]["completion_tokens"] == 120

"""Multi-LoRA under tensor and pipeline parallelism (gloo, one process per rank): a batch
mixing three adapters and the base model gives the greedy tokens and logprobs of one
process, with the default half-sharded layers and with ``fully_sharded_loras``.

A tiny random Llama with one KV head (so k/v are replicated over 2 ranks) carries peft
adapters on every projection; SmolLM2's real weights (9 heads, 3 KV heads) split over 3
ranks, whose KV heads are not replicated. ``--fully-sharded-loras`` needs
``--max-lora-rank`` divisible by the tensor-parallel size, so it runs on the tiny model only.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.models import ENGINE, LAYERS, PROMPTS, SCALE
from tests.lora.conftest import ADAPTERS, write_peft_adapter
from tests.model.test_qwen3_parity import save_random_model
from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
LORA = dict(enable_lora=True, max_loras=3, max_lora_rank=16, max_cpu_loras=3)
# Each prompt twice, under the base model and every adapter in turn.
ORDER = [None, "qv", "all", "mlp", "all", "mlp", None, "qv"]
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "tp2-fully-sharded": dict(tensor_parallel_size=2, fully_sharded_loras=True),
    "pp2": dict(pipeline_parallel_size=2),
    "tp2-pp2-fully-sharded": dict(
        tensor_parallel_size=2, pipeline_parallel_size=2, fully_sharded_loras=True
    ),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, dict[str, LoRARequest]]:
    """The tiny Llama (4 heads, 1 KV head, 4 layers) and peft adapters of ``ADAPTERS`` on it."""
    from transformers import LlamaConfig

    path = str(tmp_path_factory.mktemp("tiny-llama"))
    save_random_model(LlamaConfig(**{**LAYERS, "num_key_value_heads": 1}), path, SCALE)
    root = tmp_path_factory.mktemp("tiny-adapters")
    requests = {}
    for i, (name, (targets, r, alpha, rslora)) in enumerate(ADAPTERS.items(), 1):
        folder = str(root / name)
        write_peft_adapter(path, folder, targets, r, alpha, rslora, seed=10 + i)
        requests[name] = LoRARequest(name, i, folder)
    return path, requests


def _generate(path, tokenizer, requests, prompts, **layout):
    """Greedy tokens and their logprobs of ``prompts`` (each prompt twice, under ``ORDER``)."""
    engine = dict(dtype="float32", kv_cache_memory=32 << 20, max_model_len=256)
    if isinstance(prompts[0], dict):  # the tiny model: prompts over several steps
        engine = dict(ENGINE, max_num_seqs=8)
    llm = LLM(path, tokenizer=tokenizer, device="cpu", **engine, **LORA, **layout)
    try:
        loras = [requests[name] if name else None for name in ORDER]
        outputs = llm.generate(prompts * 2, GREEDY, use_tqdm=False, lora_request=loras)
    finally:
        llm.llm_engine.shutdown()
    result = []
    for out in outputs:
        tokens = list(out.outputs[0].token_ids)
        logprobs = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        result.append((tokens, torch.tensor(logprobs)))
    return result


def _assert_same(got, want, atol: float) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs), name in zip(got, want, ORDER, strict=True):
        assert tokens == ref_tokens, name
        torch.testing.assert_close(logprobs, ref_logprobs, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def tiny_reference(tiny, smollm2_gguf_path):
    path, requests = tiny
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return _generate(path, smollm2_gguf_path, requests, prompts)


def test_adapters_change_the_tiny_models_logprobs(tiny_reference):
    """The comparison below is not vacuous: each prompt's two runs (the base model or an
    adapter, and another adapter) differ in their first token's logprob."""
    n = len(PROMPTS)
    for i in range(n):
        first, second = tiny_reference[i][1][0], tiny_reference[i + n][1][0]
        assert abs(first - second) > 1e-3, (ORDER[i], ORDER[i + n])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_generates_the_adapters_tokens_of_one_process(
    layout, tiny, tiny_reference, smollm2_gguf_path
):
    path, requests = tiny
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got = _generate(path, smollm2_gguf_path, requests, prompts, **LAYOUTS[layout])
    _assert_same(got, tiny_reference, atol=1e-4)


def test_smollm2_adapters_over_three_ranks(smollm2_float_dir, adapter_dirs):
    """SmolLM2's real weights and peft adapters (rsLoRA on every projection among them):
    3 tensor-parallel ranks give the tokens and logprobs of one process."""
    requests = {n: LoRARequest(n, i, adapter_dirs[n]) for i, n in enumerate(ADAPTERS, 1)}
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a small village,", "The three primary colors are"]
    one = _generate(smollm2_float_dir, None, requests, prompts)
    three = _generate(smollm2_float_dir, None, requests, prompts, tensor_parallel_size=3)
    _assert_same(three, one, atol=1e-3)


def test_an_adapter_the_ranks_refuse_leaves_the_engine_running(tiny, tmp_path, smollm2_gguf_path):
    """Every rank reads the folder and answers why it cannot be served: the request fails
    with that reason, and the ranks go on serving."""
    path, requests = tiny
    llm = LLM(path, tokenizer=smollm2_gguf_path, device="cpu", **ENGINE, **LORA,
              tensor_parallel_size=2)  # fmt: skip
    try:
        prompt = {"prompt_token_ids": PROMPTS[0]}
        with pytest.raises(ValueError, match="adapter_config.json"):
            llm.generate(prompt, GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("nope", 9, str(tmp_path)))  # fmt: skip
        (out,) = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=requests["all"])
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        assert llm.llm_engine.engine_core.executor.remove_lora(requests["all"].lora_int_id)
    finally:
        llm.llm_engine.shutdown()


def test_an_adapter_one_stage_no_longer_loads_ends_its_request(tiny, tmp_path, smollm2_gguf_path):
    """Each pipeline stage reads its own layers of an adapter. One pushed out of host memory
    while its request waits, whose folder changed so that only the first stage's layers are
    refused (a NaN in layer 0), fails its request with the first stage's reason although
    the last stage ran it; the engine goes on serving."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, requests = tiny
    folder = shutil.copytree(requests["all"].lora_path, tmp_path / "changed")
    changed = LoRARequest("changed", 7, str(folder))
    lora = dict(LORA, max_loras=1, max_cpu_loras=2)
    llm = LLM(path, tokenizer=smollm2_gguf_path, device="cpu", **ENGINE, **lora,
              pipeline_parallel_size=2)  # fmt: skip
    try:
        prompt = {"prompt_token_ids": PROMPTS[0]}
        for request in (changed, requests["qv"]):  # "qv" takes the one GPU slot
            (out,) = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=request)
            assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        weights = folder / "adapter_model.safetensors"
        state = load_file(str(weights))
        (key,) = [k for k in state if ".layers.0." in k and "q_proj.lora_A" in k]
        state[key][0, 0] = float("nan")
        save_file(state, str(weights))
        # "changed" is in host memory when its request arrives (not read again); the two
        # adapters arriving after it push it out, so the step that runs it reads the folder.
        loras = [changed, requests["mlp"], requests["all"]]
        refused, *served = llm.generate([prompt] * 3, GREEDY, use_tqdm=False, lora_request=loras)
        assert refused.outputs[0].finish_reason == "abort"
        assert "NaN or Inf" in str(refused.outputs[0].stop_reason), refused.outputs[0]
        assert [len(o.outputs[0].token_ids) for o in served] == [GREEDY.max_tokens] * 2
        (out,) = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=requests["qv"])
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.llm_engine.shutdown()


def test_data_parallel_engines_serve_the_adapters(tiny, tiny_reference, smollm2_gguf_path):
    """``-dp 2``: each engine core loads the adapters its requests name; the batch's tokens
    and logprobs are those of one engine."""
    import asyncio

    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.engine_args import EngineArgs

    path, requests = tiny
    config = EngineArgs(model=path, tokenizer=smollm2_gguf_path, device="cpu",
                        data_parallel_size=2, **dict(ENGINE, max_num_seqs=8),
                        **LORA).create_engine_config("server")  # fmt: skip
    engine = AsyncLLM(config)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS] * 2

    async def run_one(i: int):
        lora = requests[ORDER[i]] if ORDER[i] else None
        final = None
        async for out in engine.generate(prompts[i], GREEDY, f"r{i}", lora_request=lora):
            final = out
        tokens = list(final.outputs[0].token_ids)
        lps = [lp[t].logprob for lp, t in zip(final.outputs[0].logprobs, tokens, strict=True)]
        return tokens, torch.tensor(lps)

    async def run_all():
        try:
            return await asyncio.gather(*(run_one(i) for i in range(len(prompts))))
        finally:
            engine.shutdown()

    _assert_same(asyncio.run(run_all()), tiny_reference, atol=1e-4)

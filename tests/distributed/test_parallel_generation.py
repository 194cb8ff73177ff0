"""Tensor, pipeline and expert parallelism on CPU (gloo, one process per rank): every layout
generates the greedy tokens of one process, for the real SmolLM2 (GGUF) and tiny random
Llama, Qwen3, Mixtral and Qwen3-MoE checkpoints (safetensors, read as slices per rank).

SmolLM2-135M has 9 attention heads and 3 KV heads: 2 does not divide them (start-up refuses
it, as vLLM does), so it runs tensor-parallel over 3 ranks. Its GGUF blocks kept quantized
split over pipeline stages only; tensor parallelism loads them dequantized.
"""

from __future__ import annotations

import pytest

from tests.distributed.models import ENGINE, PROMPTS, save_tiny_model
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "tp2-pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
    "tp3": dict(tensor_parallel_size=3),
    "tp3-pp2": dict(tensor_parallel_size=3, pipeline_parallel_size=2),
    # Expert parallelism: the 4 experts of Mixtral or Qwen3-MoE, 2 on each of the 2 ranks.
    "tp2-ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
}
CASES = [
    ("smollm2", "pp2"),
    *[("smollm2-dequantized", layout) for layout in ("tp3", "tp3-pp2")],
    *[(m, layout) for m in ("llama", "qwen3", "mixtral") for layout in ("tp2", "pp2", "tp2-pp2")],
    ("mixtral", "tp2-ep"),
    *[("qwen3_moe", layout) for layout in ("tp2", "tp2-ep")],
]


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory, smollm2_gguf_path) -> dict[str, str]:
    paths = {"smollm2": smollm2_gguf_path, "smollm2-dequantized": smollm2_gguf_path}
    for kind in ("llama", "qwen3", "mixtral", "qwen3_moe"):
        paths[kind] = save_tiny_model(kind, tmp_path_factory.mktemp(kind))
    return paths


def _generate(model: str, path: str, tokenizer: str, **layout) -> list[list[int]]:
    engine = dict(ENGINE)
    if model.endswith("-dequantized"):
        engine["gguf_dequantize"] = True
    elif model == "smollm2":
        # The products of GGUF blocks on CPU depend on the batch (one process with 4 or 1
        # requests at a time differs in a token), so this layout runs one at a time.
        engine["max_num_seqs"] = 1
    llm = LLM(path, tokenizer=tokenizer, **engine, **layout)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def reference(model_paths, smollm2_gguf_path) -> dict[str, list[list[int]]]:
    """Each model's greedy tokens in one process (computed once, on first use)."""
    cache: dict[str, list[list[int]]] = {}

    def get(model: str) -> list[list[int]]:
        if model not in cache:
            cache[model] = _generate(model, model_paths[model], smollm2_gguf_path)
        return cache[model]

    return get  # type: ignore[return-value]


@pytest.mark.parametrize("model, layout", CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_layout_generates_the_tokens_of_one_process(
    model, layout, model_paths, reference, smollm2_gguf_path
):
    got = _generate(model, model_paths[model], smollm2_gguf_path, **LAYOUTS[layout])
    assert got == reference(model)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_int4_checkpoint_splits_over_tensor_parallel_ranks(tmp_path, smollm2_gguf_path, fmt):
    """An int4 checkpoint's packed weights, scales and zeros split over 2 ranks as its float
    weights do: the prompt's log-probabilities are those of one process. (Its products run
    in bfloat16 on the CPU, so they agree to bfloat16 precision, and a random model's greedy
    tokens could flip on a near-tie.)"""
    from tests.model.quant_checkpoints import make_int4_checkpoint

    path = f"{make_int4_checkpoint(str(tmp_path), fmt, 32, fmt == 'gptq')}/quant"
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs(**layout) -> list[float]:
        llm = LLM(path, tokenizer=smollm2_gguf_path, **ENGINE, **layout)
        try:
            (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        pairs = zip(PROMPTS[0][1:], out.prompt_logprobs[1:], strict=True)
        return [lp[t].logprob for t, lp in pairs]

    one = prompt_logprobs()
    assert prompt_logprobs(tensor_parallel_size=2) == pytest.approx(one, abs=0.05)


@pytest.mark.parametrize("source", ["nf4", "int8", "online"])
def test_bitsandbytes_checkpoint_splits_over_tensor_parallel_ranks(tmp_path, smollm2_gguf_path,
                                                                   source):
    """A checkpoint transformers quantized with bitsandbytes (4-bit NF4, 8-bit): each rank
    dequantizes a part's packed values whole and keeps its rows (column-parallel) or columns
    (row-parallel); a float checkpoint quantized while loading (``online``): each rank
    quantizes its slice, in the blocks one process would use (64 values, inside a half-row).
    Either way 2 ranks give the prompt's log-probabilities of one process."""
    pytest.importorskip("bitsandbytes")
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    from tests.model.quant_checkpoints import TINY_LLAMA

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).save_pretrained(tmp_path / "f")
    path, engine = str(tmp_path / "q"), dict(ENGINE)
    if source == "online":
        path, engine["quantization"] = str(tmp_path / "f"), "bitsandbytes"
    else:
        kw = {"load_in_8bit": True} if source == "int8" else {
            "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
        config = BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.float32, **kw)
        AutoModelForCausalLM.from_pretrained(
            tmp_path / "f", quantization_config=config, device_map="cpu", dtype=torch.float32
        ).save_pretrained(path)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs(**layout) -> list[float]:
        llm = LLM(path, tokenizer=smollm2_gguf_path, **engine, **layout)
        try:
            (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        pairs = zip(PROMPTS[0][1:], out.prompt_logprobs[1:], strict=True)
        return [lp[t].logprob for t, lp in pairs]

    one = prompt_logprobs()
    assert prompt_logprobs(tensor_parallel_size=2) == pytest.approx(one, abs=1e-3)

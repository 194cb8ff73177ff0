"""Multi-LoRA on CUDA: the batched shrink/expand kernels against the per-row reference at
Llama-3.1-8B's shapes, the same launch replayed in a CUDA graph while the rows' adapters
change, and generation with adapters (CUDA graphs on) against transformers with each
adapter merged into the weights (``W + scale * B A``, what peft's ``merge_and_unload`` does).

The model is SmolLM2-135M's architecture with random weights, as in ``test_engine_gpu.py``
(set ``M135`` to a folder with its config.json and tokenizer). Random weights give flat
logits where greedy choices may tie, so generation is compared by teacher forcing: each
token tokenmill chose has, under the reference, the logprob tokenmill gave it and is within
rounding of the reference's best.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tokenmill.kernels.lora.sgmv import lora_reference, lora_triton

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")


def _case(num_tokens, k, n, num_slots, rank, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g, device=DEV).to(dtype)
    a = (torch.randn(num_slots, rank, k, generator=g, device=DEV) / k**0.5).to(dtype)
    b = (torch.randn(num_slots, rank, n, generator=g, device=DEV) / rank**0.5).to(dtype)
    a[0] = b[0] = 0
    y = torch.randn(num_tokens, n, generator=g, device=DEV).to(dtype)
    # Prompt segments then decode rows of mixed adapters (and rows without one).
    seg = [min(num_tokens, 37), max(0, num_tokens - 37) // 2]
    slots = torch.randint(0, num_slots, (num_tokens,), generator=g, device=DEV)
    slots[: seg[0]] = 1
    slots[seg[0] : seg[0] + seg[1]] = 0
    return y, x, a, b, slots.to(torch.int32)


TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "num_tokens,k,n,rank",
    [
        (1, 4096, 6144, 48),  # one decode row, qkv_proj: 3 parts x rank 16
        (64, 4096, 28672, 32),  # decode batch, gate_up_proj: 2 parts x rank 16
        (300, 14336, 4096, 16),  # mixed step, down_proj
        (2048, 4096, 4096, 64),  # a prompt-sized step, o_proj at rank 64
        (33, 4096, 6144, 1536),  # qkv_proj at --max-lora-rank 512: many rank tiles
    ],
)
def test_kernels_match_per_row_reference(num_tokens, k, n, rank, dtype):
    y, x, a, b, slots = _case(num_tokens, k, n, 9, rank, dtype, seed=num_tokens + rank)
    want = y.float().clone()
    lora_reference(want, x, a, b, slots)
    got = y.clone()
    lora_triton(got, x, a, b, slots)
    scale = want.abs().max().item()
    err = (got.float() - want).abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, f"max error {err:.3g} of {scale:.3g}"
    none = slots == 0
    assert torch.equal(got[none], y[none])


@pytest.mark.parametrize("num_tokens", [1, 64, 700])
@pytest.mark.parametrize("part_sizes", [(4096, 1024, 1024), (14336, 14336)])
def test_merged_parts_at_llama_shapes(num_tokens, part_sizes):
    """q/k/v and gate/up of Llama-3.1-8B at rank 16 per part: B zero outside each part's
    block (as ``LoRALinear`` stores it), the expand reading one block per column tile."""
    rank, n = 16, sum(part_sizes)
    y, x, a, b, slots = _case(num_tokens, 4096, n, 9, rank * len(part_sizes), torch.bfloat16, 3)
    start = 0
    for i, size in enumerate(part_sizes):
        b[:, i * rank : (i + 1) * rank, :start] = 0
        b[:, i * rank : (i + 1) * rank, start + size :] = 0
        start += size
    want = y.float().clone()
    lora_reference(want, x, a, b, slots)
    got = y.clone()
    starts = tuple(sum(part_sizes[: i + 1]) for i in range(len(part_sizes) - 1))
    lora_triton(got, x, a, b, slots, starts)
    err = (got.float() - want).abs().max().item()
    assert err <= TOLERANCE[torch.bfloat16] * want.abs().max().item()


def test_kernels_in_a_cuda_graph_follow_the_slot_buffer():
    """Captured once, replayed after the rows' adapters changed in the persistent slot
    buffer (as the model runner refills it each step): each replay matches the reference."""
    y0, x, a, b, slots = _case(96, 2048, 1536, 5, 32, torch.bfloat16, seed=7)
    static_y = y0.clone()
    lora_triton(static_y, x, a, b, slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_triton(static_y, x, a, b, slots)
    g = torch.Generator(device=DEV).manual_seed(11)
    for _ in range(3):
        slots.copy_(torch.randint(0, 5, slots.shape, generator=g, device=DEV).to(torch.int32))
        static_y.copy_(y0)
        graph.replay()
        want = y0.float().clone()
        lora_reference(want, x, a, b, slots)
        err = (static_y.float() - want).abs().max().item()
        assert err <= 3e-2 * want.abs().max().item()


# ---- generation -------------------------------------------------------------------------

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {"attn": (TARGETS[:4], 8, 16.0), "all": (TARGETS, 16, 16.0)}


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory):
    """SmolLM2's architecture with random weights (a transformers folder) and two PEFT
    adapters of it, random A and B: ``(hf model, model folder, {name: folder})``."""
    src = os.environ.get("M135")
    if not src or not os.path.isdir(src):
        pytest.skip("set M135 to a SmolLM2-135M config + tokenizer folder")
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("smollm2-random")
    for name in os.listdir(src):
        if name != "config.json":
            shutil.copy(os.path.join(src, name), path / name)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).float().eval()
    hf.save_pretrained(path)
    folders = _write_adapters(hf, tmp_path_factory)
    return hf, str(path), folders


def _write_adapters(hf, tmp_path_factory) -> dict[str, str]:
    """PEFT folders of ``ADAPTERS`` for ``hf``, random A and B: ``{name: folder}``."""
    from safetensors.torch import save_file

    modules = dict(hf.named_modules())
    folders = {}
    for seed, (name, (targets, r, alpha)) in enumerate(ADAPTERS.items(), 1):
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for module, layer in modules.items():
            if module.rsplit(".", 1)[-1] in targets:
                key = f"base_model.model.{module}"
                a = torch.randn(r, layer.in_features, generator=g)
                b = torch.randn(layer.out_features, r, generator=g)
                tensors[f"{key}.lora_A.weight"] = a * 0.05
                tensors[f"{key}.lora_B.weight"] = b * 0.05
        folder = tmp_path_factory.mktemp(f"adapter-{name}")
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none",
                  "target_modules": list(targets)}  # fmt: skip
        (folder / "adapter_config.json").write_text(json.dumps(config))
        folders[name] = str(folder)
    return folders


def _merged(hf, folder: str):
    """A copy of ``hf`` with the adapter in ``folder`` merged into its weights, on CUDA."""
    import copy

    from safetensors.torch import load_file

    config = json.load(open(os.path.join(folder, "adapter_config.json")))
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    model = copy.deepcopy(hf).cpu()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith("lora_A.weight"):
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[key.replace("lora_A", "lora_B")]
                modules[module].weight += scale * (b @ a)
    return model.to(DEV)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_generation_with_adapters_matches_merged_weights(model_and_adapters, enforce_eager):
    from tokenmill import LLM, SamplingParams
    from tokenmill.lora.request import LoRARequest

    hf, path, folders = model_and_adapters
    loras = {name: LoRARequest(name, i, folder) for i, (name, folder) in
             enumerate(folders.items(), 1)}  # fmt: skip
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (6 + 9 * i,), generator=g).tolist() for i in range(6)]
    names = [None, "attn", "all", "all", None, "attn"]
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 30, max_model_len=512,
              max_num_seqs=16, enable_lora=True, max_loras=2, max_lora_rank=16,
              enforce_eager=enforce_eager)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
        lora_request=[loras[n] if n else None for n in names],
    )  # fmt: skip
    del llm
    torch.cuda.empty_cache()
    refs = {name: _merged(hf, folder) for name, folder in folders.items()}
    refs[None] = hf.to(DEV)
    differs = 0
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        got = out.outputs[0]
        ids = torch.tensor([prompt + list(got.token_ids)], device=DEV)
        with torch.no_grad():
            logits = refs[name](ids).logits[0, len(prompt) - 1 : -1].float()
        ref_lp = torch.log_softmax(logits, -1)
        tokens = torch.tensor(got.token_ids, device=DEV)
        chosen = ref_lp.gather(1, tokens[:, None])[:, 0]
        pairs = zip(got.logprobs, got.token_ids, strict=True)
        got_lp = torch.tensor([lp[t].logprob for lp, t in pairs], device=DEV)
        torch.testing.assert_close(got_lp, chosen, atol=2e-3, rtol=0)
        assert (ref_lp.max(-1).values - chosen).max() < 2e-3, (name, "not a greedy choice")
        if name is not None:
            with torch.no_grad():
                base = refs[None](ids).logits[0, len(prompt) - 1 : -1].float()
            differs += int((base - logits).abs().max() > 1e-2)
    assert differs >= 3, "the adapters should change the logits"


# ---- tensor and pipeline parallelism ----------------------------------------------------

PARALLEL = {
    "tp2": dict(tensor_parallel_size=2),
    "tp2-eager": dict(tensor_parallel_size=2, enforce_eager=True),
    "tp2-fully-sharded": dict(tensor_parallel_size=2, fully_sharded_loras=True),
    "pp2": dict(pipeline_parallel_size=2),
}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("layout", list(PARALLEL))
def test_adapters_over_two_gpus_give_one_gpus_tokens(layout, tmp_path_factory):
    """A tiny random Llama with one KV head (k/v replicated on both ranks) and the adapters
    of ``ADAPTERS`` mixed with the base model in one batch: 2 GPUs (NCCL, the LoRA
    collectives inside CUDA graphs but for ``tp2-eager``) give one GPU's greedy tokens and
    logprobs, in float32."""
    src = os.environ.get("M135")
    if not src or not os.path.isdir(src):
        pytest.skip("set M135 to a SmolLM2-135M config + tokenizer folder")
    from transformers import LlamaConfig

    from tests.distributed.models import ENGINE, LAYERS, PROMPTS, SCALE
    from tests.model.test_qwen3_parity import save_random_model
    from tokenmill import LLM, SamplingParams
    from tokenmill.lora.request import LoRARequest

    path = str(tmp_path_factory.mktemp("tiny-llama"))
    hf = save_random_model(LlamaConfig(**{**LAYERS, "num_key_value_heads": 1}), path, SCALE)
    folders = _write_adapters(hf, tmp_path_factory)
    loras = [None, *(LoRARequest(n, i, f) for i, (n, f) in enumerate(folders.items(), 1))]
    requests = [loras[i % len(loras)] for i in range(2 * len(PROMPTS))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)

    def generate(**layout):
        llm = LLM(path, tokenizer=src, device="cuda", **dict(ENGINE, max_num_seqs=8),
                  enable_lora=True, max_loras=2, max_lora_rank=16, **layout)  # fmt: skip
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 2], params,
                                use_tqdm=False, lora_request=requests)  # fmt: skip
        finally:
            llm.llm_engine.shutdown()
        result = []
        for out in outs:
            got = out.outputs[0]
            lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
            result.append((list(got.token_ids), torch.tensor(lps)))
        return result

    one = generate()
    for (tokens, lps), (ref_tokens, ref_lps) in zip(generate(**PARALLEL[layout]), one,
                                                    strict=True):  # fmt: skip
        assert tokens == ref_tokens
        torch.testing.assert_close(lps, ref_lps, atol=1e-3, rtol=0)

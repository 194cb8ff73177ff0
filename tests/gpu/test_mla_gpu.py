"""Multi-head latent attention on CUDA: the Triton decode kernel at DeepSeek-V3's dimensions
(128 heads, kv_lora_rank 512, rope 64) and the fused rotation + latent write in bfloat16
against float32 references; a small random DeepSeek-V3 in bfloat16 against the CPU float32
model; and the engine's CUDA graphs (whole decode passes over the latent cache, piecewise
prompt steps) against eager execution in float32, with transformers' greedy tokens.

The engine test takes its tokenizer from ``M135`` (SmolLM2-135M's config and tokenizer, the
peer-vllm bundle's ``smollm2-135m-dummy``), as ``test_engine_gpu.py`` does.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

pytestmark = pytest.mark.gpu

HEADS, RANK, ROPE, BLOCK = 128, 512, 64, 16


def _decode_problem(seq_lens: list[int], dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", generator=gen)
    batch = len(seq_lens)
    blocks_per = [max(1, -(-s // BLOCK)) for s in seq_lens]
    num_blocks = sum(blocks_per) + 4
    cache = torch.randn(num_blocks, BLOCK, RANK + ROPE, **kw).to(dtype)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros(batch, max(blocks_per), dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(blocks_per):
        table[b, :n] = perm[start : start + n]
        start += n
    q_lat = torch.randn(HEADS, batch, RANK, **kw).to(dtype)
    q_pe = torch.randn(batch, HEADS, ROPE, **kw).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q_lat, q_pe, cache, table, lens


@pytest.mark.parametrize(
    "seq_lens", [[1], [4097], [17, 300, 1025, 2, 640, 0, 33], [1100 + 3 * i for i in range(64)]]
)
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_decode_kernel_at_deepseek_dims(seq_lens, splits):
    from tokenmill.kernels.attention.mla_decode import mla_decode
    from tokenmill.model.attention.mla import attend_latent_torch

    q_lat, q_pe, cache, table, lens = _decode_problem(seq_lens)
    scale = 192**-0.5
    got = mla_decode(q_lat, q_pe, cache, table, lens, scale, max(seq_lens), num_splits=splits)
    exact = attend_latent_torch(q_lat.float(), q_pe.float(), cache.float(), table, lens, RANK,
                                scale)  # fmt: skip
    err = (got.float() - exact).abs().max().item()
    assert err < 2e-2 * exact.abs().max().item(), f"max error {err:.3g}"


def test_decode_kernel_replays_in_a_cuda_graph():
    """Launch arguments depend only on shapes and ``max_seq_len``: a graph captured for
    long contexts replays shorter ones."""
    from tokenmill.kernels.attention.mla_decode import mla_decode
    from tokenmill.model.attention.mla import attend_latent_torch

    q_lat, q_pe, cache, table, lens = _decode_problem([900, 5, 1200])
    mla_decode(q_lat, q_pe, cache, table, lens, 0.1, 4096)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(q_lat, q_pe, cache, table, lens, 0.1, 4096)
    lens.copy_(torch.tensor([31, 1, 700], dtype=torch.int32))
    graph.replay()
    exact = attend_latent_torch(q_lat.float(), q_pe.float(), cache.float(), table, lens, RANK, 0.1)
    assert (out.float() - exact).abs().max().item() < 2e-2 * exact.abs().max().item()


@pytest.mark.parametrize("neox", [True, False])
def test_rope_and_cache_bf16(neox):
    from tokenmill.kernels.attention.mla_cache import mla_rope_and_cache
    from tokenmill.model.layers.rotary import RotaryEmbedding

    tokens, nope = 37, 128
    rope = RotaryEmbedding(ROPE, ROPE, 4096, 10000.0, is_neox_style=neox).cuda()
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    query = torch.randn(tokens, HEADS * (nope + ROPE), device="cuda", dtype=torch.bfloat16)
    latent = torch.randn(tokens, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64 * BLOCK, device="cuda")[:tokens]
    slots[3] = -1
    cache = torch.zeros(64, BLOCK, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
    q = query.clone()
    mla_rope_and_cache(positions, q, latent[:, :RANK], latent[:, RANK:], rope.cos_sin_cache,
                       neox, HEADS, nope, cache, slots, tokens)  # fmt: skip
    q_ref = query.clone().view(tokens, HEADS, nope + ROPE)
    q_ref[..., nope:] = rope.rotate(positions, q_ref[..., nope:])
    k_rot = rope.rotate(positions, latent[:, None, RANK:]).squeeze(1)
    torch.testing.assert_close(q, q_ref.view(tokens, -1), atol=1e-2, rtol=1e-2)
    flat = cache.view(-1, RANK + ROPE)
    valid = slots >= 0
    expected = torch.cat([latent[:, :RANK], k_rot], dim=-1)[valid]
    torch.testing.assert_close(flat[slots[valid]], expected, atol=1e-2, rtol=1e-2)
    assert int((flat.abs().sum(-1) > 0).sum()) == tokens - 1


@pytest.fixture(scope="module")
def deepseek_random(tmp_path_factory):
    from tests.model.test_deepseek_parity import _configs, save_deepseek

    path = tmp_path_factory.mktemp("v3-gpu")
    hf = save_deepseek(_configs()["v3-qlora-yarn"], path)
    return hf, str(path)


@pytest.mark.parametrize("pieces", [False, True])
def test_bf16_logits_match_cpu_float32(deepseek_random, pieces, monkeypatch):
    """``pieces``: prompt contexts expanded 16 tokens at a time (online softmax)."""
    from tests.model.paged import PagedRunner
    from tokenmill.config import LoadConfig
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.attention.mla import MLAImpl
    from tokenmill.model.attention.selector import get_attn_backend
    from tokenmill.model.loader.model_loader import get_model

    if pieces:
        monkeypatch.setattr(MLAImpl, "max_expanded_context", 8)
        monkeypatch.setattr(MLAImpl, "piece_scores", 1)
    hf, path = deepseek_random
    cfg = EngineArgs(model=path, dtype="bfloat16", device="cuda").create_engine_config()
    backend = get_attn_backend("cuda", use_mla=True)
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cuda"), backend)
    runner = PagedRunner(model, cfg.model_config.hf_config, num_blocks=32, backend=backend)
    gen = torch.Generator().manual_seed(1)
    seqs = {k: torch.randint(0, 320, (n,), generator=gen).tolist()
            for k, n in (("fresh", 20), ("decode", 31), ("chunk", 50))}  # fmt: skip
    runner.step({"decode": seqs["decode"][:30]}, seqs)
    runner.step({"chunk": seqs["chunk"][:37]}, seqs)
    logits = runner.step(
        {"fresh": seqs["fresh"], "decode": seqs["decode"][30:], "chunk": seqs["chunk"][37:]}, seqs
    ).float().cpu()
    with torch.no_grad():
        ref = {k: hf(torch.tensor([v])).logits[0] for k, v in seqs.items()}
    expected = torch.cat([ref["fresh"], ref["decode"][30:], ref["chunk"][37:]])
    rel = (logits - expected).abs().max() / expected.abs().max()
    assert rel < 3e-2, f"max error {rel:.4f} of the largest logit"


def test_cuda_graphs_equal_eager_and_transformers_in_float32(deepseek_random, tmp_path):
    src = os.environ.get("M135")
    if not src or not os.path.isdir(src):
        pytest.skip("set M135 to a SmolLM2-135M config + tokenizer folder")
    from tokenmill import LLM, SamplingParams

    hf, path = deepseek_random
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(src, name), tmp_path / name)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (5 + 9 * i,), generator=gen).tolist() for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        llm = LLM(path, tokenizer=str(tmp_path), dtype="float32", max_model_len=128,
                  kv_cache_memory=64 << 20, enforce_eager=eager)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[eager] = [list(o.outputs[0].token_ids) for o in outs]
        del llm
        torch.cuda.empty_cache()
    assert tokens[False] == tokens[True]
    for prompt, got in zip(prompts, tokens[False], strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == expected[0, len(prompt) :].tolist()

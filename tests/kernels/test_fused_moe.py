"""MoE routing and expert computation: the torch path against a per-token loop, the Triton
grouped-GEMM kernel against the torch path (Triton's interpreter on CPU), and the
token-by-expert alignment."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels.moe.fused_moe import (
    align_tokens_by_expert,
    fused_experts_torch,
    select_experts,
)


def _problem(tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, experts, generator=gen) * 3
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def _per_token_reference(x, w13, w2, weights, ids):
    out = torch.zeros(x.shape, dtype=torch.float64)
    x, w13, w2 = x.double(), w13.double(), w2.double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += float(weights[t, j]) * (w2[e] @ (F.silu(gate) * up))
    return out


# ---- routing ------------------------------------------------------------------------------


def test_renormalized_routing_is_softmax_over_top_k_logits():
    logits = torch.randn(9, 8)
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert weights.dtype == torch.float32 and ids.shape == (9, 2)
    expected = torch.softmax(torch.gather(logits, 1, ids), dim=-1)
    torch.testing.assert_close(weights, expected)
    assert torch.equal(ids, logits.topk(2, dim=-1).indices)


def test_raw_routing_keeps_full_softmax_probabilities():
    logits = torch.randn(9, 8, dtype=torch.bfloat16)
    weights, ids = select_experts(logits, 3, renormalize=False)
    probs = torch.softmax(logits.float(), dim=-1)
    torch.testing.assert_close(weights, torch.gather(probs, 1, ids))
    assert bool((weights.sum(-1) < 1).all())


# ---- the torch path -------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (23, 2), (40, 3)])
def test_torch_path_equals_per_token_loop(tokens, top_k):
    x, w13, w2, weights, ids = _problem(tokens, 32, 48, 6, top_k)
    out = fused_experts_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), _per_token_reference(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


# ---- token alignment ----------------------------------------------------------------------


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_groups_slots_by_expert_padded_to_the_tile(block_m):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 5], [1, 0]])  # experts 2 and 4 get none
    num_experts, num_slots = 6, ids.numel()
    sorted_slots, block_experts, num_padded = align_tokens_by_expert(ids, num_experts, block_m)
    used = int(num_padded)
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_slots.numel() % block_m == 0 and sorted_slots.numel() >= used
    assert bool((sorted_slots[used:] == num_slots).all())
    valid = sorted_slots[:used][sorted_slots[:used] < num_slots]
    assert sorted(valid.tolist()) == list(range(num_slots))  # every slot exactly once
    flat = ids.flatten()
    for tile in range(used // block_m):
        rows = sorted_slots[tile * block_m : (tile + 1) * block_m]
        rows = rows[rows < num_slots]
        assert bool((flat[rows.long()] == block_experts[tile]).all())
        # slots of one expert keep token order (a stable sort)
        assert rows.tolist() == sorted(rows.tolist())
    assert bool((block_experts[used // block_m :] == num_experts).all())


# ---- the Triton kernel (CUDA, or the interpreter on CPU) ----------------------------------

needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or the Triton interpreter",
)
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
SMALL_TILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)


@needs_triton
@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,top_k,config",
    [
        (1, 32, 48, 8, 2, None),  # decode: one token, most experts idle
        (37, 64, 96, 8, 2, None),
        (29, 40, 24, 4, 3, SMALL_TILES),  # H and I not multiples of the tiles
        (64, 32, 32, 3, 1, dict(SMALL_TILES, BLOCK_M=32, GROUP_M=1)),
    ],
)
def test_triton_kernel_equals_torch_path(tokens, hidden, inter, experts, top_k, config):
    pytest.importorskip("triton")
    from tokenmill.kernels.moe.fused_moe import fused_experts_triton

    x, w13, w2, weights, ids = _problem(tokens, hidden, inter, experts, top_k, seed=tokens)
    expected = fused_experts_torch(x, w13, w2, weights, ids)
    args = [t.to(DEV) for t in (x, w13, w2, weights, ids)]
    got = fused_experts_triton(*args, config=config).cpu()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("slots_per_expert", [8, 40, 200])
def test_triton_kernel_with_the_gpu_tile_configs(slots_per_expert):
    """The bf16 tile shapes (large tiles, masked edges) computed in float32."""
    pytest.importorskip("triton")
    from tokenmill.kernels.moe.fused_moe import fused_experts_triton, moe_tile_config

    config = moe_tile_config(slots_per_expert * 4, 4, torch.bfloat16)
    x, w13, w2, weights, ids = _problem(19, 48, 80, 4, 2, seed=3)
    expected = fused_experts_torch(x, w13, w2, weights, ids)
    args = [t.to(DEV) for t in (x, w13, w2, weights, ids)]
    got = fused_experts_triton(*args, config=config).cpu()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_triton
def test_triton_kernel_with_no_tokens():
    pytest.importorskip("triton")
    from tokenmill.kernels.moe.fused_moe import fused_experts_triton

    x, w13, w2, weights, ids = _problem(0, 32, 48, 4, 2)
    assert fused_experts_triton(x, w13, w2, weights, ids).shape == (0, 32)


# ---- the layer and its weight loading -------------------------------------------------------


# ---- expert parallelism --------------------------------------------------------------------


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_ranks_holding_some_experts_sum_to_all(path):
    """Expert parallelism: each of two ranks computes the assignments to its own experts
    (others map to -1); the two parts add up to every expert's result."""
    from tokenmill.kernels.moe.fused_moe import fused_experts, fused_experts_triton

    x, w13, w2, weights, ids = _problem(tokens=13, hidden=32, inter=16, experts=5, top_k=2)
    whole = fused_experts_torch(x, w13, w2, weights, ids)
    parts = []
    for first, count in ((0, 3), (3, 2)):  # 5 experts over 2 ranks: 3 + 2
        expert_map = torch.full((5,), -1, dtype=torch.int32)
        expert_map[first : first + count] = torch.arange(count, dtype=torch.int32)
        local = (w13[first : first + count], w2[first : first + count])
        if path == "torch":
            parts.append(fused_experts(x, *local, weights, ids, expert_map=expert_map))
        else:
            parts.append(fused_experts_triton(
                x, *local, weights, expert_map[ids], remote_experts=True
            ))  # fmt: skip
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)


# ---- the grouped-GEMM path (prompt-sized batches on CUDA) ------------------------------------


@pytest.mark.parametrize("remote", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_mm_path_equals_torch_path(remote, bias):
    """``fused_experts_grouped_mm`` (bf16, the CUDA prompt path; torch's CPU kernel here)
    against the torch loop on the same weights: with biases, with experts that get no
    token, and with assignments to another rank's experts (-1), which add nothing."""
    from tokenmill.kernels.moe.fused_moe import fused_experts_grouped_mm, grouped_mm_supported

    x, w13, w2, weights, ids = _problem(tokens=37, hidden=32, inter=24, experts=6, top_k=2)
    ids = ids.masked_fill(ids == 4, 5)  # expert 4 gets no token
    if remote:
        ids = ids.masked_fill(ids == 1, -1)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    biases = {}
    if bias:
        gen = torch.Generator().manual_seed(7)
        biases = dict(w13_bias=torch.randn(6, 48, generator=gen).bfloat16(),
                      w2_bias=torch.randn(6, 32, generator=gen).bfloat16())
    assert grouped_mm_supported(x, w13, w2)
    got = fused_experts_grouped_mm(x, w13, w2, weights, ids, **biases)
    expected = fused_experts_torch(x, w13, w2, weights, ids, **biases)
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=2e-2)
    assert not grouped_mm_supported(x.float(), w13.float(), w2.float())


def test_grouped_mm_path_decodes_mxfp4_experts():
    """MXFP4 experts (gpt-oss: biases, the clamped SwiGLU) through the grouped GEMM equal
    the torch loop, which decodes them one at a time."""
    from tokenmill.kernels.moe.fused_moe import fused_experts_grouped_mm, grouped_mm_supported
    from tokenmill.kernels.moe.tiles import GatedActivation

    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter = 4, 64, 32
    w13 = torch.randint(0, 256, (experts, 2 * inter, hidden // 2), dtype=torch.uint8,
                        generator=gen)  # fmt: skip
    w2 = torch.randint(0, 256, (experts, hidden, inter // 2), dtype=torch.uint8, generator=gen)
    extra = dict(
        w13_scale=torch.randint(118, 124, (experts, 2 * inter, hidden // 32), dtype=torch.uint8,
                                generator=gen),
        w2_scale=torch.randint(118, 124, (experts, hidden, inter // 32), dtype=torch.uint8,
                               generator=gen),
        w13_bias=torch.randn(experts, 2 * inter, generator=gen).bfloat16(),
        w2_bias=torch.randn(experts, hidden, generator=gen).bfloat16(),
        activation=GatedActivation("swigluoai", 1.702, 7.0),
    )  # fmt: skip
    x = torch.randn(29, hidden, generator=gen).bfloat16()
    weights, ids = select_experts(torch.randn(29, experts, generator=gen), 2, renormalize=True)
    assert grouped_mm_supported(x, w13, w2, mxfp4=True)
    got = fused_experts_grouped_mm(x, w13, w2, weights, ids, **extra)
    expected = fused_experts_torch(x, w13, w2, weights, ids, **extra)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=2e-2 * scale, rtol=2e-2)

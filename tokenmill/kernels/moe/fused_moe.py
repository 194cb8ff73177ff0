"""Mixture-of-experts (MoE) kernels: top-k routing and the routed experts' SwiGLU MLPs.

Sparse MoE (Shazeer et al. 2017, arXiv:1701.06538) as Mixtral (Jiang et al. 2024,
arXiv:2401.04088) and Qwen3-MoE use it: a router scores ``E`` experts per token, the top ``k``
run, and their outputs are summed weighted by the (optionally renormalised) router
probabilities.

Two implementations compute the experts:

- ``fused_experts_torch``: a loop over the experts that received tokens (the CPU path and the
  reference).
- ``fused_experts_triton``: the GPU path. Following MegaBlocks (Gale et al. 2022,
  "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts", arXiv:2211.15841), the
  (token, expert) assignments are sorted by expert and each expert's group is padded to a
  multiple of the GEMM tile height, so every row tile belongs to exactly one expert. One
  grouped-GEMM launch then covers all experts: each program reads its tile's expert id and
  multiplies the gathered token rows by that expert's weights. The first launch computes
  gate and up together and applies the SwiGLU activation in registers (the ``[T*k, 2I]``
  gate/up activations never reach memory); the second computes the down projection and
  scales each row by its routing weight; a sum over the ``k`` rows of each token finishes.
  Sorting and padding are done with device-side torch ops sized by an upper bound, so a
  launch never waits on the host.

Expert weights come stacked: ``w13 [E, 2I, H]`` (gate rows then up rows) and
``w2 [E, H, I]``, so each kernel reads one tensor; or as MXFP4 (``mxfp4.py``: ``w13`` uint8
``[E, 2I, H / 2]`` with scales ``[E, 2I, H / 32]``, ``w2`` likewise), which the Triton
kernel decodes tile by tile in registers and the torch path one expert at a time. Experts
may carry biases (``[E, 2I]``, ``[E, H]``) and combine gate and up with SiLU (SwiGLU) or
gpt-oss' clamped variant (``GatedActivation``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels.device import HAS_TRITON
from tokenmill.kernels.moe.mxfp4 import MXFP4_BLOCK, check_mxfp4_shapes, decode_mxfp4
from tokenmill.kernels.moe.mxfp4_experts import launch_mxfp4_gemm, mxfp4_tile_config
from tokenmill.kernels.moe.tiles import SILU, GatedActivation
from tokenmill.math_utils import cdiv

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tokenmill.kernels.moe.tiles import gated_tile, grouped_tile_ids


def _dense_expert(
    expert: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``expert``'s ``(w13 [2I, H], w2 [H, I])`` in ``dtype`` (MXFP4 decoded)."""
    if w13_scale is None or w2_scale is None:
        return w13[expert], w2[expert]
    return (
        decode_mxfp4(w13[expert], w13_scale[expert], dtype),
        decode_mxfp4(w2[expert], w2_scale[expert], dtype),
    )


# Batches of at least this many tokens take the torch expert loop on CUDA (see
# ``fused_experts``): plain weights, and MXFP4 ones.
TORCH_MIN_TOKENS = 2048
MXFP4_TORCH_MIN_TOKENS = 12288


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: softmax over all experts, keep the ``top_k`` largest.

    With ``renormalize`` the kept probabilities are divided by their sum, which equals a
    softmax over the top-k logits (Mixtral; Qwen3-MoE with ``norm_topk_prob``).

    Args:
        router_logits: ``[T, E]``, any float dtype.
        top_k: experts per token.
        renormalize: make each token's ``top_k`` weights sum to 1.

    Returns:
        ``(topk_weights [T, top_k] float32, topk_ids [T, top_k] int64)``, in descending
        weight order.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts_torch(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: GatedActivation = SILU,
) -> torch.Tensor:
    """Routed gated experts in plain torch: one pair of GEMMs per expert that got tokens
    (MXFP4 experts decoded one at a time, just before their GEMMs).

    Args:
        hidden: ``[T, H]``.
        w13: ``[E, 2I, H]``, gate rows ``[:I]`` then up rows ``[I:]``; MXFP4: uint8
            ``[E, 2I, H / 2]``.
        w2: ``[E, H, I]``; MXFP4: uint8 ``[E, H, I / 2]``.
        topk_weights: ``[T, k]`` routing weights (float32 or the activations' dtype).
        topk_ids: ``[T, k]`` expert ids; -1 marks an assignment to an expert held elsewhere
            (expert parallelism), which adds nothing here.
        w13_scale, w2_scale: MXFP4 scales (uint8 ``[E, 2I, H / 32]``, ``[E, H, I / 32]``);
            None for plain weights.
        w13_bias, w2_bias: ``[E, 2I]`` and ``[E, H]``, or None.
        activation: how gate and up combine.

    Returns:
        ``[T, H]`` in ``hidden``'s dtype:
        ``sum_j w[t, j] * (w2 act(w13 x + b13) + b2)`` over the experts ``ids[t, j]``.
    """
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    out = torch.zeros_like(hidden)
    # Assignments to other ranks' experts sort last, as expert ``num_experts``.
    flat_ids = topk_ids.reshape(-1).long().masked_fill(topk_ids.reshape(-1) < 0, num_experts)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()[:num_experts]
    flat_weights = topk_weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start : start + count]
        start += count
        tokens = slots // top_k
        w_in, w_out = _dense_expert(expert, w13, w2, w13_scale, w2_scale, hidden.dtype)
        b_in = None if w13_bias is None else w13_bias[expert]
        b_out = None if w2_bias is None else w2_bias[expert]
        gate, up = F.linear(hidden[tokens], w_in, b_in).chunk(2, dim=-1)
        y = F.linear(activation(gate, up), w_out, b_out)
        y = y * flat_weights[slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def slots_by_expert(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(expert of each slot [T*k] int64, slots per expert [E + 1], slots in expert order
    [T*k])``: ids of -1 (another rank's expert) count as expert ``E``, sorted last; the
    stable sort keeps each expert's slots in slot order. No read-back to the host."""
    flat = topk_ids.reshape(-1).long()
    flat = flat.masked_fill(flat < 0, num_experts)  # other ranks' experts: one group, last
    # NOTE: scatter_add rather than bincount, whose output size depends on the data (a sync).
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return flat, counts, torch.argsort(flat, stable=True)


def grouped_mm_supported(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         mxfp4: bool = False) -> bool:  # fmt: skip
    """Whether ``fused_experts_grouped_mm`` takes these tensors: bfloat16 activations, with
    bfloat16 or (``mxfp4``) MXFP4 experts, whose rows are 16-byte aligned (the grouped
    GEMM's TMA loads need it)."""
    if hidden.dtype != torch.bfloat16:
        return False
    if not mxfp4 and (w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16):
        return False
    inter = w2.shape[2] * (2 if mxfp4 else 1)
    return hidden.shape[1] % 8 == 0 and inter % 8 == 0


def fused_experts_grouped_mm(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: GatedActivation = SILU,
) -> torch.Tensor:
    """Routed gated experts as two grouped GEMMs (``torch.nn.functional.grouped_mm``) over
    the assignments sorted by expert: no read-back of the per-expert counts to the host and
    no scatter-add (each token's ``k`` rows are put back in slot order and summed).

    Same arguments and result as ``fused_experts_torch`` for bfloat16 activations
    (``grouped_mm_supported``); ids of -1 (another rank's expert) add nothing. MXFP4
    experts are decoded into bfloat16 for each product, every expert at once (``w13``
    first, then ``w2`` in its place): a transient buffer of ``E * 2I * H`` values, which
    the start-up memory profile sees when it runs a batch of this size.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden_size = w13.shape[0], w2.shape[1]
    flat, counts, order = slots_by_expert(topk_ids, num_experts)
    expert_of = flat[order]
    offs = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    x = hidden[order // top_k]
    if w13_scale is not None:
        w13 = decode_mxfp4(w13, w13_scale, hidden.dtype)
    h = F.grouped_mm(x, w13.transpose(1, 2), offs=offs)
    del w13, x  # the decoded experts' memory serves w2's next
    valid = expert_of < num_experts
    expert_idx = expert_of.clamp(max=num_experts - 1)
    if w13_bias is not None:
        h = h + w13_bias[expert_idx]
    gate, up = h.chunk(2, dim=-1)
    act = activation(gate, up).contiguous()
    del h, gate, up
    if w2_scale is not None:
        w2 = decode_mxfp4(w2, w2_scale, hidden.dtype)
    y = F.grouped_mm(act, w2.transpose(1, 2), offs=offs)
    if w2_bias is not None:
        y = y + w2_bias[expert_idx]
    weights = topk_weights.reshape(-1).float()[order]
    # Rows past the last expert's are not computed (they hold whatever was in memory).
    y = torch.where(valid[:, None], y.float() * weights[:, None], 0.0).to(hidden.dtype)
    rows = torch.empty_like(y)
    rows[order] = y
    return rows.view(num_tokens, top_k, hidden_size).sum(dim=1)


def align_tokens_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, expert) assignments by expert, each expert's group padded to ``block_m``.

    An assignment is a *slot* ``s = t * k + j`` (token ``t``'s ``j``-th expert). Sizes are the
    worst case ``T*k + E*(block_m - 1)`` so nothing is read back to the host.

    Args:
        topk_ids: ``[T, k]`` integer expert ids; -1 for an expert held by another rank
            (expert parallelism): such slots sort after every group, past ``num_padded``.
        num_experts: ``E``.
        block_m: row-tile height of the grouped GEMM.

    Returns:
        ``(sorted_slots, block_experts, num_padded)``: ``sorted_slots [max_padded]`` int32,
        the slots grouped by expert (padding and the unused tail hold ``T*k``, an invalid
        slot); ``block_experts [max_padded / block_m]`` int32, the expert of each row tile
        (``E`` past the used tiles); ``num_padded [1]`` int32, the rows in use.
    """
    flat, counts, order = slots_by_expert(topk_ids, num_experts)
    num_slots = flat.numel()
    device = flat.device
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = counts[num_experts]  # never computed: not padded
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    expert_of = flat[order]
    rank = torch.arange(num_slots, device=device) - count_start[expert_of]
    max_padded = num_slots + num_experts * (block_m - 1)
    max_padded = (max_padded + block_m - 1) // block_m * block_m
    sorted_slots = torch.full((max_padded,), num_slots, dtype=torch.int32, device=device)
    sorted_slots[padded_start[expert_of] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, max_padded, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, tile_starts, right=True).clamp_(max=num_experts)
    used = padded_end[num_experts - 1 : num_experts]
    return sorted_slots, block_experts.to(torch.int32), used.to(torch.int32)


if HAS_TRITON:

    @triton.jit
    def _products_dense(
        a_ptrs, b_ptrs, row_mask, n_mask, K, up_offset,
        GATED: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """``(A @ B_gate^T, A @ B_up^T)`` of one output tile over the whole K, float32;
        ``a_ptrs [BLOCK_M, BLOCK_K]`` and ``b_ptrs [BLOCK_K, BLOCK_N]`` at the first K
        tile, the up rows ``up_offset`` elements past the gate rows (GATED)."""
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b_mask = k_mask[:, None] & n_mask[None, :]
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if GATED:
                b_up = tl.load(b_ptrs + up_offset, mask=b_mask, other=0.0)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        return acc, acc_up

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr, b_ptr, c_ptr, weights_ptr, sorted_slots_ptr, block_experts_ptr, num_padded_ptr,
        bias_ptr, N, K, num_slots, max_padded,
        stride_am, stride_be, stride_bn, stride_cm, stride_bias,
        alpha, limit,
        A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
        HAS_BIAS: tl.constexpr, SWIGLUOAI: tl.constexpr,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        """One ``[BLOCK_M, BLOCK_N]`` output tile of ``C[slot] = A[slot // A_ROW_DIV] @ B[e]^T``.

        ``B`` is ``[E, N(*2 if GATED), K]``; with ``GATED`` the tile also computes the up
        projection (rows ``N + n`` of ``B``) and stores ``act(gate, up)`` (SiLU, or with
        ``SWIGLUOAI`` gpt-oss' clamped form with ``alpha`` and ``limit``). ``HAS_BIAS``: rows of
        ``bias_ptr [E, rows]`` are added before the activation. With ``MUL_WEIGHT`` each
        row is scaled by its slot's routing weight, last.
        """
        pid_m, pid_n = grouped_tile_ids(tl.program_id(0), max_padded, N, BLOCK_M, BLOCK_N,
                                        GROUP_M)  # fmt: skip
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(sorted_slots_ptr + offs_m)
        row_mask = slots < num_slots
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        a_rows = (slots // A_ROW_DIV).to(tl.int64)
        # B tiles are read as [BLOCK_K, BLOCK_N] (the transpose of rows n of expert e).
        b_rows = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
        acc, acc_up = _products_dense(
            a_ptrs, b_rows + offs_k[:, None], row_mask, n_mask, K, N * stride_bn,
            GATED, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        if HAS_BIAS:
            bias_row = bias_ptr + expert * stride_bias + offs_n
            acc += tl.load(bias_row, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(bias_row + N, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc = gated_tile(acc, acc_up, alpha, limit, SWIGLUOAI)
        if MUL_WEIGHT:
            acc = acc * tl.load(weights_ptr + slots, mask=row_mask, other=0.0)[:, None]
        c_ptrs = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def moe_tile_config(num_slots: int, num_experts: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes for the grouped GEMMs, from the average rows per expert.

    Measured on an H200 with Mixtral-8x7B's shapes (``benchmarks/moe_bench.py
    --sweep-tiles``, bf16): 16-row tiles while experts get a few rows each (decode), 32-row
    tiles up to 16 rows per expert, then 128 x 128 tiles with 8 warps (0.87 ms against
    1.28 ms for 32 x 64 tiles at 256 tokens). fp32 (FMA dot products, the interpreter)
    keeps tiles small so the two accumulators of the gated launch fit in registers.
    """
    if dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)
    rows_per_expert = num_slots / max(1, num_experts)
    if rows_per_expert <= 8:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if rows_per_expert <= 16:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def _launch_moe_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_slots: int,
    a_row_div: int,
    gated: bool,
    config: dict[str, int],
    bias: torch.Tensor | None,
    activation: GatedActivation,
) -> None:
    sorted_slots, block_experts, num_padded = aligned
    n = c.shape[1]
    k = a.shape[1]
    max_padded = sorted_slots.numel()
    tiles = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["GROUP_M"]
    grid = (cdiv(max_padded, tiles[0]) * cdiv(n, tiles[1]),)
    bias_arg = bias if bias is not None else c  # an unread stand-in, a fixed dtype
    _moe_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_slots, block_experts, num_padded, bias_arg,
        n, k, num_slots, max_padded,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        bias.stride(0) if bias is not None else 0,
        float(activation.alpha), float(activation.limit),
        A_ROW_DIV=a_row_div,
        GATED=gated,
        MUL_WEIGHT=not gated,
        HAS_BIAS=bias is not None,
        SWIGLUOAI=activation.kind == "swigluoai",
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=tiles[0],
        BLOCK_N=tiles[1],
        BLOCK_K=tiles[2],
        GROUP_M=tiles[3],
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )  # fmt: skip


def fused_experts_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict[str, int] | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: GatedActivation = SILU,
    remote_experts: bool = False,
) -> torch.Tensor:
    """Routed gated experts with the grouped-GEMM Triton kernel (see the module docstring).

    Same arguments and result as ``fused_experts_torch``; all tensors on one device (CUDA,
    or CPU under ``TRITON_INTERPRET=1``), weights contiguous. MXFP4 weights are decoded in
    the kernel, tile by tile.

    Args:
        remote_experts: ``topk_ids`` may hold -1 (expert parallelism): those rows of the
            down projection are never computed and must start at zero.
        config: tile sizes (``moe_tile_config`` keys); chosen by ``moe_tile_config`` if None.

    Raises:
        ValueError: Triton is not installed; MXFP4 weights whose shapes disagree.
    """
    if not HAS_TRITON:
        raise ValueError("the fused MoE kernel needs Triton")
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i = w13.shape[:2]
    hidden_size = w2.shape[1]
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(hidden)
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("MXFP4 experts need scales for both w13 and w2")
    if w13_scale is not None:
        check_mxfp4_shapes(w13, w13_scale)
        check_mxfp4_shapes(w2, w2_scale)
    mxfp4 = w13_scale is not None
    if config is None:
        choose = mxfp4_tile_config if mxfp4 else moe_tile_config
        config = choose(num_slots, num_experts, hidden.dtype)
    if mxfp4 and config["BLOCK_K"] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs BLOCK_K a multiple of {MXFP4_BLOCK}")
    aligned = align_tokens_by_expert(topk_ids, num_experts, config["BLOCK_M"])
    weights = topk_weights.reshape(-1).float().contiguous()
    hidden = hidden.contiguous()
    act = torch.empty(num_slots, two_i // 2, dtype=hidden.dtype, device=hidden.device)
    make = torch.zeros if remote_experts else torch.empty
    down = make(num_slots, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if mxfp4:
        launch_mxfp4_gemm(hidden, w13, w13_scale, act, weights, aligned, num_slots, top_k,
                          True, config, w13_bias, activation)  # fmt: skip
        launch_mxfp4_gemm(act, w2, w2_scale, down, weights, aligned, num_slots, 1, False,
                          config, w2_bias, activation)  # fmt: skip
    else:
        _launch_moe_gemm(hidden, w13, act, weights, aligned, num_slots, top_k, True, config,
                         w13_bias, activation)  # fmt: skip
        _launch_moe_gemm(act, w2, down, weights, aligned, num_slots, 1, False, config,
                         w2_bias, activation)  # fmt: skip
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1)


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    large_batch: str = "auto",
    **experts: object,
) -> torch.Tensor:
    """The Triton kernel on CUDA, the torch loop elsewhere (see ``fused_experts_torch``;
    ``experts``: its keyword arguments, MXFP4 scales, biases, the activation).

    From ``TORCH_MIN_TOKENS`` tokens on, outside CUDA-graph capture, CUDA runs the torch
    loop too: its per-expert cuBLAS GEMMs beat the grouped kernel there (H200, Mixtral
    shapes: 3.07 against 3.26 ms at 2048 tokens, 5.52 against 6.13 ms at 4096). MXFP4
    experts, which the loop decodes one at a time into bfloat16 with a Triton kernel, do
    so from ``MXFP4_TORCH_MIN_TOKENS`` (H100, gpt-oss-20b's experts: the loop 18.3 ms
    against the kernel's 22.3 at 16,384 tokens, 11.6 against 6.5 at 4,096; the lines
    cross near 12,000).

    Args:
        expert_map: expert parallelism: ``[E]`` int32, each global expert id's index in
            ``w13``/``w2`` (this rank's experts), -1 for the experts of other ranks; the
            result then sums this rank's experts only. None: ``topk_ids`` index the weights.
        large_batch: ``KernelConfig.moe_prompt_experts``: ``"grouped_gemm"`` runs
            ``fused_experts_grouped_mm`` instead of the loop, from ``TORCH_MIN_TOKENS``
            tokens for every expert format (where it takes the tensors); ``"auto"`` and
            ``"loop"`` the loop, as above.
    """
    remote = expert_map is not None
    if remote:
        topk_ids = expert_map[topk_ids]
    if HAS_TRITON and hidden.is_cuda:
        mxfp4 = experts.get("w13_scale") is not None
        grouped = (large_batch == "grouped_gemm"
                   and grouped_mm_supported(hidden, w13, w2, mxfp4)
                   and torch.cuda.get_device_capability(hidden.device) >= (8, 0))
        threshold = MXFP4_TORCH_MIN_TOKENS if mxfp4 and not grouped else TORCH_MIN_TOKENS
        if hidden.shape[0] < threshold or torch.cuda.is_current_stream_capturing():
            return fused_experts_triton(
                hidden, w13, w2, topk_weights, topk_ids, remote_experts=remote, **experts
            )
        if grouped:
            return fused_experts_grouped_mm(hidden, w13, w2, topk_weights, topk_ids, **experts)
    return fused_experts_torch(hidden, w13, w2, topk_weights, topk_ids, **experts)

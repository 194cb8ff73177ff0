"""The batched LoRA products (``kernels/lora/sgmv.py``) against the per-row reference: the
Triton kernels under the interpreter on CPU and the torch CPU path, on mixed batches of
prompt segments and decode rows with several adapters and rows without one."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.device import HAS_TRITON
from tokenmill.kernels.lora.sgmv import (
    MAX_SHRINK_CHUNKS,
    SHRINK_BLOCK_K,
    lora_expand_torch,
    lora_expand_triton,
    lora_reference,
    lora_shrink_torch,
    lora_shrink_triton,
    lora_torch,
    lora_triton,
    shrink_split,
)


def _case(num_tokens: int, k: int, n: int, num_slots: int, rank: int, seed: int, segments: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g)
    a = torch.randn(num_slots, rank, k, generator=g) / k**0.5
    b = torch.randn(num_slots, rank, n, generator=g)
    a[0] = b[0] = 0  # slot 0: no adapter
    if segments:  # one request's prompt per run of rows, as a mixed prefill/decode batch
        lengths = [1, 1, 1, 9, 17, 1, num_tokens - 30]
        slots = torch.cat([
            torch.full((m,), int(torch.randint(0, num_slots, (1,), generator=g)))
            for m in lengths
        ])  # fmt: skip
    else:  # decode rows, each its own adapter
        slots = torch.randint(0, num_slots, (num_tokens,), generator=g)
    y = torch.randn(num_tokens, n, generator=g)
    return y, x, a, b, slots.to(torch.int32)


CASES = [
    # tokens, K, N, slots, rank (a merged layer's parts x the slot rank)
    (40, 96, 80, 4, 24, True),
    (13, 64, 48, 3, 16, False),
    (70, 40, 130, 5, 8, True),
    (20, 32, 40, 3, 200, False),  # stacked rank above one 64-rank tile
    (9, 300, 24, 3, 16, False),  # K in five split-K chunks, the last one partial
    (50, 2200, 40, 9, 16, False),  # eight adapters in one tile; K at the chunk cap
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES)
def test_lora_products_match_per_row_reference(case, impl):
    if impl == "triton" and not HAS_TRITON:
        pytest.skip("Triton is not installed")
    y, x, a, b, slots = _case(*case[:5], seed=sum(case[:5]), segments=case[5])
    want = y.clone()
    lora_reference(want, x, a, b, slots)
    got = y.clone()
    (lora_torch if impl == "torch" else lora_triton)(got, x, a, b, slots)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # Rows without an adapter are left exactly as they were.
    none = slots == 0
    assert torch.equal(got[none], y[none])


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("part_sizes", [(128, 64, 64), (192, 64)])
def test_merged_parts_expand_only_their_rank_block(part_sizes):
    """A merged layer (q/k/v, gate/up): B is zero outside each part's rank block and column
    range, and the expand that reads one block per column tile matches the reference."""
    rank = 8
    n = sum(part_sizes)
    y, x, a, b, slots = _case(37, 160, n, 4, rank * len(part_sizes), seed=5, segments=True)
    mask = torch.zeros(rank * len(part_sizes), n)
    start = 0
    for i, size in enumerate(part_sizes):
        mask[i * rank : (i + 1) * rank, start : start + size] = 1
        start += size
    b = b * mask
    want = y.clone()
    lora_reference(want, x, a, b, slots)
    got = y.clone()
    starts = tuple(sum(part_sizes[: i + 1]) for i in range(len(part_sizes) - 1))
    lora_triton(got, x, a, b, slots, starts)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES[:4])
def test_shrink_and_expand_apart_match_the_reference(case, impl):
    """The shrink alone gives each row's ``x A[s]^T`` (float32, zero for rows without an
    adapter); the expand alone adds ``t B[s]`` into a column slice of a wider output (as
    tensor-parallel layers use them, with a collective in between)."""
    if impl == "triton" and not HAS_TRITON:
        pytest.skip("Triton is not installed")
    shrink, expand = {
        "torch": (lora_shrink_torch, lora_expand_torch),
        "triton": (lora_shrink_triton, lora_expand_triton),
    }[impl]
    y, x, a, b, slots = _case(*case[:5], seed=sum(case[:5]) + 1, segments=case[5])
    t = shrink(x, a, slots)
    assert t.dtype == torch.float32 and t.shape == (x.shape[0], a.shape[1])
    want_t = torch.stack([x[i] @ a[s].T if s else torch.zeros(a.shape[1])
                          for i, s in enumerate(slots.tolist())])  # fmt: skip
    torch.testing.assert_close(t, want_t, atol=1e-4, rtol=1e-4)
    wide = torch.randn(y.shape[0], y.shape[1] + 24)
    want = wide.clone()
    lora_reference(want[:, 8 : 8 + y.shape[1]], x, a, b, slots)
    got = wide.clone()
    expand(got[:, 8 : 8 + y.shape[1]], t, b, slots)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_shrink_split_fills_the_device():
    """Split-K chunks: a decode batch's one tile over K = 4,096 gets many chunks, each a
    whole number of K blocks covering K; a prompt-sized step of many tiles gets one."""
    chunks, size = shrink_split(1, 4096, 132)
    assert chunks == MAX_SHRINK_CHUNKS  # the cap (a decode tile would fill 264 programs)
    assert size % SHRINK_BLOCK_K == 0 and (chunks - 1) * size < 4096
    assert shrink_split(33, 4096, 132) == (8, 512)  # two waves: 33 tiles x 8 chunks
    assert shrink_split(300, 4096, 132) == (1, 4096)
    assert shrink_split(1, 40, 132) == (1, SHRINK_BLOCK_K)


def test_no_adapter_rows_cost_nothing():
    """A batch without adapters leaves the output untouched (every tile skips its work)."""
    y, x, a, b, _ = _case(20, 32, 32, 2, 16, seed=3, segments=False)
    slots = torch.zeros(20, dtype=torch.int32)
    for impl in (lora_torch, lora_triton) if HAS_TRITON else (lora_torch,):
        got = y.clone()
        impl(got, x, a, b, slots)
        assert torch.equal(got, y)

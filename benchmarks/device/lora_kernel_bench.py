"""The batched LoRA products (``kernels/lora/sgmv.py``) at Llama-3.1-8B's shapes on one GPU.

    python3 benchmarks/device/lora_kernel_bench.py [--rows 1,16,64,256,1024] [--adapters 8]
        [--rank 16]

For each layer product (q/k/v, output, gate/up, down) and row count: the time of one
``lora_triton`` call (shrink; expand adding the chunks) with ``--adapters`` adapters of ``--rank``
per part spread over the rows at random (one adapter for every row at 1,024: a prompt),
beside the base bf16 product ``x @ W^T`` of the same shape (cuBLAS), and the same LoRA call
with the shrink in one K chunk (``unsplit``) and in at most 16 (``cap16``). Each figure is
the median of CUDA-graph replays of 20 calls. Lines start with ``LORAK``; the last lines give
the sum over one layer and over the 32 layers of a decode step.
"""

from __future__ import annotations

import argparse

import torch

from tokenmill.benchmarks.cuda_timing import graph_replay_ms
from tokenmill.kernels.lora import sgmv

SHAPES = {  # name: (K, part output features)
    "qkv": (4096, (4096, 1024, 1024)),
    "o_proj": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}


def _graph_us(fn, calls: int = 20, reps: int = 15) -> float:
    """µs per call of ``fn``, ``calls`` of them in one CUDA graph (median of ``reps``)."""
    return graph_replay_ms(lambda: [fn() for _ in range(calls)], reps) * 1000 / calls


def _capped(cap: int):
    """``shrink_split`` with at most ``cap`` K chunks."""
    split = sgmv.shrink_split

    def capped(tiles: int, k: int, sms: int) -> tuple[int, int]:
        chunks, size = split(tiles, k, sms)
        if chunks <= cap:
            return chunks, size
        size = -(-k // cap)
        size = -(-size // sgmv.SHRINK_BLOCK_K) * sgmv.SHRINK_BLOCK_K
        return -(-k // size), size

    return capped


def _measure(
    slots: torch.Tensor, k: int, parts: tuple[int, ...], rank: int, g: torch.Generator
) -> tuple[float, float, float, float]:
    """``(base, lora, unsplit, capped at 16 chunks)`` µs of one product for the rows of
    ``slots``."""
    dev, dt = slots.device, torch.bfloat16
    rows, slots_n = slots.shape[0], int(slots.max()) + 1
    n, r = sum(parts), rank * len(parts)
    x = torch.randn(rows, k, generator=g, device=dev).to(dt)
    w = torch.randn(n, k, generator=g, device=dev).to(dt)
    a = torch.randn(slots_n, r, k, generator=g, device=dev).to(dt) / k**0.5
    b = torch.randn(slots_n, r, n, generator=g, device=dev).to(dt)
    y = torch.zeros(rows, n, device=dev, dtype=dt)
    starts = tuple(sum(parts[: i + 1]) for i in range(len(parts) - 1))
    base = _graph_us(lambda: torch.matmul(x, w.T, out=y))
    lora = _graph_us(lambda: sgmv.lora_triton(y, x, a, b, slots, starts))
    split = sgmv.shrink_split
    try:
        sgmv.shrink_split = lambda tiles, kk, sms: (1, kk)
        unsplit = _graph_us(lambda: sgmv.lora_triton(y, x, a, b, slots, starts))
        sgmv.shrink_split = _capped(16)
        cap16 = _graph_us(lambda: sgmv.lora_triton(y, x, a, b, slots, starts))
    finally:
        sgmv.shrink_split = split
    return base, lora, unsplit, cap16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,256,1024")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    slots_n = args.adapters + 1
    totals: dict[tuple[int, str], float] = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        if rows >= 1024:
            slots = torch.ones(rows, dtype=torch.int32, device=dev)
        else:
            slots = torch.randint(1, slots_n, (rows,), generator=g, device=dev).to(torch.int32)
        for name, (k, parts) in SHAPES.items():
            base, lora, unsplit, cap16 = _measure(slots, k, parts, args.rank, g)
            for key, us in (("base", base), ("lora", lora), ("unsplit", unsplit),
                            ("cap16", cap16)):
                totals[(rows, key)] = totals.get((rows, key), 0.0) + us
            print(
                f"LORAK rows={rows} {name}: base {base:.1f} us, lora {lora:.1f} us "
                f"({lora / base:.2f} of base), unsplit {unsplit:.1f} us, cap16 {cap16:.1f} us",
                flush=True,
            )
    for rows in sorted({r for r, _ in totals}):
        base, lora, unsplit, cap16 = (
            totals[(rows, key)] for key in ("base", "lora", "unsplit", "cap16"))
        print(
            f"LORAK rows={rows} layer: base {base:.1f} us, lora {lora:.1f} us "
            f"({lora / base:.2f}), unsplit {unsplit:.1f} us, cap16 {cap16:.1f} us; 32 layers: "
            f"lora {32 * lora / 1000:.2f} ms, unsplit {32 * unsplit / 1000:.2f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()

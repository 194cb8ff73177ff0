"""The batched LoRA products (``kernels/lora/sgmv.py``) at Llama-3.1-8B's shapes on one GPU.

    python3 benchmarks/device/lora_kernel_bench.py [--rows 1,16,64,256,1024] [--adapters 8]
        [--rank 16]

For each layer product (q/k/v, output, gate/up, down) and row count: the time of one
``lora_triton`` call (shrink; expand adding the chunks) with ``--adapters`` adapters of ``--rank``
per part spread over the rows at random (one adapter for every row at 1,024: a prompt),
beside the base bf16 product ``x @ W^T`` of the same shape (cuBLAS), and the same LoRA call
with the shrink's K chunks capped at 8, 32 and 64 (``capN``; the default is
``MAX_SHRINK_CHUNKS``). Each figure is the median of CUDA-graph replays of 20 calls. Lines
start with ``LORAK``; the last lines give the sum over one layer and over the 32 layers of
a decode step.
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


CAPS = (8, 32, 64)  # the shrink's chunk caps timed beside the default (MAX_SHRINK_CHUNKS)


def _measure(
    slots: torch.Tensor, slots_n: int, k: int, parts: tuple[int, ...], rank: int,
    g: torch.Generator,
) -> dict[str, float]:  # fmt: skip
    """µs of one product for the rows of ``slots`` with ``slots_n`` slots on the GPU (as
    the engine's ``--max-loras`` + 1): ``base`` (cuBLAS), ``lora`` (the default chunk cap)
    and ``capN`` for each of ``CAPS``."""
    dev, dt = slots.device, torch.bfloat16
    rows = slots.shape[0]
    n, r = sum(parts), rank * len(parts)
    x = torch.randn(rows, k, generator=g, device=dev).to(dt)
    w = torch.randn(n, k, generator=g, device=dev).to(dt)
    a = torch.randn(slots_n, r, k, generator=g, device=dev).to(dt) / k**0.5
    b = torch.randn(slots_n, r, n, generator=g, device=dev).to(dt)
    y = torch.zeros(rows, n, device=dev, dtype=dt)
    starts = tuple(sum(parts[: i + 1]) for i in range(len(parts) - 1))
    out = {
        "base": _graph_us(lambda: torch.matmul(x, w.T, out=y)),
        "lora": _graph_us(lambda: sgmv.lora_triton(y, x, a, b, slots, starts)),
    }
    default = sgmv.MAX_SHRINK_CHUNKS
    try:
        for cap in CAPS:
            sgmv.MAX_SHRINK_CHUNKS = cap
            out[f"cap{cap}"] = _graph_us(lambda: sgmv.lora_triton(y, x, a, b, slots, starts))
    finally:
        sgmv.MAX_SHRINK_CHUNKS = default
    return out


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
    keys = ["base", "lora"] + [f"cap{c}" for c in CAPS]
    for rows in [int(r) for r in args.rows.split(",")]:
        if rows >= 1024:
            slots = torch.ones(rows, dtype=torch.int32, device=dev)
        else:
            slots = torch.randint(1, slots_n, (rows,), generator=g, device=dev).to(torch.int32)
        for name, (k, parts) in SHAPES.items():
            us = _measure(slots, slots_n, k, parts, args.rank, g)
            for key in keys:
                totals[(rows, key)] = totals.get((rows, key), 0.0) + us[key]
            caps = ", ".join(f"{key} {us[key]:.1f} us" for key in keys[2:])
            print(
                f"LORAK rows={rows} {name}: base {us['base']:.1f} us, lora {us['lora']:.1f} us "
                f"({us['lora'] / us['base']:.2f} of base), {caps}",
                flush=True,
            )
    for rows in sorted({r for r, _ in totals}):
        t = {key: totals[(rows, key)] for key in keys}
        caps = ", ".join(f"{key} {t[key]:.1f} us" for key in keys[2:])
        print(
            f"LORAK rows={rows} layer: base {t['base']:.1f} us, lora {t['lora']:.1f} us "
            f"({t['lora'] / t['base']:.2f}), {caps}; 32 layers: lora "
            f"{32 * t['lora'] / 1000:.2f} ms over base {32 * t['base'] / 1000:.2f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()

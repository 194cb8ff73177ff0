#!/usr/bin/env python3
"""The MLA decode kernel (``kernels/attention/mla_decode.py``) at DeepSeek-V3's dimensions on
CUDA: time per call and the latent cache's read bandwidth, per decode batch and context, with
the engine's tiles and split counts or a sweep of other tiles (``--sweep``).

    python3 benchmarks/mla_bench.py [--batches 1,8,64,256] [--contexts 1024,4096] [--sweep]

Prints ``MLA B=.. ctx=.. tiles=..: <us> us, <GB/s> GB/s of latents`` lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import torch

from tokenmill.benchmarks.cuda_timing import graph_replay_ms
from tokenmill.kernels.attention.mla_decode import MLADecodeTiles, mla_decode, mla_decode_tiles

HEADS, RANK, ROPE, BLOCK = 128, 512, 64, 16


def _problem(batch: int, context: int):
    blocks = -(-context // BLOCK)
    cache = torch.randn(batch * blocks + 1, BLOCK, RANK + ROPE, device="cuda",
                        dtype=torch.bfloat16)  # fmt: skip
    table = torch.randperm(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q_lat = torch.randn(HEADS, batch, RANK, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, HEADS, ROPE, device="cuda", dtype=torch.bfloat16)
    return q_lat, q_pe, cache, table, lens


def _time(fn, iters: int = 10, calls: int = 20) -> float:
    """µs per call of ``fn``, ``calls`` of them in one CUDA graph (median of ``iters``)."""
    return graph_replay_ms(lambda: [fn() for _ in range(calls)], iters) * 1000.0 / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--contexts", default="1024,1280,4096")
    p.add_argument("--sweep", action="store_true", help="also time other tiles")
    args = p.parse_args()
    default = mla_decode_tiles(torch.bfloat16)
    tiles = [default, dataclasses.replace(default, heads_major=not default.heads_major)]
    if args.sweep:
        tiles += [
            MLADecodeTiles(h, n, w, s)
            for h, n, w, s in itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (1, 2, 3))
            if MLADecodeTiles(h, n, w, s) != default
        ]
    for batch, context in itertools.product(
        map(int, args.batches.split(",")), map(int, args.contexts.split(","))
    ):
        problem = _problem(batch, context)
        read = batch * context * (RANK + ROPE) * 2
        for t in tiles:
            try:
                us = _time(functools.partial(mla_decode, *problem, 0.07, context, tiles=t))
            except Exception as e:  # out of shared memory or registers for this tile
                print(f"MLA B={batch} ctx={context} tiles={t}: failed ({type(e).__name__})")
                continue
            order = "heads" if t.heads_major else "requests"
            print(f"MLA B={batch} ctx={context} tiles={t.block_h}x{t.block_n} w{t.num_warps} "
                  f"s{t.num_stages} {order}-major: {us:.1f} us, "
                  f"{read / us / 1e3:.0f} GB/s of latents",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

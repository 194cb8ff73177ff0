#!/usr/bin/env python3
"""The int4 GEMM kernels at Llama-3.1-8B's linear shapes on one GPU: the GEMV path, the
tensor-core path and (from 64 rows) the dequantize-then-cuBLAS path of
``tokenmill.kernels.gemm.int4`` against cuBLAS on the same shape in bf16, with each result
checked against the dequantized product.

usage: int4_kernel_bench.py [--ms 1,2,4,16,256,1024,4096] [--group 128] [--sweep]
                           [--tc-sweep] [--chunks 8,16,24]

--sweep also times the GEMV kernel under other tiles (BLOCK_N, packed words per K step,
programs per SM, warps) at M = 1 and 4 and prints the
fastest per (shape, M) as an ``INT4BEST`` line. --tc-sweep times the tensor-core kernel from
M = 2 under other tiles and prints the fastest per (shape, M), the dequantize-then-cuBLAS
path included, as an ``INT4TCBEST`` line. --chunks also times, from 64 rows, the
dequantize-then-cuBLAS path a slab at a time through an L2-sized scratch buffer of each
listed size (MiB), slabs of output columns and of input channels.

Prints one ``INT4`` line per (shape, M, path): microseconds per product (CUDA-graph replays,
median) and the weight bytes read per microsecond (GB/s: packed words, scales and zeros).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from prefill_gemm_bench import time_graph  # this folder: the scripts run by path

from tokenmill.kernels.device import num_sms
from tokenmill.kernels.gemm import int4 as k4
from tokenmill.kernels.quant.int4_pack import pack_k

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def time_us(fn, reps: int = 50) -> float:
    """Median of ``reps`` replays of a CUDA graph of 10 calls, per call."""

    def ten_calls() -> int:
        for _ in range(10):
            fn()
        return 10

    return time_graph(ten_calls, replays=reps) * 1e6


def sweep_configs(m: int, n: int, k: int, g: int, sms: int) -> dict[str, dict]:
    """GEMV tile variants around ``gemv_config``'s choice."""
    base = k4.gemv_config(m, n, k, g, sms)
    out = {}
    for bn in (64, 128, 256):
        for kw in (8, 16):
            if g % (8 * kw) or bn * 8 * kw * base["BLOCK_M"] > 32768:
                continue
            for per_sm in (2, 4):
                tiles = -(-n // bn)
                split = max(1, min(-(-per_sm * sms // tiles), -(-k // (8 * kw))))
                for warps in (4, 8):
                    cfg = dict(base, BLOCK_N=bn, BLOCK_KW=kw, SPLIT_K=split, num_warps=warps)
                    out[f"sweep_n{bn}_kw{kw}_s{per_sm}_w{warps}"] = cfg
    return out


# Tensor-core tiles: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); the decode ones up to 32 rows.
TC_DECODE_TILES = [(16, 64, 128, 4, 3), (16, 128, 128, 4, 3), (32, 64, 128, 4, 3),
                   (32, 128, 64, 4, 3)]
TC_TILES = [(64, 128, 128, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4)]
# From 256 rows also tiles whose weight tile serves 256 rows (each weight unpacked half as
# often) or whose row tile serves 256 columns: where one beats the dequantized weight with
# cuBLAS, the in-loop kernel takes those rows.
TC_WIDE_TILES = [(256, 64, 64, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 3)]

def tc_sweep_configs(m: int, n: int, k: int, g: int, sms: int) -> dict[str, dict]:
    """Tensor-core tile variants, K split until the grid covers the SMs once (at least four
    K steps per split)."""
    out = {}
    tiles = TC_DECODE_TILES if m <= 32 else TC_TILES + (TC_WIDE_TILES if m >= 256 else [])
    for bm, bn, bk, warps, stages in tiles:
        if g % bk:
            continue
        n_tiles = -(-m // bm) * -(-n // bn)
        split = max(1, min(-(-sms // n_tiles), -(-k // (4 * bk))))
        out[f"tc_m{bm}_n{bn}_k{bk}_w{warps}_s{stages}"] = dict(
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps,
            num_stages=stages)
    return out


def chunk_configs(n: int, k: int, g: int, mbs: str) -> dict[str, dict]:
    """Dequantize-then-cuBLAS a slab at a time through one scratch buffer of about ``mb``
    MiB (kept in the L2 cache): slabs of output columns (multiples of 128) or of input
    channels (multiples of the group)."""
    out = {}
    for mb in (int(v) for v in mbs.split(",")):
        cols = max(128, (mb << 20) // (2 * k) // 128 * 128)
        rows = max(g, (mb << 20) // (2 * n) // g * g)
        out[f"chunk_n{cols}_{mb}mb"] = {"DEQUANT": 1, "CHUNK_N": cols}
        out[f"chunk_k{rows}_{mb}mb"] = {"DEQUANT": 1, "CHUNK_K": rows}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,16,256,1024,4096")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tc-sweep", action="store_true")
    ap.add_argument("--chunks", default="", help="scratch MiB list for the slab variants")
    a = ap.parse_args()
    dev = torch.device("cuda")
    sms = num_sms(dev)
    for name, (n, k) in SHAPES.items():
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=dev)
        g = a.group
        scales = (torch.rand(k // g, n, device=dev) * 0.01).to(torch.bfloat16)
        zeros = torch.randint(0, 16, (k // g, n), dtype=torch.uint8, device=dev)
        qw = pack_k(q)
        w_t = ((q.float().t() - zeros.float().repeat_interleave(g, 0))
               * scales.float().repeat_interleave(g, 0))
        w_bf16 = w_t.t().contiguous().to(torch.bfloat16)
        nbytes = qw.numel() * 4 + scales.numel() * 2 + zeros.numel()
        for m in (int(v) for v in a.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ w_t
            paths = {"tensor_core": k4.launch_config(m, n, k, x.dtype, sms)}
            gemv = k4.gemv_config(m, n, k, g, sms) if m <= k4.GEMV_MAX_M else None
            if gemv:
                paths["gemv"] = gemv
            if m >= 64:
                paths["dequant_cublas"] = {"DEQUANT": 1}
                if a.chunks:
                    paths.update(chunk_configs(n, k, g, a.chunks))
            if gemv and a.sweep and m in (1, 4):
                paths.update(sweep_configs(m, n, k, g, sms))
            if a.tc_sweep and m > 1:
                paths.update(tc_sweep_configs(m, n, k, g, sms))
            timed = {}
            for path, cfg in paths.items():
                try:
                    y = k4.int4_linear(x, qw, scales, zeros, g, cfg)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    us = time_us(partial(k4.int4_linear, x, qw, scales, zeros, g, cfg))
                except Exception as e:  # a tile Triton cannot compile: report, go on
                    print(f"INT4 {name} m={m} path={path} FAILED {type(e).__name__}: "
                          f"{str(e)[:200]}", flush=True)
                    continue
                timed[path] = (us, cfg)
                if path.startswith(("sweep", "tc_")) and err > 2e-2:
                    print(f"INT4 {name} m={m} path={path} WRONG rel_err={err:.2e}", flush=True)
                    continue
                print(f"INT4 {name} m={m} path={path} us={us:.1f} GB/s={nbytes / us / 1e3:.0f} "
                      f"rel_err={err:.2e} cfg={cfg}", flush=True)
            if a.sweep and gemv and m in (1, 4):
                best = min(timed.items(), key=lambda kv: kv[1][0])
                print(f"INT4BEST {name} m={m} {best[0]} us={best[1][0]:.1f} cfg={best[1][1]}",
                      flush=True)
            if (a.tc_sweep or a.chunks) and m > 1:
                best = min(timed.items(), key=lambda kv: kv[1][0])
                print(f"INT4TCBEST {name} m={m} {best[0]} us={best[1][0]:.1f} "
                      f"default={timed['tensor_core'][0]:.1f} cfg={best[1][1]}", flush=True)
            us = time_us(partial(torch.matmul, x, w_bf16.t()))
            print(f"INT4 {name} m={m} path=cublas_bf16 us={us:.1f} "
                  f"GB/s={w_bf16.numel() * 2 / us / 1e3:.0f}", flush=True)


if __name__ == "__main__":
    main()

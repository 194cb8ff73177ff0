#!/usr/bin/env python3
"""The GGUF K-quant products at Llama-3.1-8B's linear shapes on one GPU: the Q4_K/Q6_K GEMV
of ``tokenmill.kernels.gemm.gguf_kquant`` (its default tiles and, at one row, a sweep around
them), its tensor-core kernel (and, at 16 rows, a sweep of its tiles) and (from 64 rows)
dequantize-then-cuBLAS, against cuBLAS on the same shape in bf16, each result checked
against the dequantized product; and for Q4_0 and Q8_0 the 32-weight-block GEMV of
``gguf_q32`` at one row beside dequantize-then-cuBLAS.

usage: gguf_kernel_bench.py [--ms 1,4,8,16,64,256] [--no-sweep]

Prints one ``GGUFK`` line per (type, shape, M, path): microseconds per product (CUDA-graph
replays, median) and the block bytes read per microsecond (GB/s); ``GGUFBEST`` the fastest
GEMV tiles per (type, shape, M).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from int4_kernel_bench import SHAPES, time_us  # this folder: the scripts run by path

from tokenmill.kernels.device import num_sms
from tokenmill.kernels.gemm import gguf as kg
from tokenmill.kernels.gemm import gguf_kquant as kv
from tokenmill.kernels.gemm import gguf_q32 as kq32
from tokenmill.kernels.quant.gguf_blocks import block_info, dequantize

TYPES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q4_0": 2, "Q8_0": 8}
FP16_FIELDS = {12: (0, 2), 13: (0, 2), 14: (208,), 2: (0,), 8: (0,)}


def random_blocks(qtype: int, n: int, k: int) -> torch.Tensor:
    """``[n, row_bytes]`` uint8 on the GPU: random bits, fp16 scale fields small and finite."""
    _name, qk, size, _group = block_info(qtype)
    raw = torch.randint(0, 256, (n, k // qk, size), dtype=torch.uint8, device="cuda")
    for off in FP16_FIELDS[qtype]:
        vals = (torch.randn(n, k // qk, device="cuda") * 0.01).to(torch.float16)
        raw[..., off:off + 2] = vals.view(torch.uint8).view(n, k // qk, 2)
    return raw.view(n, -1)


def sweep(m: int, n: int, k: int, sms: int, qtype: int) -> dict[str, dict]:
    base = kv.gemv_config(m, n, k, sms, qtype)
    out = {}
    for bn in (4, 8, 16):
        for sb in (2, 4, 8):
            for per_sm in (1, 2, 4):
                programs = -(-n // bn) * m
                split = max(1, min(-(-per_sm * sms // programs), -(-(k // 256) // sb)))
                for warps in (2, 4):
                    out[f"sweep_n{bn}_sb{sb}_s{per_sm}_w{warps}"] = dict(
                        base, BLOCK_N=bn, SB=sb, SPLIT_K=split, num_warps=warps)
    return out


def mm_sweep(m: int, n: int, k: int, sms: int, qtype: int) -> dict[str, dict]:
    base = kv.mm_config(m, n, k, torch.bfloat16, sms, qtype)
    out = {}
    for bn in (32, 64, 128):
        for warps in (4, 8):
            for stages in (1, 3):
                tiles = -(-m // base["BLOCK_M"]) * -(-n // bn)
                split = max(1, min(-(-2 * sms // tiles), k // 256))
                out[f"mmsweep_n{bn}_w{warps}_st{stages}"] = dict(
                    base, BLOCK_N=bn, SPLIT_K=split, num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,8,16,64,256")
    ap.add_argument("--no-sweep", action="store_true")
    a = ap.parse_args()
    sms = num_sms(torch.device("cuda"))
    for tname, qtype in TYPES.items():
        for name, (n, k) in SHAPES.items():
            raw = random_blocks(qtype, n, k)
            w = dequantize(raw, qtype)
            w_bf16 = w.to(torch.bfloat16)
            nbytes = raw.numel()
            for m in (int(v) for v in a.ms.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ w.t()
                if qtype in kq32.Q32_TYPES:  # one-row GEMV, else dequantize first
                    paths = {"q32gemv": kq32.q32_gemv_config(n, k, sms)} if m == 1 else {}
                    paths["dequant_cublas"] = {}
                else:
                    paths = {"mm": kv.mm_config(m, n, k, x.dtype, sms, qtype)}
                    if m <= 4:
                        paths["gemv"] = kv.gemv_config(m, n, k, sms, qtype)
                    if m >= 64:
                        paths["dequant_cublas"] = {}
                    if not a.no_sweep and m == 1:
                        paths.update(sweep(m, n, k, sms, qtype))
                    if not a.no_sweep and m == 16:
                        paths.update(mm_sweep(m, n, k, sms, qtype))
                timed = {}
                for path, cfg in paths.items():
                    if path == "dequant_cublas":
                        fn = partial(kg.gguf_linear, x, raw, qtype, True)
                    elif path.startswith("mm"):
                        fn = partial(kv.kquant_mm, x, raw, qtype, cfg)
                    elif path == "q32gemv":
                        fn = partial(kq32.q32_gemv, x, raw, qtype, cfg)
                    else:
                        fn = partial(kv.gguf_gemv, x, raw, qtype, cfg)
                    y = fn()
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    if err > 2e-2:
                        print(f"GGUFK {tname} {name} m={m} path={path} WRONG rel_err={err:.2e}",
                              flush=True)
                        continue
                    us = time_us(fn)
                    timed[path] = (us, cfg)
                    # Every variant, the sweep's too: the stage's log keeps them all.
                    print(f"GGUFK {tname} {name} m={m} path={path} us={us:.1f} "
                          f"GB/s={nbytes / us / 1e3:.0f} rel_err={err:.2e} cfg={cfg}",
                          flush=True)
                for kind in ("gemv", "mm"):
                    group = {p: v for p, v in timed.items()
                             if p == kind or p.startswith(f"{kind}sweep") or (
                                 kind == "gemv" and p.startswith("sweep"))}
                    if len(group) > 1:
                        best = min(group.items(), key=lambda kv_: kv_[1][0])
                        print(f"GGUFBEST {tname} {name} m={m} {best[0]} us={best[1][0]:.1f} "
                              f"GB/s={nbytes / best[1][0] / 1e3:.0f} cfg={best[1][1]}",
                              flush=True)
                us = time_us(partial(torch.matmul, x, w_bf16.t()))
                print(f"GGUFK {tname} {name} m={m} path=cublas_bf16 us={us:.1f} "
                      f"GB/s={w_bf16.numel() * 2 / us / 1e3:.0f}", flush=True)
            del raw, w, w_bf16
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

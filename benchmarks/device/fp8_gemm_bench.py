"""FP8 products at Llama-3.1-8B's shapes on one GPU, each timed inside a CUDA graph
(``triton.testing.do_bench_cudagraph``, median µs):

- decode rows (M <= 32): bf16 ``F.linear`` (cuBLAS), the skinny GEMM with FP8 weights
  (W8A16), the older W8A16 Triton kernel ``fp8_weight_gemm``, and per-token W8A8
  (``quantize_rows`` + ``torch._scaled_mm``); with the fraction of the FP8 weight-read
  floor at the card's peak bandwidth;
- prefill rows: the per-token activation quantization in torch ops against ``quantize_rows``
  (one launch), each followed by ``torch._scaled_mm``.

usage: fp8_gemm_bench.py [--ms 1,4,16,32] [--prefill-ms 256,2048,8192]
Prints one ``FP8GEMM`` line per shape and row count.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from tokenmill.kernels.gemm import fp8 as g
from tokenmill.kernels.gemm.skinny import skinny_linear
from tokenmill.kernels.quant import fp8 as q8

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def _peak_bytes_per_s() -> float:
    name = torch.cuda.get_device_name()
    return 4.8e12 if "H200" in name else 3.35e12


def _us(fn, *args, **kwargs) -> float:
    return do_bench_cudagraph(lambda: fn(*args, **kwargs), rep=200) * 1000


def _w8a8(x, q, s_row):
    return g.scaled_mm_rowwise(*g.quantize_rows(x), q, s_row, torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="1,4,16,32")
    p.add_argument("--prefill-ms", default="256,2048,8192")
    a = p.parse_args()
    dev = "cuda"
    print(f"FP8GEMM gpu={torch.cuda.get_device_name()}", flush=True)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev) * 0.02
        wb = w.to(torch.bfloat16)
        q, s = q8.quantize_per_channel(w)
        s_row = s.view(1, -1)
        floor = n * k / _peak_bytes_per_s() * 1e6
        for m in map(int, a.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t_bf16 = _us(F.linear, x, wb)
            t_skinny = _us(skinny_linear, x, q, weight_scale=s)
            t_old = _us(g.fp8_weight_gemm, x, q, s)
            t_w8a8 = _us(_w8a8, x, q, s_row)
            gated = ""
            if name == "gate_up":
                t_gated = _us(skinny_linear, x, q, gated=True, weight_scale=s)
                gated = f" skinny_fp8_gated={t_gated:.1f}"
            print(f"FP8GEMM {name} m={m} bf16_cublas={t_bf16:.1f} skinny_fp8={t_skinny:.1f}"
                  f"{gated} fp8_weight_gemm={t_old:.1f} w8a8_scaled_mm={t_w8a8:.1f} "
                  f"floor_us={floor:.1f} skinny_floor_fraction={floor / t_skinny:.2f}",
                  flush=True)
        for m in map(int, a.prefill_ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t_q_torch = _us(q8.quantize_per_token, x)
            t_q_one = _us(g.quantize_rows, x)
            t_mm = _us(_w8a8, x, q, s_row)
            t_bf16 = _us(F.linear, x, wb)
            print(f"FP8GEMM {name} m={m} quant_torch_ops={t_q_torch:.1f} "
                  f"quantize_rows={t_q_one:.1f} w8a8_total={t_mm:.1f} bf16_cublas={t_bf16:.1f}",
                  flush=True)


if __name__ == "__main__":
    main()

"""FP8 products at Llama-3.1-8B's shapes on one GPU, each timed inside a CUDA graph
(``triton.testing.do_bench_cudagraph``, median µs):

- decode rows (M <= 32): bf16 ``F.linear`` (cuBLAS), the skinny GEMM with FP8 weights
  (W8A16), the older W8A16 Triton kernel ``fp8_weight_gemm``, and per-token W8A8
  (``quantize_rows`` + ``torch._scaled_mm``); with the fraction of the FP8 weight-read
  floor at the card's peak bandwidth;
- prefill rows: the per-token activation quantization in torch ops against ``quantize_rows``
  (one launch), each followed by ``torch._scaled_mm``.

usage: fp8_gemm_bench.py [--shapes qkv,o_proj,gate_up,down] [--ms 1,4,16,32]
                         [--prefill-ms 256,2048,8192] [--sweep]
Prints one ``FP8GEMM`` line per shape and row count.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from tokenmill.kernels.gemm import fp8 as g
from tokenmill.kernels.gemm.skinny import SkinnyConfig, skinny_linear
from tokenmill.kernels.quant import fp8 as q8

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def _peak_bytes_per_s() -> float:
    name = torch.cuda.get_device_name()
    return 4.8e12 if "H200" in name else 3.35e12


def _us(fn, *args, **kwargs) -> float:
    return do_bench_cudagraph(lambda: fn(*args, **kwargs), rep=200) * 1000


class Rotating:
    """Copies of a weight (and its scales) used in turn, enough that their bytes are twice
    the largest L2 (50 MiB on H100/H200): each timed call streams its weight from HBM as in
    a model's forward pass, where every layer has its own. ``next()`` is evaluated while the
    graph is captured, so each captured call holds a different copy."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        nbytes = sum(t.nbytes for t in tensors)
        copies = max(1, -(-(100 << 20) // nbytes))
        self.sets = [tuple(t.clone() for t in tensors) for _ in range(copies)]
        self.i = 0

    def next(self) -> tuple[torch.Tensor, ...]:
        self.i = (self.i + 1) % len(self.sets)
        return self.sets[self.i]


def _w8a8(x, q, s_row):
    return g.scaled_mm_rowwise(*g.quantize_rows(x), q, s_row, torch.bfloat16)


def _bf16(x: torch.Tensor, r: Rotating) -> torch.Tensor:
    return F.linear(x, r.next()[0])


def _skinny(x: torch.Tensor, r: Rotating, **kwargs) -> torch.Tensor:
    q, s, _ = r.next()
    return skinny_linear(x, q, weight_scale=s, **kwargs)


def _old(x: torch.Tensor, r: Rotating) -> torch.Tensor:
    q, s, _ = r.next()
    return g.fp8_weight_gemm(x, q, s)


def _w8a8_rotating(x: torch.Tensor, r: Rotating) -> torch.Tensor:
    q, _, s_row = r.next()
    return _w8a8(x, q, s_row)


def _candidates(m: int, k: int) -> list[SkinnyConfig]:
    if m <= 2:
        fma = [(16, 512, 1, 4), (8, 1024, 1, 4), (16, 1024, 1, 8), (32, 256, 1, 4),
               (4, k, 1, 8), (8, k, 1, 8), (2, k, 1, 4), (16, 512, 2, 4), (16, 512, 4, 4)]
        return [SkinnyConfig(bn, bk, sp, w, 1, False) for bn, bk, sp, w in fma]
    dot = [(64, 256, 1, 4, 4), (64, 128, 1, 4, 4), (32, 256, 1, 4, 4), (64, 512, 1, 4, 3),
           (128, 256, 1, 8, 3), (64, 256, 2, 4, 4), (16, 512, 1, 4, 4)]
    return [SkinnyConfig(bn, bk, sp, w, st, True) for bn, bk, sp, w, st in dot]


def _sweep(name: str, x: torch.Tensor, rq: Rotating) -> None:
    m, k = x.shape
    best = None
    for cfg in _candidates(m, k):
        try:
            t = _us(_skinny, x, rq, config=cfg)
        except Exception as e:  # a configuration the compiler refuses: skip it
            print(f"FP8SWEEP {name} m={m} {cfg} failed: {type(e).__name__}", flush=True)
            continue
        print(f"FP8SWEEP {name} m={m} bn={cfg.block_n} bk={cfg.block_k} split={cfg.split_k} "
              f"warps={cfg.num_warps} stages={cfg.num_stages} dot={cfg.use_dot} us={t:.1f}",
              flush=True)
        best = min(best or (t, cfg), (t, cfg), key=lambda b: b[0])
    if best:
        print(f"FP8SWEEP {name} m={m} best us={best[0]:.1f} {best[1]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="1,4,16,32")
    p.add_argument("--prefill-ms", default="256,2048,8192")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--sweep", action="store_true",
                   help="also time candidate skinny configurations at M = 1 and 16")
    a = p.parse_args()
    dev = "cuda"
    print(f"FP8GEMM gpu={torch.cuda.get_device_name()}", flush=True)
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=dev) * 0.02
        wb = w.to(torch.bfloat16)
        q, s = q8.quantize_per_channel(w)
        s_row = s.view(1, -1)
        rb, rq = Rotating(wb), Rotating(q, s, s_row)
        floor = n * k / _peak_bytes_per_s() * 1e6
        for m in [int(v) for v in a.ms.split(",") if v]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t_bf16 = _us(_bf16, x, rb)
            t_skinny = _us(_skinny, x, rq)
            t_old = _us(_old, x, rq)
            t_w8a8 = _us(_w8a8_rotating, x, rq)
            gated = ""
            if name == "gate_up":
                t_gated = _us(_skinny, x, rq, gated=True)
                gated = f" skinny_fp8_gated={t_gated:.1f}"
            if a.sweep and m in (1, 16):
                _sweep(name, x, rq)
            print(f"FP8GEMM {name} m={m} bf16_cublas={t_bf16:.1f} skinny_fp8={t_skinny:.1f}"
                  f"{gated} fp8_weight_gemm={t_old:.1f} w8a8_scaled_mm={t_w8a8:.1f} "
                  f"floor_us={floor:.1f} skinny_floor_fraction={floor / t_skinny:.2f}",
                  flush=True)
        for m in [int(v) for v in a.prefill_ms.split(",") if v]:
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

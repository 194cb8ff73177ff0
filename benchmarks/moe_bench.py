"""Time the fused MoE Triton kernel against the torch expert loop on CUDA.

Defaults are Mixtral-8x7B's MoE layer on one GPU: 8 experts, top-2 routing, hidden 4096,
intermediate 14336, bf16, for batches of 1..4096 tokens with random router logits. Both sides
compute the routed experts of one layer from the same routing (``select_experts`` is shared
and not timed); the torch side is ``fused_experts_torch`` (one pair of GEMMs per expert that
received tokens, plus a host sync to read the per-expert counts). Times are medians of
``triton.testing.do_bench``. Each row also checks that the two outputs agree.

Columns: tokens; torch and Triton times (ms); the speed-up (torch / Triton); the Triton
kernel's rate as TFLOP/s of routed-expert work (``6 * tokens * top_k * H * I``) and as GB/s of
expert weights read (every expert that received a token is read once), the figure that
bounds decode-sized batches; for bf16 activations, the time of ``fused_experts_grouped_mm``
(torch's grouped GEMM) and its error against the loop. ``--sweep-tiles`` also times a list
of tile shapes per row and prints the fastest, to tune ``moe_tile_config`` in
``tokenmill/kernels/moe/fused_moe.py``.

``--mxfp4`` makes the experts gpt-oss': MXFP4 weights (random FP4 codes, small E8M0
scales), biases and the clamped SwiGLU; the kernel decodes them tile by tile, the torch loop
one expert at a time (by a Triton kernel on CUDA). ``--experts 32 --top-k 4 --hidden 2880
--intermediate 2880`` is gpt-oss-20b's layer.

Usage: python benchmarks/moe_bench.py [--tokens 1,16,256,4096] [--sweep-tiles] [--mxfp4]
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton.testing

from tokenmill.kernels.moe.fused_moe import (
    fused_experts_grouped_mm,
    fused_experts_torch,
    fused_experts_triton,
    moe_tile_config,
    select_experts,
)
from tokenmill.kernels.moe.mxfp4_experts import mxfp4_tile_config
from tokenmill.kernels.moe.tiles import GatedActivation

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TILE_SWEEP = [
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
]
# MXFP4 experts (weights the left operand): BLOCK_N weight rows x BLOCK_M token rows.
MXFP4_SWEEP = [
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=3),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256, GROUP_M=1, num_warps=8, num_stages=3),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--tokens", type=ints,
                   default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep-tiles", action="store_true", help="time each tile shape per row")
    p.add_argument("--mxfp4", action="store_true",
                   help="gpt-oss experts: MXFP4 weights, biases, clamped SwiGLU")
    return p.parse_args()


def make_weights(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Random expert weights ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` on the GPU (MXFP4:
    their packed bytes), and the experts' other keyword arguments (scales, biases, the
    activation)."""
    dtype, e, h, i = DTYPES[args.dtype], args.experts, args.hidden, args.intermediate
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    if args.mxfp4:
        kw = dict(device="cuda", generator=gen, dtype=torch.uint8)
        w13, w2 = (torch.randint(0, 256, (e, 2 * i, h // 2), **kw),
                   torch.randint(0, 256, (e, h, i // 2), **kw))  # fmt: skip
        extra = dict(
            w13_scale=torch.randint(118, 122, (e, 2 * i, h // 32), **kw),
            w2_scale=torch.randint(118, 122, (e, h, i // 32), **kw),
            w13_bias=torch.zeros(e, 2 * i, device="cuda", dtype=dtype),
            w2_bias=torch.zeros(e, h, device="cuda", dtype=dtype),
            activation=GatedActivation("swigluoai"),
        )
        return w13, w2, extra
    w13 = torch.empty(e, 2 * i, h, device="cuda", dtype=dtype)
    w2 = torch.empty(e, h, i, device="cuda", dtype=dtype)
    w13.normal_(0, h**-0.5, generator=gen)
    w2.normal_(0, i**-0.5, generator=gen)
    return w13, w2, {}


def time_ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_row(
    args: argparse.Namespace, tokens: int, w13: torch.Tensor, w2: torch.Tensor, extra: dict
) -> str:
    dtype, h, i = DTYPES[args.dtype], args.hidden, args.intermediate
    gen = torch.Generator(device="cuda").manual_seed(args.seed + tokens)
    x = torch.randn(tokens, h, device="cuda", generator=gen).to(dtype)
    logits = torch.randn(tokens, args.experts, device="cuda", generator=gen)
    weights, ids = select_experts(logits, args.top_k, renormalize=True)

    ref = fused_experts_torch(x, w13, w2, weights, ids, **extra)
    t_torch = time_ms(lambda: fused_experts_torch(x, w13, w2, weights, ids, **extra))
    try:
        got = fused_experts_triton(x, w13, w2, weights, ids, **extra)
        t_triton = time_ms(lambda: fused_experts_triton(x, w13, w2, weights, ids, **extra))
    except Exception as e:  # a kernel that does not compile on this GPU: report, go on
        got, t_triton = ref, float("nan")
        print(f"#   default kernel failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    scale = ref.float().abs().max().item()
    rel_err = (got.float() - ref.float()).abs().max().item() / max(scale, 1e-12)
    flops = 6 * tokens * args.top_k * h * i
    touched = int(torch.unique(ids).numel())
    # MXFP4: half a byte a value and a scale byte per 32
    per_value = 0.5 + 1 / 32 if args.mxfp4 else w13.element_size()
    weight_bytes = int(touched * 3 * h * i * per_value)
    row = (
        f"{tokens:>6} {t_torch:>10.3f} {t_triton:>10.3f} {t_torch / t_triton:>8.2f}x "
        f"{flops / t_triton / 1e9:>9.1f} {weight_bytes / t_triton / 1e6:>9.0f} {rel_err:>9.2e}"
    )
    if dtype == torch.bfloat16:
        grouped = fused_experts_grouped_mm(x, w13, w2, weights, ids, **extra)
        g_err = (grouped.float() - ref.float()).abs().max().item() / max(scale, 1e-12)
        t_grouped = time_ms(lambda: fused_experts_grouped_mm(x, w13, w2, weights, ids, **extra))
        row += f" {t_grouped:>10.3f} {g_err:>9.2e}"
    if args.mxfp4 and args.sweep_tiles:
        row += "\n" + sweep_mxfp4(args, x, w13, w2, weights, ids, extra)
    elif args.sweep_tiles:
        timed = []
        for k, c in enumerate(TILE_SWEEP):
            try:
                run = lambda c=c: fused_experts_triton(  # noqa: E731
                    x, w13, w2, weights, ids, config=c, **extra
                )
                timed.append((time_ms(run), k))
            except Exception as e:  # e.g. tiles needing more shared memory than the GPU has
                print(f"#   tiles {c} skipped: {type(e).__name__}", flush=True)
        best = min(timed)
        chosen = moe_tile_config(tokens * args.top_k, args.experts, dtype)
        row += f"   best {best[0]:.3f} ms with {TILE_SWEEP[best[1]]} (default {chosen})"
        row += "\n#   " + "  ".join(f"{t:.3f}" for t, _ in sorted(timed, key=lambda tk: tk[1]))
    return row


def sweep_mxfp4(args, x, w13, w2, weights, ids, extra) -> str:
    """The MXFP4 kernel's time under each tile shape of ``MXFP4_SWEEP``, and the fastest."""
    timed = []
    for c in MXFP4_SWEEP:
        try:
            run = lambda c=c: fused_experts_triton(  # noqa: E731
                x, w13, w2, weights, ids, config=c, **extra
            )
            timed.append((time_ms(run), str(c)))
        except Exception as e:  # e.g. tiles needing more shared memory than the GPU has
            timed.append((float("inf"), f"{c} {type(e).__name__}"))
    best = min(timed)
    chosen = mxfp4_tile_config(ids.numel(), args.experts, x.dtype)
    return (f"#   best {best[0]:.3f} ms with {best[1]} (default {chosen}); all "
            + " ".join(f"{t:.3f}" for t, _ in timed))  # fmt: skip


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_bench.py needs a CUDA device")
    print(f"# {datetime.date.today().isoformat()}  {torch.cuda.get_device_name()}  "
          f"torch {torch.__version__}  triton {triton.__version__}")
    print(f"# python {' '.join(sys.argv)}")
    print(f"# experts {args.experts} top-{args.top_k} hidden {args.hidden} "
          f"intermediate {args.intermediate} {args.dtype}{' mxfp4' if args.mxfp4 else ''}")
    print(f"{'tokens':>6} {'torch ms':>10} {'triton ms':>10} {'speedup':>9} "
          f"{'TFLOP/s':>9} {'GB/s':>9} {'max err':>9} {'grouped ms':>10} {'its err':>9}")
    w13, w2, extra = make_weights(args)
    for tokens in args.tokens:
        print(bench_row(args, tokens, w13, w2, extra), flush=True)


if __name__ == "__main__":
    main()

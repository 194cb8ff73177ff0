"""Time the skinny GEMM kernel against cuBLAS (``F.linear``) at Llama-3.1-8B's decode shapes.

For each weight shape ``[N, K]`` and each M (rows of x), two times per implementation:

- ``single``: the median of ``triton.testing.do_bench`` (L2 flushed before every call), one
  launch timed alone;
- ``graph``: a CUDA graph of ``--calls`` back-to-back calls, each on the next of several
  copies of the weight that together exceed the L2 four times, replayed; time per call. This
  is what a CUDA-graph decode step pays: launch gaps included, no weight found in L2.

Rates are bytes moved (W + x + y, each once) over the graph time, against ``--peak-tbps``
(an H200 copies ~4.25 TB/s). Each kernel output is checked against ``F.linear`` first.

``--pdl`` adds a third implementation, the kernel as a programmatic dependent launch (each
call's programs start while the previous call finishes and load their first weight tiles
before they wait), and makes ``--sweep`` time that one.

``--sweep`` tunes each (shape, M) by coordinate descent over ``FMA_SPACE`` / ``DOT_SPACE``
(one parameter at a time, from the current configuration, ``--rounds`` passes), timing
candidates with the graph method, and prints the best as lines that paste into
``TUNED_CONFIGS`` in ``tokenmill/model/layers/skinny_gemm_configs.py``.

Usage: python benchmarks/skinny_gemm_bench.py [--shapes qkv,o_proj] [--ms 1,8] [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.testing

from tokenmill.benchmarks.cuda_timing import graph_replay_ms
from tokenmill.kernels.gemm import skinny as sg
from tokenmill.kernels.gemm.skinny import SkinnyConfig, skinny_linear

SHAPES = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FMA_SPACE = {
    "block_n": [4, 8, 16, 32],
    "block_k": [128, 256, 512, 1024],
    # Not only powers of two: the grid's last wave is what a small product loses.
    "split_k": [1, 2, 3, 4, 6, 8, 12, 16],
    "num_warps": [2, 4, 8],
}
DOT_SPACE = {
    "block_n": [16, 32, 64, 128],
    "block_k": [64, 128, 256],
    "split_k": [1, 2, 4, 8, 16],
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4, 5],
}
REPLAYS = 10
PDL = False  # --pdl


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"from {','.join(SHAPES)}")
    p.add_argument("--ms", default="1,2,4,8,16,32", help="rows of x")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--peak-tbps", type=float, default=4.25, help="memory ceiling (TB/s)")
    p.add_argument("--calls", type=int, default=32, help="calls per CUDA graph")
    p.add_argument("--sweep", action="store_true", help="tune each shape's configuration")
    p.add_argument("--rounds", type=int, default=2, help="coordinate-descent passes")
    p.add_argument("--fma-only", action="store_true", help="sweep the CUDA-core loop only")
    p.add_argument(
        "--pdl", action="store_true", help="also time dependent launches; --sweep times those"
    )
    return p.parse_args()


class Problem:
    """x ``[m, k]`` and enough copies of a weight ``[n, k]`` to defeat the L2."""

    def __init__(self, n: int, k: int, dtype: torch.dtype, calls: int) -> None:
        l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
        wbytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(2, min(calls, math.ceil(4 * l2 / wbytes)))
        self.weights = [(torch.randn(n, k, device="cuda") * k**-0.5).to(dtype)]
        self.weights += [torch.randn_like(self.weights[0]) * k**-0.5 for _ in range(copies - 1)]
        self.n, self.k, self.dtype, self.calls = n, k, dtype, calls
        self.x = torch.empty(0)

    def set_m(self, m: int) -> None:
        self.x = torch.randn(m, self.k, device="cuda").to(self.dtype)

    def nbytes(self) -> int:
        m = self.x.shape[0]
        return (self.n * self.k + m * self.k + m * self.n) * self.x.element_size()

    def check(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        w = self.weights[0]
        ref = F.linear(self.x.float(), w.float())
        torch.testing.assert_close(fn(self.x, w).float(), ref, atol=1e-2, rtol=1e-2)

    def single_ms(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        w = self.weights[0]
        return triton.testing.do_bench(lambda: fn(self.x, w), return_mode="median")

    def graph_ms(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        """Milliseconds per call in a replayed graph of ``calls`` calls over the copies."""
        for w in self.weights:  # compile and allocate outside capture
            fn(self.x, w)
        n = len(self.weights)
        calls = [lambda i=i: fn(self.x, self.weights[i % n]) for i in range(self.calls)]
        return graph_replay_ms(lambda: [c() for c in calls], REPLAYS) / self.calls


def cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def kernel(
    cfg: SkinnyConfig | None, pdl: bool = False
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda x, w: skinny_linear(x, w, config=cfg, pdl=pdl)


def rate(p: Problem, ms: float, peak: float) -> str:
    tbps = p.nbytes() / ms / 1e9
    return f"{tbps:5.2f} TB/s ({100 * tbps / peak:3.0f}%)"


def compare(name: str, p: Problem, args: argparse.Namespace) -> None:
    """One line each for cuBLAS and the kernel: single-call and in-graph time and rate."""
    m = p.x.shape[0]
    cfg = sg.launch_config(m, p.n, p.k, torch.cuda.get_device_properties(0).multi_processor_count)
    p.check(kernel(cfg))
    graph_us = {}
    impls = [("cuBLAS", cublas), ("skinny", kernel(cfg))]
    if PDL:
        impls.append(("pdl", kernel(cfg, pdl=True)))
    for impl, fn in impls:
        single, graph = p.single_ms(fn), p.graph_ms(fn)
        graph_us[impl] = graph * 1e3
        print(
            f"{name:<8} M={m:<3} {impl:<7} single {single * 1e3:7.1f} us "
            f"{rate(p, single, args.peak_tbps)}  graph {graph * 1e3:7.1f} us "
            f"{rate(p, graph, args.peak_tbps)}" + (f"  {cfg}" if impl == "skinny" else "")
        )
    print(f"{'':<14} speed-up in graph: x{graph_us['cuBLAS'] / graph_us['skinny']:.2f}"
          + (f", with PDL x{graph_us['cuBLAS'] / graph_us['pdl']:.2f}" if PDL else ""))  # fmt: skip


SMEM_BYTES = 227 * 1024  # shared memory one program may use on an H100/H200


def plausible(cfg: SkinnyConfig, m: int) -> bool:
    """Whether ``cfg`` can run at ``m`` rows without spilling or overflowing shared memory:
    the tensor-core loop keeps ``num_stages`` weight and x tiles in shared memory; the
    CUDA-core loop one fp32 accumulator per row of x per weight element a thread holds,
    which should also hold at least one 16-byte vector."""
    bm = sg.block_m(m, cfg.use_dot)
    if cfg.use_dot:
        smem = cfg.num_stages * (cfg.block_n + bm) * cfg.block_k * 2
        return cfg.block_n >= 16 and smem <= SMEM_BYTES
    per_thread = cfg.block_n * cfg.block_k // (32 * cfg.num_warps)
    return m <= sg.FMA_MAX_M and 8 <= per_thread and per_thread * bm <= 128


def try_config(p: Problem, cfg: SkinnyConfig) -> float:
    """Graph milliseconds per call of ``cfg``, or inf if it fails to build or is wrong."""
    if not plausible(cfg, p.x.shape[0]):
        return math.inf
    try:
        p.check(kernel(cfg, PDL))
        return p.graph_ms(kernel(cfg, PDL))
    except Exception as e:  # noqa: BLE001 (out of shared memory, registers, wrong result)
        print(f"    skip {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        return math.inf


def descend(p: Problem, start: SkinnyConfig, rounds: int) -> tuple[SkinnyConfig, float]:
    """Coordinate descent: vary one field at a time over its space, keep the fastest."""
    space = DOT_SPACE if start.use_dot else FMA_SPACE
    best, best_ms = start, try_config(p, start)
    for _ in range(rounds):
        improved = False
        for field, values in space.items():
            for v in values:
                cand = dataclasses.replace(best, **{field: v})
                if cand == best:
                    continue
                ms = try_config(p, cand)
                if ms < best_ms:
                    best, best_ms, improved = cand, ms, True
        if not improved:
            break
    return best, best_ms


def sweep(name: str, p: Problem, args: argparse.Namespace) -> str:
    m = p.x.shape[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    starts = [sg.launch_config(m, p.n, p.k, sms)]
    if args.fma_only:
        starts = [sg.default_config(1, p.n, p.k, sms)]
    elif m <= sg.FMA_MAX_M:  # both main loops can run: descend from each
        if starts[0].use_dot:  # CUDA cores, 16 elements per thread per row of x
            fma = sg.default_config(sg.FMA_DEFAULT_MAX_M, p.n, p.k, sms)
            starts.append(dataclasses.replace(fma, block_n=8 if m > 2 else 16))
        else:
            starts.append(sg.default_config(sg.FMA_MAX_M + 1, p.n, p.k, sms))
    results = [descend(p, s, args.rounds) for s in starts]
    best, ms = min(results, key=lambda r: r[1])
    line = (
        f"    ({sg.m_bucket(m)}, {p.n}, {p.k}): {best!r},  "
        f"# {name} {ms * 1e3:.1f} us, {rate(p, ms, args.peak_tbps)}"
    )
    print(line)
    return line


def main() -> None:
    global PDL
    args = parse_args()
    PDL = args.pdl
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}  {props.multi_processor_count} SMs  L2 {props.L2_cache_size >> 20} MB  "
          f"torch {torch.__version__}  triton {triton.__version__}")  # fmt: skip
    print("times: single (do_bench median) / graph (per call in a replayed graph)")
    tuned = []
    for name in args.shapes.split(","):
        p = Problem(*SHAPES[name], DTYPES[args.dtype], args.calls)
        for m in (int(s) for s in args.ms.split(",")):
            p.set_m(m)
            compare(name, p, args)
            if args.sweep:
                tuned.append(sweep(name, p, args))
        del p
        torch.cuda.empty_cache()
    if tuned:
        print("\nTUNED_CONFIGS entries:\n" + "\n".join(tuned))


if __name__ == "__main__":
    main()

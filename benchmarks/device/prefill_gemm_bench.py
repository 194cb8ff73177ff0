"""How close a prompt step's products come to the card's compute peak.

usage: python3 benchmarks/device/prefill_gemm_bench.py [--ms 512,2048,8192]
    [--blas cublas,cublaslt] [--quiet]

Times ``F.linear`` (cuBLAS) at Llama-3.1-8B's four layer shapes for M prompt tokens, each
call on the next of several weight copies (so no weight is found in L2), replayed from a
CUDA graph, and prints TFLOP/s per shape and the time of one layer's products per token.
``--blas`` repeats the sweep under each of torch's BLAS back ends for CUDA
(``torch.backends.cuda.preferred_blas_library``); ``--quiet`` prints only the per-M sums
(the 32 layers' products of one step, ms), for sweeps over many M.
The card's 8192-cubed bf16 GEMM runs at ~788 TFLOP/s (../ANCHORS figures).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tokenmill.benchmarks.cuda_timing import graph_replay_ms

SHAPES = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}


def time_graph(fn, replays: int = 5) -> float:
    """Seconds per call of ``fn`` captured in a CUDA graph (median of ``replays``); ``fn``
    returns how many calls it made."""
    calls = []
    ms = graph_replay_ms(lambda: calls.append(fn()), replays)
    return ms / 1e3 / calls[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="512,2048,8192")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--blas", default="cublas")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    for blas in args.blas.split(","):
        torch.backends.cuda.preferred_blas_library(blas)
        sweep(blas, [int(v) for v in args.ms.split(",")], args.copies, args.quiet)


def sweep(blas: str, ms: list[int], copies: int, quiet: bool) -> None:
    """Times the four layer shapes at each M under BLAS back end ``blas``."""
    dtype = torch.bfloat16
    for m in ms:
        per_token_layer = 0.0
        shapes_ms = []
        for name, (n, k) in SHAPES.items():
            weights = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(copies)]
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            out = torch.empty(m, n, device="cuda", dtype=dtype)
            rounds = 4

            def run(weights=weights, x=x, out=out, rounds=rounds) -> int:
                for _ in range(rounds):
                    for w in weights:
                        torch.matmul(x, w.t(), out=out)
                return rounds * len(weights)

            seconds = time_graph(run)
            # The last call wrote ``out`` from the last copy; cuBLAS may pick another
            # algorithm outside the graph, so compare the relative error, not bit equality.
            check = F.linear(x, weights[-1]).float()
            error = (out.float() - check).norm() / check.norm()
            assert error < 1e-2, f"{name} M={m}: relative error {error:.2e}"
            tflops = 2 * m * n * k / seconds / 1e12
            per_token_layer += seconds / m
            shapes_ms.append(f"{name} {seconds * 1e6:.1f}")
            if not quiet:
                print(
                    f"PGEMM {blas} M={m:5d} {name:8s} N={n:5d} K={k:5d}: "
                    f"{seconds * 1e3:7.3f} ms {tflops:6.1f} TFLOP/s"
                )
            del weights, x, out
        print(
            f"PGEMM {blas} M={m:5d} 32 layers' products {32 * per_token_layer * m * 1e3:.3f} ms"
            f" ({32 * per_token_layer * 1e6:.2f} us/token; us: {', '.join(shapes_ms)})"
        )


if __name__ == "__main__":
    main()

"""How close a prompt step's products come to the card's compute peak.

usage: python3 benchmarks/device/prefill_gemm_bench.py [--ms 512,2048,8192]

Times ``F.linear`` (cuBLAS) at Llama-3.1-8B's four layer shapes for M prompt tokens, each
call on the next of several weight copies (so no weight is found in L2), replayed from a
CUDA graph, and prints TFLOP/s per shape and the time of one layer's products per token.
The card's 8192-cubed bf16 GEMM runs at ~788 TFLOP/s (../ANCHORS figures).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def time_graph(fn, replays: int = 5) -> float:
    """Seconds per call of ``fn`` captured in a CUDA graph (median of ``replays``)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls = fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="512,2048,8192")
    parser.add_argument("--copies", type=int, default=4)
    args = parser.parse_args()
    dtype = torch.bfloat16
    for m in (int(v) for v in args.ms.split(",")):
        per_token_layer = 0.0
        for name, (n, k) in SHAPES.items():
            weights = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(args.copies)]
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
            print(f"PGEMM M={m:5d} {name:8s} N={n:5d} K={k:5d}: {seconds * 1e3:7.3f} ms "
                  f"{tflops:6.1f} TFLOP/s")
            del weights, x, out
        print(f"PGEMM M={m:5d} one layer's products: {per_token_layer * 1e6:.3f} us/token, "
              f"32 layers {32 * per_token_layer * 1e6:.2f} us/token")


if __name__ == "__main__":
    main()

"""Time one decode step's attention on the CPU backend: the native paged decode kernel
against the torch path (gather the blocks, then fused attention by padded length).

Shapes default to SmolLM2-135M (30 layers, 9 query heads, 3 KV heads, head_dim 64, block
size 16, float32 cache), each layer with its own cache and every request's blocks scattered.
A step is ``TorchAttentionImpl.attend`` on every layer with one new metadata (the per-step
plan is made once and shared, as in the engine). Reported: the fastest step time in ms over
``--steps`` steps (the least: the machine may be shared), per batch size and context length.

Usage: python benchmarks/cpu_decode_attention_bench.py [--batch 1,16] [--context 230]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from tokenmill.kernels.cpu.native import native_ops
from tokenmill.model.attention import torch_ref
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.model.attention.torch_ref import TorchAttentionImpl

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_step(args, batch: int, context: int) -> tuple[torch.Tensor, list, AttentionMetadata]:
    gen = torch.Generator().manual_seed(0)
    bs = args.block_size
    per_req = -(-context // bs)
    num_blocks = batch * per_req + 8
    table = torch.stack(
        [torch.randperm(num_blocks, generator=gen)[:per_req] for _ in range(batch)]
    ).to(torch.int32)
    caches = [
        torch.randn(2, num_blocks, bs, args.kv_heads, args.head_dim, generator=gen).to(
            DTYPES[args.dtype]
        )
        for _ in range(args.layers)
    ]
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    md = AttentionMetadata(
        num_actual_tokens=batch, num_reqs=batch, query_start_loc=qsl, seq_lens=lens,
        block_table=table, slot_mapping=torch.zeros(batch, dtype=torch.int64), max_query_len=1,
        max_seq_len=context, query_start_loc_cpu=qsl.clone(), seq_lens_cpu=lens.clone(),
    )  # fmt: skip
    query = torch.randn(batch, args.heads * args.head_dim, generator=gen)
    return query, caches, md


def step_ms(impl, query, caches, md, steps: int) -> float:
    times = []
    for _ in range(steps + 3):
        step_md = dataclasses.replace(md)  # a new step: the plan is made again
        t0 = time.perf_counter()
        for cache in caches:
            impl.attend(query, cache, step_md)
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--context", default="230", help="comma-separated context lengths")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    ops = native_ops()
    if ops is None:
        raise SystemExit("the native CPU kernels cannot be built here")
    impl = TorchAttentionImpl(args.heads, args.head_dim, args.head_dim**-0.5, args.kv_heads)
    print(f"threads {torch.get_num_threads()}, {args.layers} layers, {args.heads}/{args.kv_heads}"
          f" heads, head_dim {args.head_dim}, {args.dtype} cache")  # fmt: skip
    print(f"{'batch':>5} {'context':>7} {'torch ms':>9} {'native ms':>9} {'speed-up':>8}")
    for batch in map(int, args.batch.split(",")):
        for context in map(int, args.context.split(",")):
            query, caches, md = make_step(args, batch, context)
            torch_ref.native_ops = lambda: None
            slow = step_ms(impl, query, caches, md, args.steps)
            torch_ref.native_ops = native_ops
            fast = step_ms(impl, query, caches, md, args.steps)
            print(f"{batch:>5} {context:>7} {slow:>9.3f} {fast:>9.3f} {slow / fast:>7.2f}x")


if __name__ == "__main__":
    main()

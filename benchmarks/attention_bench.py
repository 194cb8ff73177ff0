"""Time the Triton paged-attention kernels on CUDA and compare them with the GPU's ceilings.

Shapes default to Llama-3.1-8B on one GPU (32 query heads, 8 KV heads, head_dim 128,
block_size 16, bf16), with block ids scattered over the cache as a serving engine leaves them:

- decode: batches of 1/32/256 requests at contexts 512..8192 (memory-bound: reported as
  achieved GB/s of K/V + Q + output traffic against ``--peak-gbps``);
- prefill: one fresh prompt of 512..8192 tokens, and 2048-token chunks after cached contexts
  (compute-bound: reported as TFLOP/s of causal attention work against ``--peak-tflops``);
- the KV-cache write (``reshape_and_cache``) for 512..8192 tokens, and the same write fused
  with the rotary embedding (``kernels.rotary.rotary_and_cache``) against the two kernels.

Two times per row: ``eager``, the median of ``triton.testing.do_bench`` (L2 flushed between
runs; includes the host's launch cost, which dominates kernels shorter than ~20 us), and
``graph``, the kernel alone: a CUDA graph of (L2 flush + kernel) x 20 replayed, minus a graph of
the flushes alone. Rates use the graph time, which is what a CUDA-graph decode step pays.
``--baseline``
adds torch SDPA on contiguous (unpaged) tensors, ``--sweep-splits`` times every decode split
count, ``--sweep-tiles`` tries prefill tile shapes: both help tune the heuristics in
``tokenmill/kernels/attention/paged.py``. ``--shared-prefix 0,2000`` times each decode
shape again with its first 2,000 tokens in blocks shared by every request (prefix caching):
the rate is then over the logical K/V, so it shows how much the shared reads come from L2.
``--uniform`` runs the prompt kernel as a whole-step graph of a mixed batch does (uniform
grids: one key split, programs found from the device tensors); ``--chunk-contexts 0,256``
times ``--chunk-tokens`` chunks after those cached contexts; ``--prompt-splits 1,2,4`` times
the prompt kernel at each key split count (under each of ``--prompt-tiles`` with
``--sweep-tiles``; not with ``--uniform``).

Usage: python benchmarks/attention_bench.py [--dtype bf16] [--baseline] [--sweep-splits]
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
import triton
import triton.testing

from tokenmill.benchmarks.cuda_timing import graph_replay_ms
from tokenmill.kernels import rotary as fused_kernels
from tokenmill.kernels.attention import decode as decode_kernels
from tokenmill.kernels.attention import paged
from tokenmill.kernels.attention.cache_write import reshape_and_cache
from tokenmill.kernels.attention.launch import TileConfig
from tokenmill.kernels.device import num_sms
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.model.attention.triton_backend import TritonAttentionImpl
from tokenmill.model.layers.rotary import RotaryEmbedding

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TILE_SWEEP = [
    TileConfig(128, 64, 8, 3),
    TileConfig(64, 64, 4, 2),
    TileConfig(32, 64, 4, 3),
    TileConfig(64, 64, 8, 3),
    TileConfig(128, 64, 8, 2),
    TileConfig(128, 64, 8, 4),
    TileConfig(128, 64, 4, 3),
    TileConfig(128, 32, 4, 3),
    TileConfig(128, 128, 8, 2),
    TileConfig(128, 128, 8, 3),
    TileConfig(256, 64, 8, 2),
    TileConfig(64, 64, 4, 3),
    TileConfig(64, 128, 4, 2),
    TileConfig(64, 32, 4, 4),
]

DECODE_TILE_SWEEP = [
    TileConfig(16, n, w, st) for n in (32, 64, 128) for w in (2, 4, 8) for st in (2, 3)
]


def tiles(text: str) -> list[TileConfig]:
    """Decode tile shapes from ``KEYS:WARPS:STAGES[,...]``."""
    shapes = [[int(x) for x in item.split(":")] for item in text.split(",")]
    return [TileConfig(16, n, w, st) for n, w, st in shapes]


def prompt_tiles(text: str) -> list[TileConfig]:
    """Prompt tile shapes from ``M:N:WARPS:STAGES[,...]``."""
    return [TileConfig(*(int(x) for x in item.split(":"))) for item in text.split(",")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-batches", type=ints, default=[1, 32, 256])
    p.add_argument("--contexts", type=ints, default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--prefill-tokens", type=ints, default=[512, 1024, 2048, 4096, 8192])
    p.add_argument(
        "--prefill-batch",
        type=ints,
        default=[1],
        help="prefill: prompts per batch (each of --prefill-tokens tokens); a list times each",
    )
    p.add_argument("--chunk-tokens", type=int, default=2048)
    p.add_argument(
        "--chunk-contexts",
        type=ints,
        default=None,
        help="prefill: cached contexts of the --chunk-tokens chunks (default: the --contexts "
        "at least as long as a chunk)",
    )
    p.add_argument(
        "--uniform", action="store_true", help="prefill: uniform grids (whole-step graphs)"
    )
    p.add_argument("--peak-gbps", type=float, default=4200.0, help="memory ceiling (GB/s)")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 matrix ceiling")
    p.add_argument("--baseline", action="store_true", help="also time torch SDPA, unpaged")
    p.add_argument("--sweep-splits", action="store_true", help="time each decode split count")
    p.add_argument(
        "--split-counts",
        type=ints,
        default=[1, 2, 4, 8, 16, 32, 64],
        help="decode split counts that --sweep-splits times",
    )
    p.add_argument(
        "--context-spread",
        type=int,
        default=0,
        help="decode: contexts spread evenly over [ctx, ctx + N) tokens, as requests at "
        "different points of their output are",
    )
    p.add_argument(
        "--decode-rows",
        type=int,
        default=0,
        help="decode: pad each batch with empty requests to this many rows and launch it "
        "with uniform grids, as a whole-step graph does (0: off)",
    )
    p.add_argument("--sweep-tiles", action="store_true", help="time prefill tile shapes")
    p.add_argument(
        "--prompt-tiles",
        type=prompt_tiles,
        default=None,
        help="prefill tile shapes that --sweep-tiles times, as M:N:WARPS:STAGES,... "
        "(default: the built-in sweep)",
    )
    p.add_argument(
        "--prompt-splits",
        type=ints,
        default=None,
        help="prefill: time each of these key split counts (with --sweep-tiles, under each "
        "tile); uniform grids take one split, so not with --uniform",
    )
    p.add_argument(
        "--sweep-decode-tiles", action="store_true", help="time decode tile shapes (keys, warps)"
    )
    p.add_argument(
        "--decode-tiles",
        type=tiles,
        default=DECODE_TILE_SWEEP,
        help="decode tile shapes that --sweep-decode-tiles times, as KEYS:WARPS:STAGES,...",
    )
    p.add_argument(
        "--decode-tile",
        type=lambda s: tiles(s)[0],
        default=None,
        help="KEYS:WARPS:STAGES: run every decode case (and split sweep) with this tile",
    )
    p.add_argument("--only", choices=["decode", "prefill", "cache"], default=None)
    p.add_argument(
        "--shared-prefix",
        type=ints,
        default=[0],
        help="decode: tokens of context every request shares (prefix-cached blocks); "
        "a list times each",
    )
    return p.parse_args()


class Problem:
    """Requests of ``q_lens[i]`` new tokens after ``ctx_lens[i]`` cached ones, in a paged
    cache with shuffled block ids; the first ``shared_prefix`` tokens' full blocks are the
    same physical blocks in every request, as prefix caching leaves them."""

    def __init__(
        self,
        args: argparse.Namespace,
        q_lens: list[int],
        ctx_lens: list[int],
        shared_prefix: int = 0,
    ):
        dtype, dev, bs = DTYPES[args.dtype], torch.device("cuda"), args.block_size
        h, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
        seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
        needed = [triton.cdiv(s, bs) for s in seq_lens]
        shared = max(0, min(shared_prefix // bs, min(needed) - 1))
        num_blocks = shared + sum(n - shared for n in needed)
        perm = torch.randperm(num_blocks, device=dev, dtype=torch.int32)
        width = max(needed)
        table = torch.zeros(len(q_lens), width, dtype=torch.int32, device=dev)
        start = shared
        for i, n in enumerate(needed):
            table[i, :shared] = perm[:shared]
            table[i, shared:n] = perm[start : start + n - shared]
            start += n - shared
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        sl = torch.tensor(seq_lens, dtype=torch.int32)
        tokens = sum(q_lens)
        slots = torch.cat(
            [
                table[i, torch.arange(c, s, device=dev) // bs].long() * bs
                + torch.arange(c, s, device=dev) % bs
                for i, (c, s) in enumerate(zip(ctx_lens, seq_lens, strict=True))
            ]
        )
        self.metadata = AttentionMetadata(
            num_actual_tokens=tokens, num_reqs=len(q_lens), query_start_loc=qsl.to(dev),
            seq_lens=sl.to(dev), block_table=table, slot_mapping=slots,
            max_query_len=max(q_lens), max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl, seq_lens_cpu=sl,
            num_decodes=sum(1 for q in q_lens if q == 1) if max(q_lens) == 1 else 0,
        )  # fmt: skip
        if getattr(args, "decode_rows", 0) and max(q_lens) == 1:
            # As a whole-step graph launches its decodes: over every request row, the rows
            # past the batch's decodes empty, and the prompt kernel's range empty too.
            self.metadata.uniform_grids = True
            self.metadata.num_decodes = 0
            self.metadata.prefill_range = torch.tensor(
                [len(q_lens), 0], dtype=torch.int32, device=dev
            )
        if getattr(args, "uniform", False) and max(q_lens) > 1:
            # As a whole-step graph launches it: every request after the (no) leading
            # decodes is a prompt, found through the device prefill range.
            self.metadata.uniform_grids = True
            self.metadata.prefill_range = torch.tensor(
                [0, len(q_lens)], dtype=torch.int32, device=dev
            )
        self.kv_cache = torch.randn(2, num_blocks, bs, hkv, d, dtype=dtype, device=dev)
        self.query = torch.randn(tokens, h * d, dtype=dtype, device=dev)
        self.key = torch.randn(tokens, hkv * d, dtype=dtype, device=dev)
        self.value = torch.randn(tokens, hkv * d, dtype=dtype, device=dev)
        self.out = torch.empty_like(self.query)
        self.impl = TritonAttentionImpl(h, d, d**-0.5, hkv)
        self.q_lens, self.ctx_lens, self.elem = q_lens, ctx_lens, self.query.element_size()
        self.args = args

    def attend(self) -> None:
        self.impl.attend(self.query, self.kv_cache, self.metadata, out=self.out)

    def bytes_moved(self) -> int:
        """K/V of every visible context token read once, Q read, output written."""
        a = self.args
        kv = sum(q + c for q, c in zip(self.q_lens, self.ctx_lens, strict=True)) * a.num_kv_heads
        return (2 * kv * a.head_dim + 2 * self.query.numel()) * self.elem

    def flops(self) -> int:
        """4 * H * D per (query, visible key) pair: QK^T and PV, 2 FLOPs per multiply-add."""
        pairs = sum(
            q * c + q * (q + 1) // 2 for q, c in zip(self.q_lens, self.ctx_lens, strict=True)
        )
        return 4 * self.args.num_heads * self.args.head_dim * pairs


L2_FLUSH_BYTES = 256 * 1024 * 1024  # several times the H200's 60 MB L2
GRAPH_REPS = 20


def _graph_ms(body: Callable[[], None], replays: int = 10) -> float:
    """Median milliseconds of one replay of a graph holding ``GRAPH_REPS`` calls of ``body``."""
    return graph_replay_ms(lambda: [body() for _ in range(GRAPH_REPS)], replays)


def bench(fn: Callable[[], None]) -> tuple[float, float]:
    """(eager, graph) milliseconds per call of ``fn`` (see the module docstring)."""
    eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")

    def cold() -> None:
        flush.zero_()
        fn()

    graph = (_graph_ms(cold) - _graph_ms(flush.zero_)) / GRAPH_REPS
    return eager, max(graph, 1e-6)


def report(
    name: str, times: tuple[float, float], nbytes: int, flops: int, args: argparse.Namespace
) -> None:
    eager, ms = times
    gbps = nbytes / ms / 1e6
    tflops = flops / ms / 1e9
    print(
        f"{name:<40} eager {eager * 1e3:>8.1f} us  graph {ms * 1e3:>8.1f} us  "
        f"{gbps:>6.0f} GB/s ({100 * gbps / args.peak_gbps:>3.0f}%)  "
        f"{tflops:>6.1f} TFLOP/s ({100 * tflops / args.peak_tflops:>3.0f}%)"
    )


@contextlib.contextmanager
def patched(name: str, value: object, problem: Problem) -> Iterator[None]:
    """Replace ``kernels.attention.paged.<name>`` while timing ``problem``. The backend works out a
    step's launches once and keeps them on the step's metadata, so they are dropped on the
    way in and out: otherwise the replacement would never be consulted."""
    saved = getattr(paged, name)
    setattr(paged, name, value)
    problem.metadata.backend_state.clear()
    try:
        yield
    finally:
        setattr(paged, name, saved)
        problem.metadata.backend_state.clear()


def sdpa_baseline(p: Problem) -> Callable[[], None]:
    """torch SDPA over contiguous K/V of the same sizes (one request at a time is not needed:
    every request of a problem has the same lengths)."""
    a = p.args
    b, q_len, ctx = len(p.q_lens), p.q_lens[0], p.ctx_lens[0]
    dtype, dev = p.query.dtype, p.query.device
    q = torch.randn(b, a.num_heads, q_len, a.head_dim, dtype=dtype, device=dev)
    k = torch.randn(b, a.num_kv_heads, q_len + ctx, a.head_dim, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    causal = q_len > 1 and ctx == 0
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def run_decode(args: argparse.Namespace) -> None:
    print(
        f"\n== decode (query_len 1), {args.num_heads}/{args.num_kv_heads} heads, D={args.head_dim}"
    )
    sms = num_sms(torch.device("cuda"))
    for batch in args.decode_batches:
        for ctx in args.contexts:
            for shared in args.shared_prefix:
                ctx_lens = [ctx - 1 + i * args.context_spread // batch for i in range(batch)]
                pad = max(0, args.decode_rows - batch)
                p = Problem(args, [1] * batch + [0] * pad, ctx_lens + [0] * pad, shared)
                rows = batch + pad if pad else batch
                max_len = p.metadata.max_seq_len
                splits = paged.num_decode_splits(rows, args.num_kv_heads, max_len, sms)
                spread = f"+{args.context_spread}" if args.context_spread else ""
                name = f"decode b={batch} ctx={ctx}{spread} splits={splits}"
                if pad:
                    name += f" rows={rows}"
                if shared:
                    name += f" shared={shared}"
                report(name, bench(p.attend), p.bytes_moved(), p.flops(), args)
            if args.sweep_decode_tiles:
                for cfg in args.decode_tiles:
                    with patched("decode_tile_config", lambda *_, cfg=cfg: cfg, p):
                        times = bench(p.attend)
                    report(f"  {cfg}", times, p.bytes_moved(), p.flops(), args)
            if args.sweep_splits:
                for s in args.split_counts:
                    with patched("num_decode_splits", lambda *_, s=s: s, p):
                        times = bench(p.attend)
                    report(f"  splits={s}", times, p.bytes_moved(), p.flops(), args)
            if args.baseline:
                report(
                    "  torch sdpa (unpaged)",
                    bench(sdpa_baseline(p)),
                    p.bytes_moved(),
                    p.flops(),
                    args,
                )
            del p
            torch.cuda.empty_cache()


def run_prefill(args: argparse.Namespace) -> None:
    if args.uniform and args.prompt_splits:
        raise SystemExit("--prompt-splits: uniform grids take one key split; drop --uniform")
    print(f"\n== prefill, {args.num_heads}/{args.num_kv_heads} heads, D={args.head_dim}")
    shapes = [(t, 0, b) for t in args.prefill_tokens for b in args.prefill_batch]
    chunk_contexts = args.chunk_contexts
    if chunk_contexts is None:
        chunk_contexts = [c for c in args.contexts if c >= args.chunk_tokens]
    shapes += [(args.chunk_tokens, c, 1) for c in chunk_contexts]
    for tokens, ctx, batch in shapes:
        p = Problem(args, [tokens] * batch, [ctx] * batch)
        name = f"prefill tokens={tokens} ctx={ctx}" + (f" x{batch} prompts" if batch > 1 else "")
        if args.uniform:
            name += " uniform"
        report(name, bench(p.attend), p.bytes_moved(), p.flops(), args)
        tile_list = (args.prompt_tiles or TILE_SWEEP) if args.sweep_tiles else [None]
        for cfg in tile_list:
            for splits in args.prompt_splits or [None]:
                if cfg is None and splits is None:
                    continue
                tag = "  "
                with contextlib.ExitStack() as stack:
                    if cfg is not None:
                        stack.enter_context(patched("varlen_tile_config", lambda *_, c=cfg: c, p))
                        tag += (
                            f"tiles m={cfg.block_m} n={cfg.block_n} w={cfg.num_warps} "
                            f"s={cfg.num_stages} "
                        )
                    if splits is not None:
                        stack.enter_context(patched("num_varlen_splits", lambda *_, n=splits: n, p))
                        tag += f"splits={splits}"
                    times = bench(p.attend)
                report(tag.rstrip(), times, p.bytes_moved(), p.flops(), args)
        if args.baseline:
            report(
                "  torch sdpa (unpaged)", bench(sdpa_baseline(p)), p.bytes_moved(), p.flops(), args
            )


def _rope_writes(p: Problem, tokens: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """RoPE on ``p``'s query and key then the K/V write (two kernels), and the fused kernel."""
    d = p.args.head_dim
    table = RotaryEmbedding(d, d, 8192, 500000.0).cos_sin_cache.cuda()
    pos = torch.arange(tokens, device="cuda") % 8192
    slots = p.metadata.slot_mapping

    def rope_then_write() -> None:
        fused_kernels.rotary_inplace(pos, p.query, p.key, table, d, d, True)
        reshape_and_cache(p.key, p.value, p.kv_cache, slots, tokens)

    def rope_and_write() -> None:
        fused_kernels.rotary_and_cache(
            pos, p.query, p.key, p.value, table, d, d, True, p.kv_cache, slots, tokens
        )

    return rope_then_write, rope_and_write


def run_cache_write(args: argparse.Namespace) -> None:
    print("\n== reshape_and_cache")
    for tokens in args.prefill_tokens:
        p = Problem(args, [tokens], [0])
        md = p.metadata

        def write(p: Problem = p, md: AttentionMetadata = md, n: int = tokens) -> None:
            reshape_and_cache(p.key, p.value, p.kv_cache, md.slot_mapping, n)

        nbytes = 2 * 2 * p.key.numel() * p.elem  # read K/V, write K/V
        report(f"cache write tokens={tokens}", bench(write), nbytes, 0, args)
        rope_then_write, rope_and_write = _rope_writes(p, tokens)
        nbytes += 2 * p.query.numel() * p.elem  # the query rotated in place
        report(f"rope, then cache write tokens={tokens}", bench(rope_then_write), nbytes, 0, args)
        report(f"rope + cache write fused tokens={tokens}", bench(rope_and_write), nbytes, 0, args)


def print_compiled(kernel: object) -> None:
    """Registers, spills and shared memory of each compiled variant of a Triton kernel: they
    set how many programs an SM holds."""
    for caches in getattr(kernel, "device_caches", {}).values():
        for compiled in caches[0].values():
            md = compiled.metadata
            print(
                f"compiled {md.name}: warps {md.num_warps} stages {md.num_stages} "
                f"regs {compiled.n_regs} spills {compiled.n_spills} shared {md.shared} B"
            )


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"ceilings: {args.peak_gbps:.0f} GB/s, {args.peak_tflops:.0f} TFLOP/s ({args.dtype})")
    if args.decode_tile is not None:
        paged.decode_tile_config = lambda *_: args.decode_tile
        print(f"decode tiles: {args.decode_tile}")
    if args.only in (None, "decode"):
        run_decode(args)
        print_compiled(decode_kernels.decode_attention_kernel)
    if args.only in (None, "prefill"):
        run_prefill(args)
    if args.only in (None, "cache"):
        run_cache_write(args)


if __name__ == "__main__":
    main()

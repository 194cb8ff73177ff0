"""Is a mixed (decode + prompt chunk) step bound by the host or by the GPU?

usage: python3 benchmarks/device/mixed_step_bench.py MODEL_DIR [--shared-only | --kernels |
    --serving | --curve] [--cases "D,CTX,CHUNK,CACHED ..."]

For batches of ``D`` decode requests (context ``ctx``) plus one prompt chunk of ``P`` tokens
after ``pctx`` cached tokens, prints per forward pass (model only, no LM head):
- ``eager``: steady-state time of back-to-back eager passes (GPU time plus any gaps the
  host's kernel launches leave);
- ``launch``: host time to issue one eager pass;
- ``graph``: the same pass captured whole as one CUDA graph and replayed (GPU time with
  no launch gaps; a floor for any graph scheme);
- ``whole-step graph``: the runner's graph for mixed batches of the padded size (uniform
  attention grids: ``worker/mixed_graph.py``);
- ``piecewise``: the runner's piecewise graphs (attention eager between captured pieces),
  when the runner has them for that size; then again with the prompt kernel's keys never
  split (``num_varlen_splits`` forced to 1).

Cases with a shared prefix give their decodes the same first blocks (a prompt prefix found by
prefix caching); the timings above then read it once per request, and ``cascade`` repeats
the piecewise (and eager) pass with cascade attention reading it once per step.

``--kernels`` instead prints, for the ``KERNEL_CASES`` batches, the GPU time per pass of each
kernel (torch.profiler over whole-graph replays): where a mixed step's time goes.
``--serving`` runs the ``SERVING_CASES`` batches both ways (timings, then kernel tables).
``--curve`` times only the exact-layout and whole-step graphs of the ``SERVING_CASES``
batches: a step's cost against its token count, for many cases in one run.
``--cases "60,1152,228,512 ..."`` (decodes, context, chunk, cached) replaces the
``SERVING_CASES``.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from tokenmill import LLM
from tokenmill.kernels.attention import paged
from tokenmill.model.attention.backend import AttentionMetadata

# (decodes, decode context, prompt chunk tokens, cached tokens before the chunk[, prefix
# tokens the decodes share])
CASES = [
    (64, 2304, 0, 0, 2000),
    (64, 2304, 256, 2000, 2000),
    (8, 1280, 0, 0, 1024),
    (16, 1280, 0, 0, 1024),
    (32, 1280, 0, 0, 512),
    (128, 1280, 0, 0, 1024),
    (32, 1280, 256, 0, 1024),
    (64, 2304, 0, 0),
    (64, 2304, 16, 2000),
    (64, 2304, 64, 2000),
    (64, 2304, 256, 2000),
    (64, 2304, 512, 2000),
    (64, 1280, 512, 0),
    (64, 1280, 1024, 0),
    (64, 1280, 2048, 0),
    (8, 1280, 256, 0),
    (1, 1280, 512, 0),
    (0, 0, 512, 0),
    (0, 0, 2048, 0),
    (0, 0, 32, 8000),  # a new turn of a long conversation
    (16, 8192, 32, 8000),
]

# Decode-heavy steps of a serving load of 1024-token prompts: what a prompt chunk adds.
KERNEL_CASES = [(64, 1280, 0, 0), (64, 1280, 256, 0), (64, 1280, 512, 0), (0, 0, 512, 0)]
# The steps of a paced serving load (c=64, 1024/256, pacing 256; serving_profile.py): ~60
# decodes at ~1,150 tokens of context, alone or with a ~206-token chunk of a prompt that
# has 0-768 tokens cached.
SERVING_CASES = [(60, 1152, 0, 0), (60, 1152, 206, 0), (60, 1152, 206, 512), (60, 1152, 256, 768)]


def build_batch(
    runner, decodes: int, ctx: int, chunk: int, cached: int, gen: torch.Generator, shared: int = 0
):
    """Inputs and metadata of one mixed batch over random, distinct KV blocks, except the
    first ``shared`` tokens' blocks, which all decodes take from the first one."""
    bs = runner.block_size
    num_blocks = runner.num_blocks
    q_lens = [1] * decodes + ([chunk] if chunk else [])
    seq_lens = [ctx] * decodes + ([cached + chunk] if chunk else [])
    width = max(-(-s // bs) for s in seq_lens)
    need = sum(-(-s // bs) for s in seq_lens)
    perm = torch.randperm(num_blocks - 1, generator=gen)[:need] + 1
    table = torch.zeros(len(q_lens), width, dtype=torch.int32)
    slots, positions, at = [], [], 0
    for i, (q, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        nb = -(-s // bs)
        table[i, :nb] = perm[at : at + nb]
        at += nb
        for p in range(s - q, s):
            slots.append(int(table[i, p // bs]) * bs + p % bs)
            positions.append(p)
    table[1:decodes, : shared // bs] = table[0, : shared // bs]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    n = int(qsl[-1])
    d = runner.device
    md = AttentionMetadata(
        num_actual_tokens=n,
        num_reqs=len(q_lens),
        query_start_loc=qsl.to(d),
        seq_lens=seq.to(d),
        block_table=table.to(d),
        slot_mapping=torch.tensor(slots, device=d),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
        num_decodes=decodes,
    )
    ids = torch.randint(0, 1000, (n,), generator=gen).to(d)
    return ids, torch.tensor(positions, device=d), md


def per_pass_ms(fn, iters: int = 20) -> float:
    """Steady-state milliseconds per call of ``fn`` issued back to back."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def launch_ms(fn, iters: int = 5) -> float:
    """Host milliseconds to issue one call of ``fn`` (the GPU idle when it starts)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = (time.perf_counter() - t) / iters * 1e3
    torch.cuda.synchronize()
    return elapsed


@torch.inference_mode()
def main() -> None:
    llm = LLM(sys.argv[1], load_format="dummy", max_num_seqs=256)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    model = runner.model
    gen = torch.Generator().manual_seed(0)
    shared_only = "--shared-only" in sys.argv[2:]
    if "--kernels" in sys.argv[2:]:
        for case in KERNEL_CASES:
            kernel_table(model, case, *build_batch(runner, *case, gen))
        return
    serving = "--serving" in sys.argv[2:]
    curve = "--curve" in sys.argv[2:]
    serving_cases = SERVING_CASES
    if "--cases" in sys.argv and sys.argv[sys.argv.index("--cases") + 1].strip():
        cases = sys.argv[sys.argv.index("--cases") + 1].split()
        serving_cases = [tuple(int(x) for x in case.split(",")) for case in cases]
    for decodes, ctx, chunk, cached, *shared in serving_cases if serving or curve else CASES:
        shared = shared[0] if shared else 0
        if shared_only and not shared:
            continue
        ids, pos, md = build_batch(runner, decodes, ctx, chunk, cached, gen, shared)
        if curve:
            graph = capture_whole(model, ids, pos, md)
            whole = per_pass_ms(graph.replay)
            del graph
            line = (
                f"CURVE decodes={decodes} ctx={ctx} chunk={chunk} cached={cached} "
                f"tokens={md.num_actual_tokens}: graph {whole:.3f} ms"
            )
            if runner.graphs.mixed is not None and runner.graphs.mixed.can_run(
                md.num_actual_tokens
            ):
                line += mixed_timing(runner, runner.graphs.mixed, ids, pos, md)
            print(line, flush=True)
            continue
        eager_pass = lambda ids=ids, pos=pos, md=md: model(ids, pos, md)  # noqa: E731
        eager, launch = per_pass_ms(eager_pass), launch_ms(eager_pass)
        graph = capture_whole(model, ids, pos, md)
        whole = per_pass_ms(graph.replay)
        del graph
        line = (
            f"STEP mixed decodes={decodes} ctx={ctx} chunk={chunk} cached={cached} "
            f"shared={shared} tokens={md.num_actual_tokens}: eager {eager:.2f} ms, "
            f"launch {launch:.2f} ms, graph {whole:.2f} ms"
        )
        mixed = runner.graphs.mixed
        if mixed is not None and mixed.can_run(md.num_actual_tokens) and not shared:
            line += mixed_timing(runner, mixed, ids, pos, md)
        pieces = runner.graphs.piecewise
        if pieces is not None and pieces.can_run(md.num_actual_tokens):
            line += piecewise_timing(runner, pieces, ids, pos, md)
            if shared:
                cmd = dataclasses.replace(md, common_prefix_len=shared)  # whole blocks
                cascade_eager = per_pass_ms(lambda i=ids, p=pos, m=cmd: model(i, p, m))
                line += f"; cascade: eager {cascade_eager:.2f} ms" + piecewise_timing(
                    runner, pieces, ids, pos, cmd
                )
                print(line, flush=True)
                continue
            # The same with the prompt kernel's keys never split (its one-split path).
            split_rule = paged.num_varlen_splits
            paged.num_varlen_splits = lambda *args: 1
            try:
                line += "; one key split:" + piecewise_timing(runner, pieces, ids, pos, md)
            finally:
                paged.num_varlen_splits = split_rule
        print(line, flush=True)
    if serving:
        for case in SERVING_CASES:
            kernel_table(model, case, *build_batch(runner, *case, gen))


def capture_whole(model, ids, pos, md) -> torch.cuda.CUDAGraph:
    """One forward pass of the batch captured whole, after a warm-up pass on a side stream."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model(ids, pos, md)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        model(ids, pos, md)
    return graph


def kernel_table(model, case, ids, pos, md, passes: int = 5) -> None:
    """Print the GPU microseconds per pass of each kernel of ``case``'s whole-graph pass."""
    from torch.profiler import ProfilerActivity, profile

    graph = capture_whole(model, ids, pos, md)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(passes):
            graph.replay()
        torch.cuda.synchronize()
    from kernel_profile import kernel_totals  # this folder is on sys.path

    totals, counts = kernel_totals(prof, 70)
    totals = {name: us / passes for name, us in totals.items()}
    print(
        f"KERNELS decodes/ctx/chunk/cached={case}: {sum(totals.values()) / 1e3:.2f} ms "
        "of kernels per pass",
        flush=True,
    )
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:12]:
        print(f"KERNELS   {us:9.1f} us  x{counts[name] // passes:<4d} {name}", flush=True)


def piecewise_timing(runner, pieces, ids, pos, md) -> str:
    """Steady-state and launch time of the runner's piecewise graphs on this batch, and the
    launch time's split between graph replays and eager attention calls."""
    n = md.num_actual_tokens
    runner.input_ids.device[:n].copy_(ids)
    runner.positions.device[:n].copy_(pos)
    runner.slot_mapping.device[:n].copy_(md.slot_mapping)
    ms, launch = per_pass_ms(lambda: pieces.run(n, md)), launch_ms(lambda: pieces.run(n, md))
    replay, attend = host_split_ms(pieces, n, md)
    return (
        f", piecewise {ms:.2f} ms (launch {launch:.2f} ms: replays {replay:.2f}, attention "
        f"{attend:.2f}; size {pieces.padded_size(n)})"
    )


def mixed_timing(runner, mixed, ids, pos, md) -> str:
    """Steady-state and launch time of the runner's whole-step graph for this batch (its
    layout copied into the runner's buffers, which that graph reads)."""
    n, r = md.num_actual_tokens, md.num_reqs
    runner.input_ids.device[:n].copy_(ids)
    runner.positions.device[:n].copy_(pos)
    runner.slot_mapping.device[:n].copy_(md.slot_mapping)
    runner.query_start_loc.device[: r + 1].copy_(md.query_start_loc)
    runner.seq_lens.device[:r].copy_(md.seq_lens)
    width = md.block_table.shape[1]
    runner.block_table.device[:r, :width].copy_(md.block_table)
    d = md.num_decodes
    # The runner stages the prefill range with a step's inputs; here the buffers are set by hand.
    runner.prefill_range.device.copy_(torch.tensor([d, r - d], dtype=torch.int32))
    ms, launch = per_pass_ms(lambda: mixed.run(n, r)), launch_ms(lambda: mixed.run(n, r))
    return f", whole-step graph {ms:.2f} ms (launch {launch:.2f} ms; size {mixed.padded_size(n)})"


def host_split_ms(pieces, n: int, md, iters: int = 5) -> tuple[float, float]:
    """Host milliseconds of one piecewise pass spent replaying graphs and in the eager
    attention calls between them (the GPU idle when each pass starts)."""
    size = pieces.padded_size(n)
    graphs = pieces.graphs[size]
    replay = attend = 0.0
    for _ in range(iters):
        torch.cuda.synchronize()
        for graph, (layer, query, out) in zip(graphs, pieces.calls, strict=False):
            t = time.perf_counter()
            graph.replay()
            t2 = time.perf_counter()
            layer.attend(query[:size], md, out=out[:size])
            replay += t2 - t
            attend += time.perf_counter() - t2
        graphs[-1].replay()
    torch.cuda.synchronize()
    return replay / iters * 1e3, attend / iters * 1e3


if __name__ == "__main__":
    main()

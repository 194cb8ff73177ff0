"""Where a served step's time goes: the engine core under a closed-loop load, no HTTP.

usage: python3 benchmarks/device/serving_profile.py MODEL_DIR [--pacing N] [--pacing-mode M]
    [--concurrency 64] [--input-len 1024] [--output-len 256] [--warm-requests 128]
    [--window-steps 300] [--sweep PACING:QUEUE_LIMIT:MAX_NUM_SEQS ...]

The engine core of ``tokenmill serve`` (the server's configuration, ``--load-format dummy``)
runs ``--concurrency`` random-token requests at a time, each replaced by a new one as it
finishes, as ``vllm bench serve --max-concurrency`` drives a server. After
``--warm-requests`` have finished (the load has settled), three windows of
``--window-steps`` steps (a third of that for ``host``) measure:

- ``timing``: step wall time, the decodes and prompt tokens per step, and the median TTFT
  and TPOT of the requests that finished in it (engine-side: no HTTP, no detokenizing);
  per kind of step (decode-only, or by prompt tokens) the wall time and the GPU span from
  the step's first launch to its last kernel (CUDA events);
- ``gpu``: GPU busy time per step and the kernels' totals (torch.profiler, CUDA only);
- ``host``: the engine thread's functions with the most own time (cProfile, which slows
  the host: its step times are not comparable).

With ``--sweep``, one engine runs each scheduling policy in turn (prefill pacing tokens,
the queued tokens past which pacing stops, the most running requests; 0 keeps the
server's value), each after ``--warm-requests`` finish under it, with a timing window of
twice ``--window-steps`` and no profiles: a way to compare admission policies on the GPU
in seconds each.

A step is host-bound where its wall time exceeds its GPU span. One line per figure,
prefixed ``SPROF``. One configuration per process: the KV cache takes the GPU's memory.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np
import torch
from kernel_profile import kernel_totals  # this folder is on sys.path as the script's own
from torch.profiler import ProfilerActivity, profile

from tokenmill.core.engine_io import EngineCoreRequest
from tokenmill.core.prefill_pacing import PrefillPacing
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine_args import EngineArgs
from tokenmill.kernels.attention import paged
from tokenmill.kernels.attention.launch import TileConfig
from tokenmill.sampling_params import SamplingParams


def step_kind(prompt_tokens: int) -> str:
    """A step's bucket: decode-only, or its prompt tokens rounded up to a power of two."""
    if prompt_tokens == 0:
        return "decode-only"
    return f"prompt<={min(8192, 1 << (prompt_tokens - 1).bit_length())}"


class ClosedLoop:
    """``concurrency`` requests in flight over an EngineCore; finished ones are replaced."""

    def __init__(self, core: EngineCore, args: argparse.Namespace, vocab: int) -> None:
        self.core = core
        self.args = args
        self.rng = np.random.default_rng(0)
        self.vocab = vocab
        self.params = SamplingParams(
            temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len
        )
        self.next_id = 0
        self.sent: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.finished: list[tuple[float, float, float]] = []  # (sent, first token, end)
        self.step_log: list[tuple[float, int, int]] = []  # (wall s, decodes, prompt tokens)
        self._composition = (0, 0)
        # (kind, start event, end event) of each launched step while ``spans`` is a list.
        self.spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] | None = None
        for name in ("execute_model", "execute_model_async"):
            setattr(core.executor, name, self._recording(getattr(core.executor, name)))
        for _ in range(args.concurrency):
            self.send()

    def _recording(self, execute):
        """``execute`` that first notes the step's decodes and prompt tokens."""

        def recorded(so):
            if not so.total_num_scheduled_tokens:
                return execute(so)
            decodes = sum(1 for n in so.num_scheduled_tokens.values() if n == 1)
            self._composition = (decodes, so.total_num_scheduled_tokens - decodes)
            if self.spans is None:
                return execute(so)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = execute(so)
            end.record()
            self.spans.append((step_kind(self._composition[1]), start, end))
            return result

        return recorded

    def send(self) -> None:
        rid = str(self.next_id)
        self.next_id += 1
        prompt = self.rng.integers(0, self.vocab - 1000, self.args.input_len).tolist()
        now = time.time()
        self.sent[rid] = now
        self.core.add_request(EngineCoreRequest(rid, prompt, self.params, now))

    def step(self) -> None:
        launched_before = self._composition
        start = time.perf_counter()
        outputs = self.core.step()
        wall = time.perf_counter() - start
        # With async scheduling a call waits for the step the previous call launched.
        waited_for = launched_before if self.core.async_scheduling else self._composition
        self.step_log.append((wall, *waited_for))
        now = time.time()
        for out in outputs.outputs:
            rid = out.request_id
            if out.new_token_ids and rid not in self.first:
                self.first[rid] = now
            if out.finish_reason is not None:
                self.finished.append((self.sent.pop(rid), self.first.pop(rid, now), now))
                self.send()

    def run_steps(self, n: int) -> None:
        for _ in range(n):
            self.step()


def timing_window(loop: ClosedLoop, steps: int, label: str) -> None:
    loop.step_log.clear()
    done = len(loop.finished)
    cuda = torch.cuda.is_available()
    loop.spans = [] if cuda else None
    start = time.perf_counter()
    loop.run_steps(steps)
    wall = time.perf_counter() - start
    walls = [w for w, _, _ in loop.step_log]
    decodes = [d for _, d, _ in loop.step_log]
    prompt = [p for _, _, p in loop.step_log]
    finished = loop.finished[done:]
    out_len = loop.args.output_len
    print(
        f"SPROF {label} timing: {steps} steps in {wall:.2f} s, step mean "
        f"{1e3 * statistics.mean(walls):.2f} ms p50 {1e3 * statistics.median(walls):.2f} ms "
        f"max {1e3 * max(walls):.1f} ms; decodes/step {statistics.mean(decodes):.1f}, prompt "
        f"tokens/step {statistics.mean(prompt):.1f}; output tok/s {sum(decodes) / wall:.0f}",
        flush=True,
    )
    if finished:
        ttft = statistics.median(f - s for s, f, _ in finished)
        tpot = statistics.median((e - f) / (out_len - 1) for _, f, e in finished)
        print(
            f"SPROF {label} requests: {len(finished)} finished, TTFT p50 {1e3 * ttft:.1f} ms, "
            f"TPOT p50 {1e3 * tpot:.2f} ms, {len(finished) / wall:.2f} req/s",
            flush=True,
        )
    # Step time by composition: decode-only steps, and steps with prompt tokens by size;
    # the GPU span runs from a step's first launch to its last kernel's end.
    buckets: dict[str, list[float]] = {}
    for w, _, p in loop.step_log:
        buckets.setdefault(step_kind(p), []).append(w)
    spans: dict[str, list[float]] = {}
    if cuda:
        torch.cuda.synchronize()
        for kind, begin, end in loop.spans:
            spans.setdefault(kind, []).append(begin.elapsed_time(end) / 1e3)
        loop.spans = None
    for key, ws in sorted(buckets.items()):
        span = (
            f", GPU span p50 {1e3 * statistics.median(spans[key]):6.2f} ms"
            if spans.get(key)
            else ""
        )
        print(
            f"SPROF {label} steps {key:>14s}: x{len(ws):<4d} wall p50 "
            f"{1e3 * statistics.median(ws):6.2f} ms{span}",
            flush=True,
        )


def gpu_window(loop: ClosedLoop, steps: int, label: str) -> None:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        loop.run_steps(steps)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    totals, counts = kernel_totals(prof, 80)
    busy = sum(totals.values()) / 1e6
    print(
        f"SPROF {label} gpu: wall {1e3 * wall / steps:.2f} ms/step, GPU busy "
        f"{1e3 * busy / steps:.2f} ms/step ({100 * busy / wall:.1f}%)",
        flush=True,
    )
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:20]:
        print(
            f"SPROF {label} kernel {us / 1e3 / steps:7.3f} ms/step {100 * us / 1e6 / wall:5.1f}%"
            f" x{counts[name] / steps:<5.1f} {name}",
            flush=True,
        )


def host_window(loop: ClosedLoop, steps: int, label: str) -> None:
    prof = cProfile.Profile()
    prof.enable()
    loop.run_steps(steps)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    for line in buf.getvalue().splitlines():
        if line.strip():
            print(f"SPROF {label} host {line}", flush=True)


def set_policy(core: EngineCore, spec: str, server_max_num_seqs: int) -> str:
    """Apply a ``PACING:QUEUE_LIMIT:MAX_NUM_SEQS[:STEP_TOKENS]`` policy to the running
    scheduler (0 takes the server's queue limit and ``server_max_num_seqs``; pacing 0 turns
    pacing off; STEP_TOKENS > 0 paces to that many tokens per step, decodes included, as
    ``--prefill-pacing-mode step`` does);
    returns the policy's label."""
    pacing, queue_limit, max_num_seqs, *rest = (int(x) for x in spec.split(":"))
    step_tokens = rest[0] if rest else 0
    sched = core.scheduler
    if step_tokens:
        sched.pacing = PrefillPacing(
            step_tokens, sched.max_num_batched_tokens, queue_limit or None, count_decodes=True
        )
    elif pacing:
        sched.pacing = PrefillPacing(pacing, sched.max_num_batched_tokens, queue_limit or None)
    else:
        sched.pacing = None
    sched.max_num_seqs = max_num_seqs or server_max_num_seqs
    return f"p{pacing}q{queue_limit}s{max_num_seqs}" + (f"t{step_tokens}" if step_tokens else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--pacing", type=int, default=256)
    parser.add_argument("--pacing-mode", choices=["prompt", "step"], default="prompt")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--warm-requests", type=int, default=128)
    parser.add_argument("--window-steps", type=int, default=300)
    parser.add_argument("--no-host", action="store_true", help="skip the cProfile window")
    parser.add_argument("--sweep", nargs="+", default=[], metavar="P:Q:S")
    parser.add_argument(
        "--decode-tile",
        default=None,
        metavar="KEYS:WARPS:STAGES",
        help="the decode attention kernel's tile for every launch (the heuristic's otherwise)",
    )
    args = parser.parse_args()
    if args.decode_tile:
        keys, warps, stages = (int(x) for x in args.decode_tile.split(":"))
        tile = TileConfig(block_m=16, block_n=keys, num_warps=warps, num_stages=stages)
        paged.decode_tile_config = lambda *_: tile
    engine_args = EngineArgs(
        model=args.model,
        load_format="dummy",
        prefill_pacing_tokens=args.pacing,
        prefill_pacing_mode=args.pacing_mode if args.pacing else None,
    )
    core = EngineCore(engine_args.create_engine_config("server"))
    loop = ClosedLoop(core, args, core.config.model_config.vocab_size)
    label = f"pace{args.pacing}" + ("step" if args.pacing_mode == "step" else "")
    if args.sweep:
        server_max_num_seqs = core.scheduler.max_num_seqs
        for spec in args.sweep:
            label = set_policy(core, spec, server_max_num_seqs)
            warm_until = len(loop.finished) + args.warm_requests
            while len(loop.finished) < warm_until:
                loop.step()
            timing_window(loop, 2 * args.window_steps, label)
        core.shutdown()
        return
    while len(loop.finished) < args.warm_requests:
        loop.step()
    timing_window(loop, args.window_steps, label)
    if torch.cuda.is_available():
        gpu_window(loop, args.window_steps, label)
    if not args.no_host:
        host_window(loop, args.window_steps // 3, label)
    core.shutdown()


if __name__ == "__main__":
    main()

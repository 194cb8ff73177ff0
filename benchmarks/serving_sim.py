"""Closed-loop serving simulator: the real Scheduler against a step-time model.

Scheduling policies change how a closed-loop load settles (bursts that stay together, or
arrivals that spread out), which decides median TTFT and TPOT far more than any kernel.
This drives tokenmill's own ``Scheduler`` (async scheduling: step n+1 is planned while
step n runs) with simulated clients, front end and device, so a policy can be swept over
loads on a CPU in seconds before it is measured on the GPU:

- ``--max-concurrency`` clients, each sending its next request when the previous one ends
  (the shape of ``vllm bench serve --max-concurrency``); ``--num-prompts`` in all.
- A tokenizer pool of ``--tokenizer-workers`` threads, ``--tokenize-ms`` per 2,256-token
  prompt (scaled by prompt length, +-20% jitter), plus 1 ms of HTTP in and 1.5 ms out.
- Step time (ms) = 5.0 + 0.02 x decodes + 1.5e-5 x their context tokens
  + ``--prefill-ms-per-token`` x prompt tokens (+1 ms for an eager step with prompt tokens).
  Fitted to Llama-3.1-8B on an H200 (benchmarks/RESULTS.md, third and fourth sets):
  a decode step of 64 requests at ~2.3k context takes ~8.6 ms, one at ~1.2k ~7.3 ms, an
  8,192-token prefill step ~205 ms.

The figures are a model's, for comparing policies; only the GPU measures.

Usage:
    python benchmarks/serving_sim.py --load prefix --prefill-pacing-tokens 0 512 1024
    python benchmarks/serving_sim.py --load random --measured --prefill-pacing-tokens 256 \
        --prefill-pacing-mode step
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from dataclasses import dataclass

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.sampling_params import SamplingParams

# (prefix tokens, input tokens, output tokens) of the two loads of the serving benchmarks.
LOADS = {"prefix": (2000, 256, 128), "random": (0, 1024, 256)}
HTTP_IN_S, HTTP_OUT_S = 1e-3, 1.5e-3


@dataclass
class SimConfig:
    """One simulated run: the load (a key of ``LOADS``), the scheduler's token budget and
    pacing (tokens), the clients, and the front end and device models (ms)."""

    load: str = "prefix"
    budget: int = 8192
    pacing: int = 0
    pacing_mode: str = "prompt"
    concurrency: int = 64
    num_prompts: int = 500
    tokenizer_workers: int = 8
    tokenize_ms: float = 6.0
    prefill_ms_per_token: float = 0.024
    roofline: bool = False
    served: bool = False
    measured: bool = False
    seed: int = 0


# Whole-step graph replays of 60 decodes at 1,152 tokens of context + a chunk after 512
# cached tokens, by the step's padded tokens (ms; RESULTS.md eleventh set, ``mixedcurve``).
# At 320-384 tokens the exact-layout graphs' figures stand in: there a chunk of more than
# 256 tokens runs a second wave of prompt-kernel programs, which paced chunks never do.
MEASURED_STEP_MS = [
    (64, 6.85),
    (160, 8.25),
    (192, 8.96),
    (224, 9.59),
    (256, 9.75),
    (272, 10.41),
    (288, 10.78),
    (304, 10.87),
    (320, 11.14),
    (352, 12.10),
    (384, 12.28),
    (416, 14.04),
    (448, 17.37),
    (512, 14.70),
    (576, 17.65),
]


def measured_step_ms(tokens: int, context: int) -> float:
    """``MEASURED_STEP_MS`` at the graph size that holds ``tokens`` (16-token steps from
    256, powers of two below), plus 3.5e-5 ms per token of decode context away from the
    table's 60 x 1,152; beyond 576 tokens, 23 us per token more."""
    padded = 1 << max(0, tokens - 1).bit_length() if tokens <= 256 else -(-tokens // 16) * 16
    extra = 3.5e-5 * (context - 60 * 1152)
    if padded > MEASURED_STEP_MS[-1][0]:
        return MEASURED_STEP_MS[-1][1] + 0.023 * (tokens - MEASURED_STEP_MS[-1][0]) + extra
    for (lo, lo_ms), (hi, hi_ms) in zip(MEASURED_STEP_MS, MEASURED_STEP_MS[1:], strict=False):
        if padded <= lo:
            return lo_ms * max(padded, 32) / lo + extra if lo == 64 else lo_ms + extra
        if padded <= hi:
            return lo_ms + (hi_ms - lo_ms) * (padded - lo) / (hi - lo) + extra
    raise AssertionError("unreachable")


def step_time_s(
    sched: Scheduler,
    so: SchedulerOutput,
    prefill_ms_per_token: float,
    roofline: bool = False,
    served: bool = False,
    measured: bool = False,
) -> float:
    """The modelled device time of one step (seconds): the linear model above, or with
    ``roofline`` the products' time as the larger of reading the weights (3.9 ms) and
    computing on every token (20.5 us/token), plus the decodes' K/V reads, 2.5 us per
    prompt token of attention and element-wise work, and 0.5 ms for a mixed step's eager
    attention between piecewise graphs. Fitted to per-kernel profiles of Llama-3.1-8B
    steps on an H200 (``mixed_step_bench.py --kernels``): 64 decodes at 1,280 tokens take
    7.0 ms, with a 256-token chunk 10.6 ms, with a 512-token chunk 15.9 ms; so a prompt
    chunk's marginal cost per token is lowest while a step is still bound by its weight
    reads, which the linear model misses."""
    prompt = decodes = context = 0
    for req_id, n in so.num_scheduled_tokens.items():
        request = sched.requests.get(req_id)
        if n == 1 and request is not None and request.num_output_tokens > 0:
            decodes += 1
            context += request.num_computed_tokens
        else:
            prompt += n
    if measured:
        return measured_step_ms(decodes + prompt, context) / 1e3
    if served:
        # Fitted to serving_profile.py's step times (RESULTS.md, eighth set): decode-only
        # steps of ~60 requests at ~1.15k context 7.42 ms, with a <=256-token chunk
        # 11.78 ms, with an 8,192-token budget 193.5 ms.
        per_token = 0.017 if prompt <= 512 else 0.023
        return (5.1 + 3.5e-5 * context + per_token * prompt) / 1e3
    if roofline:
        products = max(3.9, 0.0205 * (decodes + prompt))
        ms = 0.6 + products + 3.4e-5 * context + 0.0025 * prompt
        return (ms + (0.5 if prompt else 0.0)) / 1e3
    ms = 5.0 + 0.02 * decodes + 1.5e-5 * context + prefill_ms_per_token * prompt
    return (ms + (1.0 if prompt else 0.0)) / 1e3


def simulate(cfg: SimConfig) -> dict[str, float]:
    """Run one closed-loop load; returns median TTFT/TPOT (ms, clients after the first
    burst), the mean and p99 TTFT of all requests (ms), mean front-end delay (ms) and
    request throughput (req/s)."""
    prefix_len, input_len, output_len = LOADS[cfg.load]
    rng = random.Random(cfg.seed)
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=cfg.budget,
            max_num_seqs=1024,
            max_model_len=8192,
            async_scheduling=True,
            prefill_pacing_tokens=cfg.pacing,
            prefill_pacing_mode=cfg.pacing_mode,  # type: ignore[arg-type]
        ),
        CacheConfig(block_size=16, enable_prefix_caching=True),
        num_blocks=55000,
    )
    prefix = [rng.randrange(1000, 100000) for _ in range(prefix_len)]
    tokenize_s = (prefix_len + input_len) / 2256 * cfg.tokenize_ms / 1e3
    workers = [0.0] * cfg.tokenizer_workers
    arrivals: list[tuple[float, int, Request]] = []
    # request index -> [sent, reached the engine, first token, finished]
    times: dict[int, list[float | None]] = {}

    def send(at: float) -> None:
        index = len(times)
        prompt = prefix + [rng.randrange(1000, 100000) for _ in range(input_len)]
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        start = max(heapq.heappop(workers), at + HTTP_IN_S)
        done = start + tokenize_s * (0.8 + 0.4 * rng.random())
        heapq.heappush(workers, done)
        request = Request(str(index), prompt, params, arrival_time=at)
        heapq.heappush(arrivals, (done, index, request))
        times[index] = [at, done, None, None]

    def collect(so: SchedulerOutput, end: float) -> None:
        sampled = []
        for req_id in so.num_scheduled_tokens:
            r = sched.requests.get(req_id)
            # A step samples for a request whose known tokens it computed all of (the
            # scheduler counts that sample as a placeholder already).
            known = 0 if r is None else r.num_tokens + r.num_output_placeholders - 1
            sampled.append([7] if r is not None and r.num_computed_tokens >= known else [])
        runner = ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens), sampled_token_ids=sampled)
        for out in sched.update_from_output(so, runner).outputs:
            t = times[int(out.request_id)]
            if t[2] is None and out.new_token_ids:
                t[2] = end + HTTP_OUT_S
            if out.finish_reason is not None:
                t[3] = end + HTTP_OUT_S
                if len(times) < cfg.num_prompts:
                    send(end + HTTP_OUT_S)

    for _ in range(cfg.concurrency):
        send(0.0)
    now, pending = 0.0, None  # pending: (plan, end time) of the step in flight
    while any(t[3] is None for t in times.values()):
        while arrivals and arrivals[0][0] <= now:
            sched.add_request(heapq.heappop(arrivals)[2])
        so = sched.schedule() if sched.has_unfinished_requests() else None
        if so is None or so.total_num_scheduled_tokens == 0:
            if pending is not None:
                now = max(now, pending[1])
                collect(*pending)
                pending = None
            elif arrivals:
                now = arrivals[0][0]
            continue
        start = max(now + 1e-3, pending[1] if pending else 0.0)
        if pending is not None:
            now = max(now, pending[1])
            collect(*pending)
        else:
            now += 1e-3
        pending = (
            so,
            start
            + step_time_s(
                sched, so, cfg.prefill_ms_per_token, cfg.roofline, cfg.served, cfg.measured
            ),
        )
    later = [t for i, t in times.items() if i >= cfg.concurrency]
    ttfts = sorted(t[2] - t[0] for t in times.values())
    return {
        "ttft_mean_all_ms": 1e3 * statistics.mean(ttfts),
        "ttft_p99_all_ms": 1e3 * ttfts[int(0.99 * (len(ttfts) - 1))],
        "ttft_p50_ms": 1e3 * statistics.median(t[2] - t[0] for t in later),
        "tpot_p50_ms": 1e3 * statistics.median((t[3] - t[2]) / (output_len - 1) for t in later),
        "front_end_ms": 1e3 * statistics.mean(t[1] - t[0] for t in later),
        "req_per_s": len(times) / max(t[3] for t in times.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", choices=sorted(LOADS), nargs="+", default=sorted(LOADS))
    parser.add_argument("--prefill-pacing-tokens", type=int, nargs="+", default=[0, 512, 1024])
    parser.add_argument("--prefill-pacing-mode", choices=["prompt", "step"], default="prompt")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--tokenizer-workers", type=int, default=8)
    parser.add_argument("--tokenize-ms", type=float, default=6.0)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.024)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument(
        "--measured", action="store_true", help="the measured step table (MEASURED_STEP_MS)"
    )
    parser.add_argument(
        "--roofline", action="store_true", help="the roofline step model (see step_time_s)"
    )
    parser.add_argument(
        "--served", action="store_true", help="the step model fitted to served steps"
    )
    args = parser.parse_args()
    for load in args.load:
        for pacing in args.prefill_pacing_tokens:
            for seed in range(args.seeds):
                cfg = SimConfig(
                    load=load, budget=args.max_num_batched_tokens, pacing=pacing,
                    pacing_mode=args.prefill_pacing_mode,
                    concurrency=args.max_concurrency, num_prompts=args.num_prompts,
                    tokenizer_workers=args.tokenizer_workers, tokenize_ms=args.tokenize_ms,
                    prefill_ms_per_token=args.prefill_ms_per_token, roofline=args.roofline,
                    served=args.served, measured=args.measured, seed=seed,
                )  # fmt: skip
                r = simulate(cfg)
                print(
                    f"{load:6s} pacing {pacing:5d} seed {seed}: TTFT p50 {r['ttft_p50_ms']:6.1f} ms"
                    f"  TPOT p50 {r['tpot_p50_ms']:5.2f} ms  front end {r['front_end_ms']:5.1f} ms"
                    f"  {r['req_per_s']:5.1f} req/s",
                    flush=True,
                )


if __name__ == "__main__":
    main()

"""Host cost of one decode step's scheduling and output bookkeeping (no model).

The real Scheduler and KV cache manager with N running requests of 256-token prompts:
after their prefill, each step is ``schedule()`` then ``update_from_output()`` with one
sampled token per request. Prints the mean per step of each part, in milliseconds. This is
the engine's per-step host work that bounds throughput when the model step is short.

    python benchmarks/scheduler_step_bench.py [--requests 512] [--steps 300]
"""

from __future__ import annotations

import argparse
import random
import time

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams


def measure(num_requests: int, num_steps: int, block_size: int = 16) -> tuple[float, float]:
    """Mean (schedule, update) seconds per decode step."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=16384,
            max_num_seqs=max(1024, num_requests),
            max_model_len=4096,
            enable_chunked_prefill=True,
            async_scheduling=False,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=True),
        num_blocks=num_requests * (4096 // block_size),
    )
    rng = random.Random(0)
    params = SamplingParams(max_tokens=num_steps + 16, ignore_eos=True)
    for i in range(num_requests):
        prompt = [rng.randrange(100, 30000) for _ in range(256)]
        sched.add_request(Request(str(i), prompt, params))
    total_schedule = total_update = 0.0
    for step in range(num_steps + 8):  # the first steps are the prefill
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        ids = list(plan.num_scheduled_tokens)
        output = ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids])
        t2 = time.perf_counter()
        sched.update_from_output(plan, output)
        t3 = time.perf_counter()
        if step >= 8:
            total_schedule += t1 - t0
            total_update += t3 - t2
    return total_schedule / num_steps, total_update / num_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    schedule_s, update_s = measure(args.requests, args.steps)
    print(
        f"{args.requests} running requests: schedule {schedule_s * 1e3:.3f} ms + "
        f"update_from_output {update_s * 1e3:.3f} ms = {(schedule_s + update_s) * 1e3:.3f} ms "
        "per decode step"
    )


if __name__ == "__main__":
    main()

"""Where the GPU's time goes on a throughput workload: torch.profiler kernel totals.

usage: python3 benchmarks/device/kernel_profile.py MODEL_DIR [NUM_PROMPTS] [IN] [OUT]
Prints the kernels with the most GPU time (grouped by name), their share of the run's wall
time, and how much of the wall time the GPU was busy.
"""

from __future__ import annotations

import sys
import time

import torch
from profile_step import offline_workload  # this folder is on sys.path as the script's own
from torch.profiler import ProfilerActivity, profile


def kernel_totals(prof, width: int) -> tuple[dict[str, float], dict[str, int]]:
    """GPU microseconds and launch counts per kernel name (cut to ``width`` characters) of
    a finished ``torch.profiler.profile``."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name[:width]
        totals[name] = totals.get(name, 0.0) + event.device_time_total
        counts[name] = counts.get(name, 0) + 1
    return totals, counts


def main() -> None:
    llm, prompts, params, n, in_len, out_len = offline_workload(sys.argv, 300, 1024, 256, 64)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    totals, counts = kernel_totals(prof, 90)
    busy = sum(totals.values()) / 1e6
    print(f"KPROF {n} prompts {in_len}/{out_len}: wall {wall:.2f} s, GPU busy {busy:.2f} s "
          f"({100 * busy / wall:.1f}%)")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:30]:
        print(f"KPROF {us / 1e6:8.3f} s {100 * us / 1e6 / wall:5.1f}%  x{counts[name]:<6d} {name}")


if __name__ == "__main__":
    main()

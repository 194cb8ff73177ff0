"""Where the GPU's time goes on a throughput workload: torch.profiler kernel totals.

usage: python3 benchmarks/device/kernel_profile.py MODEL_DIR [NUM_PROMPTS] [IN] [OUT]
Prints the kernels with the most GPU time (grouped by name), their share of the run's wall
time, and how much of the wall time the GPU was busy.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams


def main() -> None:
    model = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    in_len = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    out_len = int(sys.argv[4]) if len(sys.argv) > 4 else 256
    llm = LLM(model, load_format="dummy")
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": rng.integers(0, vocab - 1000, in_len).tolist()} for _ in range(n)
    ]
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=out_len)
    llm.generate(prompts[:64], params, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name[:90]
        totals[name] = totals.get(name, 0.0) + event.device_time_total
        counts[name] = counts.get(name, 0) + 1
    busy = sum(totals.values()) / 1e6
    print(f"KPROF {n} prompts {in_len}/{out_len}: wall {wall:.2f} s, GPU busy {busy:.2f} s "
          f"({100 * busy / wall:.1f}%)")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:30]:
        print(f"KPROF {us / 1e6:8.3f} s {100 * us / 1e6 / wall:5.1f}%  x{counts[name]:<6d} {name}")


if __name__ == "__main__":
    main()

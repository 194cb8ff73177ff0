"""One batch-1 greedy request (32 prompt tokens, OUT output tokens) on a dummy-weight model:
a plain driver for tools that watch the kernels from outside, such as Nsight Compute.

The KV cache is 3 GiB instead of most of the GPU: Nsight Compute's kernel replay saves and
restores device memory around every pass, and with the default cache (~108 GiB on an H200)
it profiled four kernels in six minutes. The longest request is 16,384 tokens, which still
plans a batch-1 decode grid of 33 key splits, as the default length does.

usage: python3 benchmarks/device/batch1_generate.py MODEL_DIR [OUT]
"""

from __future__ import annotations

import sys

from profile_step import offline_workload  # this folder is on sys.path as the script's own

from tokenmill import SamplingParams


def main() -> None:
    out_len = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    argv = [sys.argv[0], sys.argv[1], "1", "32", str(out_len)]
    llm, prompts, _, _, _, _ = offline_workload(
        argv, 1, 32, out_len, warm_up=0, kv_cache_memory=3 << 30, max_model_len=16384
    )
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    out = llm.generate(prompts[0], params, use_tqdm=False)
    print(f"BATCH1 generated {len(out[0].outputs[0].token_ids)} tokens")


if __name__ == "__main__":
    main()

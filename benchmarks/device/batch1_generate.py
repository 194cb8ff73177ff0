"""One batch-1 greedy request (32 prompt tokens, OUT output tokens) on a dummy-weight model:
a plain driver for tools that watch the kernels from outside, such as Nsight Compute.

usage: python3 benchmarks/device/batch1_generate.py MODEL_DIR [OUT]
"""

from __future__ import annotations

import sys

import numpy as np

from tokenmill import LLM, SamplingParams


def main() -> None:
    out_len = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    llm = LLM(sys.argv[1], load_format="dummy")
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompt = {"prompt_token_ids": np.random.default_rng(0).integers(0, vocab - 1000, 32).tolist()}
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)
    print(f"BATCH1 generated {len(out[0].outputs[0].token_ids)} tokens")


if __name__ == "__main__":
    main()

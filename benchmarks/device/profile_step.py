"""Where an offline run's time goes: cProfile of the engine loop on a throughput workload.

usage: python3 benchmarks/device/profile_step.py MODEL_DIR [NUM_PROMPTS] [IN] [OUT]
Prints the functions with the most own time and the engine phases' cumulative time.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import numpy as np

from tokenmill import LLM, SamplingParams


def offline_workload(
    argv: list[str],
    default_n: int,
    default_in: int,
    default_out: int,
    warm_up: int = 32,
    **llm_kwargs,
) -> tuple[LLM, list[dict], SamplingParams, int, int, int]:
    """``MODEL_DIR [NUM_PROMPTS] [IN] [OUT]`` from ``argv``: a dummy-weight LLM (built with
    ``llm_kwargs`` too) warmed up on ``warm_up`` prompts, random token prompts and
    ``ignore_eos`` sampling parameters (as ``tokenmill bench throughput``'s random dataset)."""
    n = int(argv[2]) if len(argv) > 2 else default_n
    in_len = int(argv[3]) if len(argv) > 3 else default_in
    out_len = int(argv[4]) if len(argv) > 4 else default_out
    llm = LLM(argv[1], load_format="dummy", **llm_kwargs)
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": rng.integers(0, vocab - 1000, in_len).tolist()} for _ in range(n)
    ]
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=out_len)
    if warm_up:
        llm.generate(prompts[:warm_up], params, use_tqdm=False)
    return llm, prompts, params, n, in_len, out_len


def main() -> None:
    llm, prompts, params, n, in_len, out_len = offline_workload(sys.argv, 1000, 256, 256)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    elapsed = time.perf_counter() - start
    print(
        f"PROFILE {n} prompts {in_len}/{out_len}: {elapsed:.2f} s, "
        f"{n * out_len / elapsed:.0f} output tok/s (under cProfile)"
    )
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(28)
        print(s.getvalue())


if __name__ == "__main__":
    main()

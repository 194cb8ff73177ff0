"""Where a request's first token goes on the host: cProfile of ``generate`` with one output
token (the prompt step and everything before it), after warm-up runs of the same recipe.

usage: python3 benchmarks/device/first_token_profile.py MODEL_DIR [IN] [RUNS]
Prints the wall time of each run and the profile's functions by cumulative time (the
last run), as ``FIRST`` lines.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

from profile_step import offline_workload  # this folder is on sys.path as the script's own

from tokenmill import SamplingParams


def main() -> None:
    in_len = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    argv = [sys.argv[0], sys.argv[1], "1", str(in_len), "1"]
    llm, prompts, _, _, _, _ = offline_workload(argv, 1, in_len, 1, warm_up=0)
    prompt = prompts[0]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(3):
        llm.generate(prompt, params, use_tqdm=False)
    walls = []
    for _ in range(runs):
        t = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        walls.append(1e3 * (time.perf_counter() - t))
    print("FIRST generate of 1 token (ms): " + ", ".join(f"{w:.2f}" for w in walls))
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompt, params, use_tqdm=False)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
    for line in out.getvalue().splitlines():
        if line.strip():
            print("FIRST " + line[:160])


if __name__ == "__main__":
    main()

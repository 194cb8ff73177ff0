"""Beam search throughput and sleep-mode times, tokenmill beside vLLM, on one GPU.

    python3 benchmarks/device/beam_sleep_bench.py MODEL_DIR [--engines tokenmill,vllm] \\
        [--batch 16] [--beam-width 4] [--input-len 256] [--output-len 128] [--cycles 3] \\
        [--output-json PATH]

Each engine runs in a process of its own (so the GPU is free for the next) on
``MODEL_DIR`` with ``--load-format dummy`` and sleep mode on:

1. ``LLM.beam_search`` of ``--batch`` random-token prompts at ``--beam-width``, each beam
   ``--output-len`` tokens (``ignore_eos``), after a short warm-up search: beam tokens/s
   (batch x width x output length over the wall time) and prompts/s.
2. ``--cycles`` times ``LLM.sleep(level=1)`` then ``LLM.wake_up()``: the wall time of each
   call, the device memory freed by the sleep (``torch.cuda.mem_get_info``), and the time of
   a one-token request after waking.

Prints ``BEAMSLEEP`` lines per engine and the tokenmill/vLLM ratios; ``--output-json``
writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time


def _prompts(batch: int, input_len: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(input_len)]}
            for _ in range(batch)]  # fmt: skip


def _free_gib() -> float:
    import torch

    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**30


def run_engine(engine: str, args: argparse.Namespace) -> dict:
    """Both measurements for one engine, in this process."""
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import BeamSearchParams
    else:
        from tokenmill import LLM, BeamSearchParams, SamplingParams
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format="dummy",
        enable_sleep_mode=True,
        max_model_len=args.input_len + args.output_len + 64,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    result: dict = {"engine": engine, "start_s": time.perf_counter() - start}
    prompts = _prompts(args.batch, args.input_len)
    llm.beam_search(prompts[:2], BeamSearchParams(beam_width=args.beam_width, max_tokens=8))
    params = BeamSearchParams(
        beam_width=args.beam_width, max_tokens=args.output_len, ignore_eos=True
    )
    start = time.perf_counter()
    outputs = llm.beam_search(prompts, params)
    elapsed = time.perf_counter() - start
    assert len(outputs) == args.batch and all(len(o.sequences) == args.beam_width for o in outputs)
    beam_tokens = args.batch * args.beam_width * args.output_len
    result.update(
        beam_search_s=elapsed,
        beam_tokens_per_s=beam_tokens / elapsed,
        prompts_per_s=args.batch / elapsed,
    )
    print(
        f"BEAMSLEEP {engine}: beam search of {args.batch} prompts x width {args.beam_width} x "
        f"{args.output_len} tokens in {elapsed:.2f} s = {beam_tokens / elapsed:.0f} beam tok/s",
        flush=True,
    )
    one = SamplingParams(temperature=0, max_tokens=1)
    cycles = []
    for cycle in range(args.cycles):
        awake = _free_gib()
        start = time.perf_counter()
        llm.sleep(level=1)
        sleep_s = time.perf_counter() - start
        asleep = _free_gib()
        start = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([prompts[0]], one, use_tqdm=False)
        first_s = time.perf_counter() - start
        cycles.append(
            {"sleep_s": sleep_s, "wake_up_s": wake_s, "freed_gib": asleep - awake,
             "first_request_s": first_s}
        )  # fmt: skip
        print(
            f"BEAMSLEEP {engine}: cycle {cycle}: sleep(level=1) {sleep_s:.2f} s (freed "
            f"{asleep - awake:.1f} GiB), wake_up {wake_s:.2f} s, then a 1-token request "
            f"{first_s:.2f} s",
            flush=True,
        )
    result["cycles"] = cycles
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--engines", default="tokenmill,vllm")
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.engine is not None:
        result = run_engine(args.engine, args)
        with open(args.output_json, "w") as f:
            json.dump(result, f)
        return
    results = {}
    for engine in args.engines.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        cmd = [sys.executable, os.path.abspath(__file__), args.model, "--engine", engine,
               "--output-json", path] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k in ("batch", "beam_width", "input_len", "output_len", "cycles",
                     "gpu_memory_utilization")
        ]  # fmt: skip
        code = subprocess.call(cmd)
        if code != 0 or not os.path.getsize(path):
            print(f"BEAMSLEEP {engine}: failed (exit code {code})", flush=True)
            continue
        with open(path) as f:
            results[engine] = json.load(f)
    if {"tokenmill", "vllm"} <= set(results):
        tm, vl = results["tokenmill"], results["vllm"]
        ratio = tm["beam_tokens_per_s"] / vl["beam_tokens_per_s"]
        print(f"BEAMSLEEP beam search throughput tokenmill/vLLM: {ratio:.2f}x", flush=True)
        for key in ("sleep_s", "wake_up_s"):
            t = min(c[key] for c in tm["cycles"])
            v = min(c[key] for c in vl["cycles"])
            print(f"BEAMSLEEP best {key}: tokenmill {t:.2f} s, vLLM {v:.2f} s", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

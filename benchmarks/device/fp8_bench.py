#!/usr/bin/env python3
"""FP8 on the GPU, tokenmill beside vLLM: Llama-3.1-8B (``--load-format dummy``) with
``--quantization fp8`` (weights quantized while loading) and ``--kv-cache-dtype fp8``.

usage: fp8_bench.py M8_FOLDER OUT_DIR [--cases lat1,tp,kvcap] [--engines tokenmill,vllm]

Cases: ``lat1`` batch-1 decode with ``--quantization fp8`` (``bench latency``, 32 prompt
tokens, 256 output tokens: ms per output token, and the fraction of the FP8 weight-read
floor reached: FP8 projection weights plus the 16-bit LM head, streamed once per token at
the GPU's peak memory bandwidth); ``tp`` offline 1024/256 with ``--quantization fp8``
(``bench throughput``, 1,000 prompts: output tokens per second); ``kvcap`` the KV cache's
capacity in tokens (from each engine's start-up log) with the model's dtype and with
``--kv-cache-dtype fp8``, and their ratio. Prints one ``FP8`` line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

# Peak memory bandwidth (bytes/s) by GPU name.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}
# Start-up log lines that give the KV cache's capacity in tokens.
CAPACITY = {"tokenmill": re.compile(r"KV cache \([^)]*\): \d+ blocks of \d+ tokens = (\d+) tokens"),
            "vllm": re.compile(r"GPU KV cache size: ([\d,]+) tokens")}


def weight_floor_bytes(m8: str) -> int:
    """Bytes one decode step must read: FP8 projections (1 byte a weight) and the bf16 LM
    head (token embeddings are read one row at a time)."""
    with open(os.path.join(m8, "config.json")) as f:
        c = json.load(f)
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return layers * per_layer + 2 * c["vocab_size"] * h


def bandwidth() -> float | None:
    """The GPU's peak memory bandwidth, from its name as nvidia-smi gives it (not through
    torch: a CUDA context in this process would take memory from the engines it starts)."""
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # no GPU: no floor
        return None
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


def _cli(engine: str) -> list[str]:
    if engine == "tokenmill":
        return [sys.executable, "-m", "tokenmill.entrypoints.cli.main"]
    return ["vllm"]


def _run(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc, time.time() - start


def _failed(engine: str, case: str, proc, wall: float) -> None:
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    print(f"FP8 {engine} {case} FAILED rc={proc.returncode} wall={wall:.0f}s "
          f"{' | '.join(tail)}", flush=True)


def run_bench(engine: str, case: str, m8: str, out: str) -> None:
    result = os.path.join(out, f"{engine}_fp8_{case}.json")
    args = ["--model", m8, "--load-format", "dummy", "--quantization", "fp8"]
    if case == "lat1":
        cmd = [*_cli(engine), "bench", "latency", *args, "--input-len", "32", "--output-len",
               "256", "--batch-size", "1", "--num-iters-warmup", "3", "--num-iters", "5"]
    else:
        cmd = [*_cli(engine), "bench", "throughput", *args, "--dataset-name", "random",
               "--random-input-len", "1024", "--random-output-len", "256",
               "--num-prompts", "1000"]
    proc, wall = _run([*cmd, "--output-json", result])
    if proc.returncode != 0 or not os.path.exists(result):
        _failed(engine, case, proc, wall)
        return
    with open(result) as f:
        data = json.load(f)
    if case == "lat1":
        ms = data["avg_latency"] / 256 * 1e3
        bw = bandwidth()
        floor = f" floor_ms={weight_floor_bytes(m8) / bw * 1e3:.3f}" if bw else ""
        frac = f" floor_fraction={weight_floor_bytes(m8) / bw * 1e3 / ms:.2f}" if bw else ""
        print(f"FP8 {engine} lat1 ms/token={ms:.3f}{floor}{frac} wall={wall:.0f}s", flush=True)
    else:
        tps = data["requests_per_second"] * 256
        print(f"FP8 {engine} tp output_tok/s={tps:.0f} wall={wall:.0f}s", flush=True)


def capacity(engine: str, m8: str, kv_dtype: str) -> int | None:
    """The KV cache's tokens at start-up (a short latency run; default memory settings)."""
    cmd = [*_cli(engine), "bench", "latency", "--model", m8, "--load-format", "dummy",
           "--input-len", "32", "--output-len", "8", "--batch-size", "1",
           "--num-iters-warmup", "1", "--num-iters", "1", "--kv-cache-dtype", kv_dtype]
    proc, wall = _run(cmd)
    found = CAPACITY[engine].findall(proc.stdout + proc.stderr)
    if not found:
        _failed(engine, f"kvcap_{kv_dtype}", proc, wall)
        return None
    return int(found[-1].replace(",", ""))


def run_capacity(engine: str, m8: str) -> None:
    base = capacity(engine, m8, "auto")
    fp8 = capacity(engine, m8, "fp8")
    if base and fp8:
        print(f"FP8 {engine} kvcap tokens_auto={base} tokens_fp8={fp8} "
              f"ratio={fp8 / base:.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("m8")
    p.add_argument("out")
    p.add_argument("--cases", default="lat1,tp,kvcap")
    p.add_argument("--engines", default="tokenmill,vllm")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for case in a.cases.split(","):
        for engine in a.engines.split(","):
            if engine == "vllm" and shutil.which("vllm") is None:
                print(f"FP8 vllm {case} SKIPPED (vllm not on PATH)", flush=True)
                continue
            if case == "kvcap":
                run_capacity(engine, a.m8)
            else:
                run_bench(engine, case, a.m8, a.out)


if __name__ == "__main__":
    main()

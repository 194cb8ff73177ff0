#!/usr/bin/env python3
"""4-bit weights on the GPU, tokenmill beside vLLM: Llama-3.1-8B shapes with random int4
weights (GPTQ and AWQ checkpoints loaded with ``--load-format dummy``: random packed values,
group size 128) and a random Q4_K_M GGUF file (Q4_K blocks, Q6_K for attn_v, ffn_down and
the output, as llama.cpp's Q4_K_M mix).

usage: quant_bench.py M8_FOLDER OUT_DIR [--cases gptq_lat1,awq_lat1,gguf_lat1,gptq_tp,awq_tp]
                      [--engines tokenmill,vllm,tokenmill_base]

Cases: ``*_lat1`` batch-1 decode (``bench latency``, 32 prompt tokens, 256 output tokens,
batch 1: ms per output token); ``*_tp`` offline 1024/256 (``bench throughput``, 1,000
prompts: output tokens per second). vLLM runs awq_marlin / gptq_marlin (its defaults for
these checkpoints on Hopper) and its GGUF path. ``tokenmill_base`` runs the tree in
``.carry/base`` (a ``git archive`` of another commit's ``tokenmill/``), to compare two commits
on one GPU. Prints one ``QUANT`` line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
       "version": "gemm"}
Q4_K, Q6_K = 12, 14


def make_folder(m8: str, out: str, name: str, qc: dict) -> str:
    """M8's config and tokenizer files with a ``quantization_config`` added."""
    path = os.path.join(out, name)
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(m8):
        if f != "config.json" and os.path.isfile(os.path.join(m8, f)):
            shutil.copy(os.path.join(m8, f), path)
    with open(os.path.join(m8, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _random_blocks(rng, qtype: int, rows: int, k: int) -> np.ndarray:
    size = 144 if qtype == Q4_K else 210
    raw = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    d = (rng.standard_normal((rows, k // 256)) * 1e-3).astype(np.float16).view(np.uint8)
    offs = (0, 2) if qtype == Q4_K else (208,)
    for off in offs:
        raw[..., off:off + 2] = d.reshape(rows, k // 256, 2)
    return raw.reshape(rows, -1)


def make_gguf(m8: str, out: str) -> str:
    """A Llama-3.1-8B-shaped Q4_K_M file of random blocks (~4.9 GB)."""
    import gguf

    path = os.path.join(out, "llama31-8b-q4km.gguf")
    if os.path.exists(path):
        return path
    with open(os.path.join(m8, "config.json")) as f:
        c = json.load(f)
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_vocab_size(c["vocab_size"])
    rng = np.random.default_rng(0)

    def add(name: str, qtype: int, rows: int, k: int) -> None:
        raw = _random_blocks(rng, qtype, rows, k)  # uint8 [rows, bytes]: gguf reads the shape
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(qtype))

    add("token_embd.weight", Q4_K, c["vocab_size"], h)
    add("output.weight", Q6_K, c["vocab_size"], h)
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(layers):
        add(f"blk.{i}.attn_q.weight", Q4_K, heads * hd, h)
        add(f"blk.{i}.attn_k.weight", Q4_K, kv * hd, h)
        add(f"blk.{i}.attn_v.weight", Q6_K, kv * hd, h)
        add(f"blk.{i}.attn_output.weight", Q4_K, h, heads * hd)
        add(f"blk.{i}.ffn_gate.weight", Q4_K, inter, h)
        add(f"blk.{i}.ffn_up.weight", Q4_K, inter, h)
        add(f"blk.{i}.ffn_down.weight", Q6_K, h, inter)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def run(engine: str, case: str, model: str, tokenizer: str, out: str) -> None:
    kind, mode = case.split("_")
    result = os.path.join(out, f"{engine}_{case}.json")
    env = None
    if engine == "vllm":
        cli = ["vllm"]
    else:
        cli = [sys.executable, "-m", "tokenmill.entrypoints.cli.main"]
    if engine == "tokenmill_base":  # another commit's tree, to compare two on one GPU
        cli.insert(1, "-P")
        env = {**os.environ, "PYTHONPATH": os.path.abspath(".carry/base") + os.pathsep
               + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    args = ["--model", model, "--tokenizer", tokenizer]
    if kind != "gguf":
        args += ["--load-format", "dummy"]
    if engine == "vllm" and kind != "gguf":
        args += ["--quantization", f"{kind}_marlin"]
    if engine == "vllm" and kind == "gguf":
        # vLLM 0.24's wheel has no GGUF loader (it moved to the separate vllm-gguf-plugin)
        print(f"QUANT vllm {case} SKIPPED: vLLM 0.24 loads GGUF only with vllm-gguf-plugin",
              flush=True)  # fmt: skip
        return
    if mode == "lat1":
        cmd = [*cli, "bench", "latency", *args, "--input-len", "32", "--output-len", "256",
               "--batch-size", "1", "--num-iters-warmup", "3", "--num-iters", "5"]
    else:
        cmd = [*cli, "bench", "throughput", *args, "--dataset-name", "random",
               "--random-input-len", "1024", "--random-output-len", "256",
               "--num-prompts", "1000"]
    cmd += ["--output-json", result]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - start
    if proc.returncode != 0 or not os.path.exists(result):
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        print(f"QUANT {engine} {case} FAILED rc={proc.returncode} wall={wall:.0f}s "
              f"{' | '.join(tail)}", flush=True)
        return
    with open(result) as f:
        data = json.load(f)
    if mode == "lat1":
        ms = data["avg_latency"] / 256 * 1e3
        print(f"QUANT {engine} {case} ms/token={ms:.3f} tok/s={1e3 / ms:.1f} "
              f"wall={wall:.0f}s", flush=True)
    else:
        tps = data["requests_per_second"] * 256
        print(f"QUANT {engine} {case} output_tok/s={tps:.0f} wall={wall:.0f}s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("m8")
    p.add_argument("out")
    p.add_argument("--cases", default="gptq_lat1,awq_lat1,gguf_lat1")
    p.add_argument("--engines", default="tokenmill,vllm")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    models = {"gptq": lambda: make_folder(a.m8, a.out, "llama31-8b-gptq", GPTQ),
              "awq": lambda: make_folder(a.m8, a.out, "llama31-8b-awq", AWQ),
              "gguf": lambda: make_gguf(a.m8, a.out)}
    for case in a.cases.split(","):
        model = models[case.split("_")[0]]()
        for engine in a.engines.split(","):
            if engine == "vllm" and shutil.which("vllm") is None:
                print(f"QUANT vllm {case} SKIPPED (vllm not on PATH)", flush=True)
                continue
            run(engine, case, model, a.m8, a.out)


if __name__ == "__main__":
    main()

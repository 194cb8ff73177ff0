#!/usr/bin/env python3
"""DeepSeek-V3-shaped MLA model, tokenmill beside vLLM on one GPU: offline output tokens/s
at 1,024 prompt / 256 output tokens and the KV cache's capacity in tokens.

The model folder has DeepSeek-V3's attention and expert dimensions (hidden 7168, 128 heads,
q_lora_rank 1536, kv_lora_rank 512, rope 64, nope 128, v 128, experts of 2048 with one shared
expert, 8 of them per token by grouped sigmoid routing, YaRN) with fewer layers and experts
so that it fits one H100/H200, random weights (``--load-format dummy``) and the tokenizer of
``--tokenizer-from`` (default ``$M8``). Each engine runs its own ``bench throughput`` CLI with
the same flags, one after the other; their logs give the KV capacity (tokenmill: ``KV cache
(DTYPE): N blocks of B tokens = T tokens``; vLLM: ``GPU KV cache size: T tokens``) and vLLM's
MLA backend (FlashMLA or its Triton MLA, depending on what its install carries).

    python3 benchmarks/device/mla_throughput.py --out "$OUT" [--engines tokenmill,vllm]

Writes ``$OUT/mla_throughput.json`` (both engines' figures, the ratios, the config, the
card; a run of one engine adds to the file another left) and each engine's log under
``$OUT/mla_logs/``; prints ``MLA ...`` lines.
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

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 163840,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}  # fmt: skip


def write_model(folder: str, tokenizer_src: str, layers: int, experts: int) -> None:
    """The config (``layers`` decoder layers, the first dense; ``experts`` routed experts in
    8 groups) and the tokenizer files of ``tokenizer_src``."""
    os.makedirs(folder, exist_ok=True)
    config = dict(CONFIG, num_hidden_layers=layers, n_routed_experts=experts)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    for name in os.listdir(tokenizer_src):
        if name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(tokenizer_src, name), os.path.join(folder, name))


def run(cmd: list[str], log: str, timeout: int) -> tuple[int, float]:
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, round(time.perf_counter() - start, 1)


def parse(engine: str, log: str, result_json: str) -> dict:
    text = open(log, errors="replace").read()
    out: dict = {}
    if os.path.isfile(result_json):
        r = json.load(open(result_json))
        out["requests_per_s"] = r.get("requests_per_second")
        out["total_tokens_per_s"] = r.get("tokens_per_second")
        if r.get("elapsed_time") and r.get("num_requests"):
            out["elapsed_s"] = r["elapsed_time"]
    m = re.findall(r"Throughput: .* ([\d.]+) output tokens/s", text)
    if m:
        out["output_tokens_per_s"] = float(m[-1])
    if engine == "tokenmill":
        m = re.findall(r"KV cache(?: \(\w+\))?: (\d+) blocks of (\d+) tokens = (\d+) tokens", text)
        if m:
            out["kv_blocks"], out["block_size"], out["kv_tokens"] = map(int, m[-1])
        m = re.findall(r"KV cache per token: (.*)", text)
        if m:
            out["kv_per_token"] = m[-1].strip()
    else:
        m = re.findall(r"GPU KV cache size: ([\d,]+) tokens", text)
        if m:
            out["kv_tokens"] = int(m[-1].replace(",", ""))
        backends = sorted(set(re.findall(r"Using (\w*MLA\w*)", text, re.I)))
        backends += sorted(set(re.findall(r"[Aa]ttention backend[^\n]*?(\w*MLA\w*)", text)))
        out["attention_backend"] = ",".join(dict.fromkeys(backends)) or None
    m = re.findall(r"Memory: .*", text)
    if m:
        out["memory"] = m[-1]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/tm_out"))
    p.add_argument("--engines", default="tokenmill,vllm")
    p.add_argument("--tokenizer-from", default=os.environ.get("M8", ""))
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--timeout", type=int, default=420, help="seconds per engine")
    p.add_argument("--extra", default="", help="more flags for both engines' CLI")
    p.add_argument("--model-only", action="store_true",
                   help="write the model folder, print its path, run nothing")
    args = p.parse_args()
    if not os.path.isdir(args.tokenizer_from):
        sys.exit("mla_throughput: --tokenizer-from (or $M8) must be a tokenizer folder")
    logs = os.path.join(args.out, "mla_logs")
    os.makedirs(logs, exist_ok=True)
    model = os.path.join("/tmp", f"dsv3-{args.layers}l-{args.experts}e-dummy")
    write_model(model, args.tokenizer_from, args.layers, args.experts)
    if args.model_only:
        print(model)
        return
    common = [
        "bench", "throughput", "--model", model, "--load-format", "dummy",
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        *args.extra.split(),
    ]  # fmt: skip
    cli = {
        "tokenmill": [sys.executable, "-m", "tokenmill.entrypoints.cli.main"],
        "vllm": [shutil.which("vllm") or "vllm"],
    }
    path = os.path.join(args.out, "mla_throughput.json")
    # Engines run in separate calls add to the same file (same model and workload).
    results: dict = json.load(open(path)) if os.path.isfile(path) else {}
    results.update(
        config=dict(CONFIG, num_hidden_layers=args.layers, n_routed_experts=args.experts),
        workload=f"{args.num_prompts} x {args.input_len}/{args.output_len}",
    )
    try:
        import torch

        results["device"] = torch.cuda.get_device_name(0)
    except Exception as e:  # the figures are still worth keeping
        results["device"] = f"unknown ({e})"
    for engine in args.engines.split(","):
        log = os.path.join(logs, f"{engine}.log")
        result_json = os.path.join(logs, f"{engine}.json")
        rc, wall = run(cli[engine] + common + ["--output-json", result_json], log, args.timeout)
        results[engine] = dict(parse(engine, log, result_json), rc=rc, wall_s=wall)
        print(f"MLA {engine}: {json.dumps(results[engine])}", flush=True)
    tm, vl = results.get("tokenmill", {}), results.get("vllm", {})
    for key in ("output_tokens_per_s", "kv_tokens"):
        if tm.get(key) and vl.get(key):
            results[f"ratio_{key}"] = round(tm[key] / vl[key], 3)
            print(f"MLA ratio {key} (tokenmill / vLLM): {results[f'ratio_{key}']}", flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

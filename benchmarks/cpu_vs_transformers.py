"""Offline CPU throughput: tokenmill's LLM.generate against transformers' generate, one run.

The real SmolLM2-135M-Instruct (the embedded GGUF, float32), 256 prompts of ~100 tokens,
128 output tokens each (greedy, EOS ignored so lengths are equal). transformers runs static
batches of 16 with left padding (as the project's CPU anchor); tokenmill runs every prompt
through one ``generate`` call, once capped at 16 running requests (the anchor's concurrency)
and once with its CPU default of 256. Both run one after the other on the same machine.

usage: python benchmarks/cpu_vs_transformers.py [--num-prompts 256] [--output-len 128]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.model_config_args import default_model_path

TOPICS = ["the ocean", "a robot", "Paris", "mathematics", "a small dog", "the moon", "coffee",
          "history", "music", "a mountain village"]


def make_prompts(tokenizer, n: int, target_len: int = 100) -> list[list[int]]:
    prompts = []
    for i in range(n):
        text = f"Write a detailed story about {TOPICS[i % len(TOPICS)]} (story {i}). "
        ids = tokenizer.encode(text * 12)[:target_len]
        prompts.append(ids)
    return prompts


def run_tokenmill(prompts: list[list[int]], out_len: int, max_num_seqs: int) -> float:
    llm = LLM(kv_cache_memory=2 << 30, max_model_len=1024, max_num_seqs=max_num_seqs)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
    return len(prompts) * out_len / elapsed


def run_transformers(prompts: list[list[int]], out_len: int, batch: int = 16) -> float:
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32").eval()
    pad = model.config.pad_token_id or 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_len,
                           min_new_tokens=out_len, do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    return len(prompts) * out_len / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    a = ap.parse_args()
    llm_tok = LLM(kv_cache_memory=64 << 20, max_model_len=512).get_tokenizer()
    prompts = make_prompts(llm_tok, a.num_prompts)
    print(f"{a.num_prompts} prompts of {len(prompts[0])} tokens, {a.output_len} output tokens, "
          f"{torch.get_num_threads()} torch threads")
    results = {
        "tokenmill (max 16 running)": run_tokenmill(prompts, a.output_len, 16),
        "tokenmill (max 256 running)": run_tokenmill(prompts, a.output_len, 256),
        "transformers generate (batches of 16)": run_transformers(prompts, a.output_len),
    }
    for name, tps in results.items():
        print(f"{name}: {tps:.1f} output tok/s")


if __name__ == "__main__":
    main()

"""Second-turn TTFT of a multi-turn workload larger than the KV cache, with and without the
host-memory KV tier (``--kv-offloading-size``), offline.

Turn 1 sends every conversation's first prompt; turn 2 then comes back to each in order,
its prompt being the first turn's prompt and answer plus a follow-up. The device KV cache
holds only a few conversations, so by turn 2 their prefixes were evicted: without the tier
they are computed again, with it they are loaded back. Each turn-2 request runs alone (a
user's next message), and its TTFT is arrival to first token.

    python benchmarks/kv_offload_multiturn.py                       # CPU, the embedded SmolLM2
    python benchmarks/kv_offload_multiturn.py --model $M8 --load-format dummy \\
        --conversations 64 --prompt-len 4096 --kv-cache-gib 16 --offload-gib 64   # a GPU

Prints ``KVOFF`` lines (per configuration: median and mean turn-2 TTFT, tier hits) and the
ratio; ``--output-json`` writes them too. Outputs are checked to be identical (greedy).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time

from tokenmill import LLM, SamplingParams


def conversations(num: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(prompt_len)] for _ in range(num)]


def run(args: argparse.Namespace, label: str, **offload) -> dict:
    llm = LLM(
        args.model,
        load_format=args.load_format,
        kv_cache_memory=int(args.kv_cache_gib * (1 << 30)),
        max_model_len=args.prompt_len * 2 + 64,
        enable_prefix_caching=True,
        **offload,
    )
    vocab = llm.model_config.vocab_size
    firsts = conversations(args.conversations, args.prompt_len, vocab, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.answer_len, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in firsts], params, use_tqdm=False)
    follow_up = conversations(1, args.follow_up_len, vocab, args.seed + 1)[0]
    ttfts, tokens = [], []
    start = time.perf_counter()
    for prompt, out in zip(firsts, outs, strict=True):
        second = prompt + list(out.outputs[0].token_ids) + follow_up
        [o] = llm.generate({"prompt_token_ids": second}, one, use_tqdm=False)
        ttfts.append(o.metrics.first_token_time - o.metrics.arrival_time)
        tokens.append(o.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    counters = llm.llm_engine.counters
    result = {
        "label": label,
        "turn2_ttft_median_s": statistics.median(ttfts),
        "turn2_ttft_mean_s": statistics.fmean(ttfts),
        "turn2_total_s": elapsed,
        "prefix_cache_hits": counters.prefix_cache_hits,
        "kv_offload": counters.kv_offload,
        "tokens": [list(o.outputs[0].token_ids) for o in outs] + tokens,
    }
    print(
        f"KVOFF {label}: turn-2 TTFT median {result['turn2_ttft_median_s'] * 1e3:.1f} ms, "
        f"mean {result['turn2_ttft_mean_s'] * 1e3:.1f} ms over {len(ttfts)} conversations; "
        f"offload {({k: round(v) for k, v in counters.kv_offload.items()})}",
        flush=True,
    )
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--answer-len", type=int, default=16)
    parser.add_argument("--follow-up-len", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=float, default=0.2, help="device KV cache")
    parser.add_argument("--offload-gib", type=float, default=2.0, help="host tier")
    parser.add_argument("--disk", action="store_true", help="also a run with a disk tier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    results = [run(args, "no tier"), run(args, "host tier", kv_offloading_size=args.offload_gib)]
    if args.disk:
        with tempfile.TemporaryDirectory() as folder:
            results.append(
                run(
                    args,
                    "small host tier + disk tier",
                    kv_offloading_size=args.offload_gib / 16,
                    kv_offloading_disk_path=folder,
                    kv_offloading_disk_size=args.offload_gib,
                )
            )
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    base = results[0]["turn2_ttft_median_s"]
    for r in results[1:]:
        print(f"KVOFF {r['label']}: turn-2 TTFT {base / r['turn2_ttft_median_s']:.1f}x better")
    print(f"KVOFF greedy outputs identical across configurations: {same}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {"identical": same, "runs": [{k: v for k, v in r.items() if k != "tokens"}
                                             for r in results]},
                f, indent=2,
            )  # fmt: skip


if __name__ == "__main__":
    main()

"""GPU time of one decode step, apart from the engine's host work.

usage: python3 benchmarks/device/decode_step_bench.py MODEL_DIR [--kernel-config JSON]
Prints, for Llama-3.1-8B-shaped weights: each projection's time at batch 1 through
torch's linear (cuBLAS) and its achieved bandwidth; and the replay time of the captured
decode graph at several batch sizes (weights + KV reads), against the card's 4.25 TB/s.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from tokenmill import LLM, SamplingParams

PEAK_BPS = 4.247e12


def gemv_table(hidden: int, inter: int, q: int, kv: int, vocab: int) -> None:
    shapes = {
        "qkv": (q + 2 * kv, hidden),
        "o_proj": (hidden, q),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (vocab, hidden),
    }
    for m in (1, 8, 32):
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = (
                do_bench(lambda x=x, w=w: F.linear(x, w), warmup=25, rep=100, return_mode="median")
                * 1e-3
            )
            print(
                f"GEMV m={m:3d} {name:8s} {n:6d}x{k:6d}: {t * 1e6:8.1f} us, "
                f"{n * k * 2 / t / 1e12:5.2f} TB/s ({n * k * 2 / t / PEAK_BPS:4.0%} of peak)"
            )


def main() -> None:
    model = sys.argv[1]
    kernel_config = None  # as tokenmill serve's --kernel-config
    if "--kernel-config" in sys.argv:
        kernel_config = sys.argv[sys.argv.index("--kernel-config") + 1]
    llm = LLM(model, load_format="dummy", max_num_seqs=256, kernel_config=kernel_config)
    cfg = llm.llm_engine.config.model_config.hf_config
    head_dim = cfg.get("head_dim") or cfg.hidden_size // cfg.num_attention_heads
    gemv_table(
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_attention_heads * head_dim,
        cfg.num_key_value_heads * head_dim,
        cfg.vocab_size,
    )
    weight_bytes = sum(
        p.numel() * p.element_size()
        for p in llm.llm_engine.engine_core.executor.worker.model_runner.model.parameters()
    )
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    graphs = runner.graphs.decode
    for bs in (1, 32, 256):
        llm.generate([{"prompt_token_ids": [5] * 512}] * bs, params, use_tqdm=False)
        if graphs is None or not graphs.can_run(bs):
            print(f"STEP bs={bs}: no CUDA graph")
            continue
        size = graphs.padded_size(bs)
        # The buffers still hold the last decode batch (contexts of ~575 tokens).
        t = (
            do_bench(
                lambda size=size: graphs.graphs[size].replay(),
                warmup=10,
                rep=200,
                return_mode="median",
            )
            * 1e-3
        )
        print(
            f"STEP bs={bs}: graph replay {t * 1e3:.3f} ms; weights alone at peak "
            f"{weight_bytes / PEAK_BPS * 1e3:.3f} ms ({weight_bytes / 1e9:.2f} GB)"
        )
    logits = torch.randn(1, cfg.vocab_size, device="cuda", dtype=torch.bfloat16)
    t = (
        do_bench(
            lambda: runner.model.compute_logits(
                torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
            ),
            warmup=10,
            rep=100,
        )
        * 1e-3
    )
    print(f"LM head alone at batch 1: {t * 1e6:.1f} us ({logits.numel()} logits)")


if __name__ == "__main__":
    main()

"""The models of the multi-rank checks: tiny random Llama, Qwen3, Mixtral and Qwen3-MoE
configs saved with transformers (decisive LM heads and routers, so greedy tokens have no
near-ties that a different order of float sums could flip), and the prompts they run."""

from __future__ import annotations

from tests.model.test_qwen3_parity import TINY, save_random_model

# SmolLM2's tokenizer decodes ids below 320, the tiny models' vocabulary.
PROMPTS = [
    [5, 17, 42, 99, 3, 250, 7],
    [11, 12, 13],
    list(range(100, 150)),  # longer than a step's budget below: chunked prefill
    [300, 2, 301, 4, 302, 6, 303, 8, 304],
]
# Engine flags of every run: a small budget, so prompts take several steps (and several
# micro-batches in flight under pipeline parallelism).
ENGINE = dict(dtype="float32", kv_cache_memory=16 << 20, max_model_len=128,
              max_num_batched_tokens=32, max_num_seqs=4)  # fmt: skip
SCALE = {"lm_head": 30.0, "mlp.gate.weight": 40.0, "block_sparse_moe.gate.weight": 40.0}
LAYERS = dict(TINY, num_hidden_layers=4)


def save_tiny_model(kind: str, path) -> str:
    """Save the random ``kind`` (llama, qwen3, mixtral or qwen3_moe) under ``path``; returns it."""
    from transformers import LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    configs = {
        "llama": lambda: LlamaConfig(**LAYERS),
        "qwen3": lambda: Qwen3Config(**LAYERS, head_dim=16),
        "mixtral": lambda: MixtralConfig(
            **LAYERS, num_local_experts=4, num_experts_per_tok=2, sliding_window=None
        ),
        # Layer 0 keeps a dense MLP; the others route to 4 experts of width 32.
        "qwen3_moe": lambda: Qwen3MoeConfig(
            **LAYERS, head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0],
        ),
    }
    save_random_model(configs[kind](), path, SCALE)
    return str(path)

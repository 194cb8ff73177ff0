"""Write dummy-weight model folders of the architectures measured beside vLLM on the GPU.

    python3 benchmarks/device/make_arch_models.py OUT --tokenizer-from "$M8"

writes ``OUT/gpt-oss-20b-dummy``: gpt-oss-20b's config.json (24 layers, 32 experts of 2,880
with 4 per token, MXFP4 experts by its ``quantization_config``, sliding windows of 128 on
every other layer, attention sinks, YaRN), with the tokenizer files of the
``--tokenizer-from`` folder (the benchmarks draw random token ids, so any tokenizer whose
ids are below the model's vocabulary works). Both engines load it with
``--load-format dummy``: only config.json and the tokenizer are read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

# gpt-oss-20b's config.json as published (openai/gpt-oss-20b), with the tokenizer's ids.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 201088,
}  # fmt: skip
MODELS = {"gpt-oss-20b-dummy": GPT_OSS_20B}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "generation_config.json",
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder to write the model folders into")
    parser.add_argument("--tokenizer-from", required=True,
                        help="a model folder whose tokenizer files are copied")  # fmt: skip
    args = parser.parse_args()
    with open(os.path.join(args.tokenizer_from, "config.json")) as f:
        ids = {k: v for k, v in json.load(f).items() if k.endswith("token_id")}
    for name, config in MODELS.items():
        folder = os.path.join(args.out, name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**config, **ids}, f, indent=2)
        for file in TOKENIZER_FILES:
            src = os.path.join(args.tokenizer_from, file)
            if os.path.isfile(src):
                shutil.copy(src, folder)
        print(f"wrote {folder}")


if __name__ == "__main__":
    main()

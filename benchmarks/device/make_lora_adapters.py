"""Write random PEFT LoRA adapters for a model folder (only its config.json is read), for
serving benchmarks with ``--enable-lora``: speed does not depend on the adapters' values.

    python benchmarks/device/make_lora_adapters.py MODEL_DIR OUT_DIR [--num 8] [--rank 16]

Writes ``OUT_DIR/a0 .. a{num-1}``, each ``adapter_config.json`` + ``adapter_model.safetensors``
(bf16) as peft's ``save_pretrained`` names them, targeting q/k/v/o and gate/up/down of every
layer; prints the ``--lora-modules`` arguments (``a0=OUT_DIR/a0 ...``) on one line.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """Checkpoint projection -> ``(in features, out features)`` of a Llama-style config."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_adapter(config: dict, out: str, rank: int, seed: int, base: str) -> None:
    """One adapter of rank ``rank`` (alpha ``2 * rank``) with A and B drawn from N(0, 0.02)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    shapes = projection_shapes(config)
    for layer in range(config["num_hidden_layers"]):
        for name in TARGETS:
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            fan_in, fan_out = shapes[name]
            a = torch.randn(rank, fan_in, generator=gen) * 0.02
            b = torch.randn(fan_out, rank, generator=gen) * 0.02
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(TARGETS), "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "modules_to_save": None, "inference_mode": True,
    }  # fmt: skip
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--num", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    with open(os.path.join(args.model_dir, "config.json")) as f:
        config = json.load(f)
    modules = []
    for i in range(args.num):
        path = os.path.join(args.out_dir, f"a{i}")
        if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
            write_adapter(config, path, args.rank, seed=i, base=args.model_dir)
        modules.append(f"a{i}={path}")
    print(" ".join(modules))


if __name__ == "__main__":
    main()

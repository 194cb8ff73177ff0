"""Convert a GGUF model (e.g. the embedded SmolLM2-135M-Instruct, Q4_1) into a Hugging Face
folder: the dequantized weights as one safetensors file in the dtype asked for, config.json,
generation_config.json and the tokenizer. Any engine that reads Hugging Face folders (vLLM,
tokenmill, transformers) then serves the same real weights.

    python benchmarks/device/gguf_to_safetensors.py MODEL.gguf OUT_DIR [--dtype bfloat16]

Tensors are read with tokenmill's GGUF reader (``tokenmill.model.loader.gguf_loader``), which
undoes llama.cpp's naming and Q/K row permutation, so the folder holds transformers' names
and layout.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def convert(gguf_path: str, out_dir: str, dtype: str = "bfloat16") -> str:
    """Write the folder; returns ``out_dir``."""
    from safetensors.torch import save_file

    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.attention.torch_ref import TorchAttentionBackend
    from tokenmill.model.loader.gguf_loader import iterate_gguf
    from tokenmill.model.loader.model_loader import expected_checkpoint_names
    from tokenmill.model.registry import get_model_class
    from tokenmill.tokenizer import get_tokenizer

    config = EngineArgs(model=gguf_path, dtype="float32", device="cpu").create_engine_config()
    mc = config.model_config
    with torch.device("meta"):  # the names only: no memory for the weights
        skeleton = get_model_class(mc.architecture)(mc, TorchAttentionBackend)
    names = expected_checkpoint_names(skeleton)
    hf = mc.hf_config
    tensors = {
        name: tensor.to(DTYPES[dtype]).contiguous()
        for name, tensor in iterate_gguf(
            gguf_path, names, hf.num_attention_heads,
            hf.get("num_key_value_heads", hf.num_attention_heads),
        )
    }  # fmt: skip
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    data = {k: v for k, v in hf.to_dict().items() if not k.startswith("_")}
    data.update(torch_dtype=dtype)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(data, f, indent=2)
    generation = {k: data[k] for k in ("bos_token_id", "eos_token_id") if k in data}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
    get_tokenizer(gguf_path).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument("out_dir", help="the folder to write")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = parser.parse_args()
    print(f"Wrote {convert(args.gguf, args.out_dir, args.dtype)}")


if __name__ == "__main__":
    main()

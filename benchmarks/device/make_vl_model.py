"""Write a Qwen2.5-VL-7B-shaped (or, with ``--gemma3``, Gemma-3-4B-shaped) model folder for
``--load-format dummy`` serving.

config.json is Qwen2.5-VL-7B-Instruct's (text: 28 layers of 3584, GQA 28/4; vision: 32
blocks of 1280, window attention with full attention in blocks 7/15/23/31, 2x2 merger), the
image processor is Qwen2-VL's defaults, and the tokenizer is the SmolLM2 tokenizer of
``TOKENIZER_DIR`` with Qwen's chat and vision special tokens added (config.json's token ids
are set to theirs). Both tokenmill and vLLM read the folder.

With ``--gemma3``: gemma-3-4b-it's config.json (text: 34 layers of 2560, GQA 8/4, head_dim
256, five 1,024-token sliding-window layers per global one; vision: SigLIP, 27 blocks of
1152 on 896x896 images of 14x14 patches, pooled to 256 tokens), Gemma3ImageProcessor's
defaults, and the SmolLM2 tokenizer with Gemma's chat and image special tokens.

Usage: python benchmarks/device/make_vl_model.py TOKENIZER_DIR OUT_DIR [--gemma3]
"""

from __future__ import annotations

import json
import os
import sys

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<|endoftext|>"]  # fmt: skip
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_PROCESSOR = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136, "max_pixels": 12845056, "merge_size": 2, "patch_size": 14,
    "temporal_patch_size": 2, "resample": 3, "rescale_factor": 0.00392156862745098,
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}  # fmt: skip


def main(tokenizer_dir: str, out: str) -> None:
    from transformers import AutoTokenizer

    os.makedirs(out, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    tok.eos_token = "<|im_end|>"
    tok.save_pretrained(out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "hidden_act": "silu",
        "hidden_size": 3584,
        "initializer_range": 0.02,
        "intermediate_size": 18944,
        "max_position_embeddings": 128000,
        "max_window_layers": 28,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {
            "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
            "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
            "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },  # fmt: skip
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vocab_size": 152064,
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": ids["<|im_end|>"]}, f)
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        with open(os.path.join(out, name), "w") as f:
            json.dump(IMAGE_PROCESSOR, f, indent=2)
    with open(os.path.join(out, "chat_template.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE}, f)
    print(f"wrote {out}: image token {ids['<|image_pad|>']}")


GEMMA3_SPECIAL = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>"]  # fmt: skip
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_IMAGE_PROCESSOR = {
    "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
    "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
    "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None, "resample": 2,
    "rescale_factor": 0.00392156862745098, "size": {"height": 896, "width": 896},
}  # fmt: skip


def main_gemma3(tokenizer_dir: str, out: str) -> None:
    from transformers import AutoTokenizer

    os.makedirs(out, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": GEMMA3_SPECIAL})
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA3_SPECIAL}
    tok.chat_template = GEMMA3_TEMPLATE
    tok.bos_token, tok.eos_token, tok.pad_token = "<bos>", "<end_of_turn>", "<pad>"
    tok.save_pretrained(out)
    # Gemma3Processor reads these names of the tokenizer (its extra special tokens).
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        tok_config = json.load(f)
    tok_config["extra_special_tokens"] = {"boi_token": "<start_of_image>",
                                          "eoi_token": "<end_of_image>",
                                          "image_token": "<image_soft_token>"}  # fmt: skip
    with open(path, "w") as f:
        json.dump(tok_config, f, indent=2)
    text = {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
        "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(34)],
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "vocab_size": 262208,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-06,
        "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
    }  # fmt: skip
    vision = {
        "model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
        "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896,
        "patch_size": 14, "layer_norm_eps": 1e-06, "vision_use_head": False,
        "hidden_act": "gelu_pytorch_tanh",
    }  # fmt: skip
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": text, "vision_config": vision, "mm_tokens_per_image": 256,
        "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"],
        "image_token_index": ids["<image_soft_token>"], "torch_dtype": "bfloat16",
        "bos_token_id": ids["<bos>"], "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "pad_token_id": ids["<pad>"],
    }  # fmt: skip
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]]}, f)
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(GEMMA3_IMAGE_PROCESSOR, f, indent=2)
    with open(os.path.join(out, "processor_config.json"), "w") as f:
        json.dump({"image_seq_length": 256, "processor_class": "Gemma3Processor"}, f)
    with open(os.path.join(out, "chat_template.json"), "w") as f:
        json.dump({"chat_template": GEMMA3_TEMPLATE}, f)
    print(f"wrote {out}: image token {ids['<image_soft_token>']}")


if __name__ == "__main__":
    if "--gemma3" in sys.argv:
        main_gemma3(sys.argv[1], sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])

"""Small random vision-language checkpoints written with transformers (config, weights,
tokenizer, image processor and chat template), for checks against transformers itself.

The tokenizer is byte-level BPE without merges (one token per byte) plus the model's
special tokens, so that no tokenizer files need downloading.
"""

from __future__ import annotations

import json
import os
from typing import Any

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_SPECIAL_TOKENS = [
    "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>", "<|endoftext|>",
]  # fmt: skip


def byte_tokenizer(special_tokens: list[str], **kwargs: Any):
    """A byte-level tokenizer (ids 0..255 are bytes) with ``special_tokens`` from id 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.add_special_tokens({"additional_special_tokens": special_tokens})
    return fast


def write_qwen2_5_vl(path: str, seed: int = 0) -> str:
    """A random Qwen2.5-VL (2 text layers, 2 vision blocks: one windowed, one full) with
    its tokenizer, image processor and chat template, saved to ``path``."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = byte_tokenizer(QWEN_SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    text = dict(
        vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        fullatt_block_indexes=[1], in_channels=3,
    )  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # initializer_range gives near-zero logits; widen them
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64, patch_size=14, merge_size=2,
        temporal_patch_size=2,
    )  # fmt: skip
    image_processor.save_pretrained(path)
    tok.chat_template = QWEN_CHAT_TEMPLATE
    tok.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": ids["<|im_end|>"]}, f)
    return path

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


def write_qwen2_5_vl_config(path: str, text: dict, vision: dict) -> str:
    """A Qwen2.5-VL folder without weights (for ``--load-format dummy``): config.json from
    ``text`` and ``vision`` settings, the byte tokenizer with the chat template, and Qwen2-VL's
    image processor settings; needs no transformers model class."""
    os.makedirs(path, exist_ok=True)
    tok = byte_tokenizer(QWEN_SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = QWEN_CHAT_TEMPLATE
    tok.save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "rope_scaling": {"type": "mrope", "mrope_section": text.pop("mrope_section")},
        "tie_word_embeddings": False, "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"], "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"], "eos_token_id": ids["<|im_end|>"],
        **text, "vision_config": {"hidden_act": "silu", "in_chans": 3, **vision},
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor", "do_convert_rgb": True,
        "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "min_pixels": 3136,
        "max_pixels": 200704, "merge_size": 2, "patch_size": 14, "temporal_patch_size": 2,
        "resample": 3, "rescale_factor": 1 / 255,
    }  # fmt: skip
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f)
    return path


LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def write_llava(path: str, tower: str = "clip", seed: int = 0) -> str:
    """A random LLaVA (a CLIP or SigLIP tower of 2 layers on 56x56 crops, a 2-layer Llama)
    with its tokenizer, image processor and chat template, saved to ``path``."""
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipVisionConfig,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = byte_tokenizer(["<image>", "</s>"], eos_token="</s>")
    image_id = tok.convert_tokens_to_ids("<image>")
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, image_size=56, patch_size=14)  # fmt: skip
    vision = CLIPVisionConfig(**shape) if tower == "clip" else SiglipVisionConfig(**shape)
    text = LlamaConfig(vocab_size=272, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, bos_token_id=None,
                       eos_token_id=tok.eos_token_id)  # fmt: skip
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_id,
        vision_feature_select_strategy="default" if tower == "clip" else "full",
        vision_feature_layer=-2 if tower == "clip" else -1,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(path)
    CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
                          ).save_pretrained(path)  # fmt: skip
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def random_image(seed: int, height: int, width: int):
    """A PIL RGB image of uniform random pixels (``numpy.random.RandomState(seed)``)."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))

"""Small random vision-language checkpoints written with transformers (config, weights,
tokenizer, image processor and chat template), for checks against transformers itself.

The tokenizer is byte-level BPE without merges (one token per byte) plus the model's
special tokens, so that no tokenizer files need downloading.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
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


def byte_tokenizer(
    special_tokens: list[str], merges: Sequence[tuple[str, str]] = (), **kwargs: Any
):
    """A byte-level tokenizer (ids 0..255 are bytes) with one token per pair of ``merges``
    (text pieces, applied in order) from id 256, then ``special_tokens``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    bpe_merges = [(_byte_chars(a), _byte_chars(b)) for a, b in merges]
    for a, b in bpe_merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=bpe_merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.add_special_tokens({"additional_special_tokens": special_tokens})
    return fast


def _byte_chars(text: str) -> str:
    """``text`` in the byte-level alphabet (each UTF-8 byte as its printable character)."""
    from tokenizers import pre_tokenizers

    [(chars, _)] = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=False
    ).pre_tokenize_str(text)
    return chars


def _save_qwen_processing(path: str, tok: Any, patch_size: int) -> str:
    """The Qwen-VL image processor (4 to 64 merged 2x2 patch groups an image), the
    tokenizer with the chat template and a generation config, saved beside the weights."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    unit = 2 * patch_size
    Qwen2VLImageProcessorPil(
        min_pixels=unit * unit * 4, max_pixels=unit * unit * 64, patch_size=patch_size,
        merge_size=2, temporal_patch_size=2,
    ).save_pretrained(path)  # fmt: skip
    tok.chat_template = QWEN_CHAT_TEMPLATE
    tok.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": tok.convert_tokens_to_ids("<|im_end|>")}, f)
    return path


def _write_qwen_vl(path: str, seed: int, config_cls: Any, model_cls: Any, vision: dict,
                   patch_size: int, **text: Any) -> str:  # fmt: skip
    """A random Qwen-VL model of ``config_cls`` / ``model_cls``: 2 text layers of 64 (and
    ``text``'s settings over them), the ``vision`` tower, the byte tokenizer with Qwen's
    special tokens, and the image processor for ``patch_size``-pixel patches."""
    tok = byte_tokenizer(QWEN_SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    text_config = dict(
        vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
    )  # fmt: skip
    text_config.update(text)
    config = config_cls(
        text_config=text_config,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False,
    )
    save_random_weights(model_cls, config, path, seed)
    return _save_qwen_processing(path, tok, patch_size)


def write_qwen2_5_vl(path: str, seed: int = 0) -> str:
    """A random Qwen2.5-VL (2 text layers, 2 vision blocks: one windowed, one full) with
    its tokenizer, image processor and chat template, saved to ``path``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        fullatt_block_indexes=[1], in_channels=3,
    )  # fmt: skip
    return _write_qwen_vl(path, seed, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                          vision, patch_size=14)  # fmt: skip


def write_qwen2_vl(path: str, seed: int = 0) -> str:
    """A random Qwen2-VL (2 text layers, 2 vision blocks) with its tokenizer, image
    processor and chat template, saved to ``path``."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = dict(
        depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="quick_gelu",
    )  # fmt: skip
    return _write_qwen_vl(path, seed, Qwen2VLConfig, Qwen2VLForConditionalGeneration, vision,
                          patch_size=14)  # fmt: skip


def write_qwen3_vl(path: str, seed: int = 0, moe: bool = False) -> str:
    """A random Qwen3-VL (2 text layers with QK-norm and interleaved M-RoPE; 3 vision
    blocks of 16-pixel patches, learned position embeddings and DeepStack features from
    blocks 0 and 1) with its tokenizer, image processor and chat template; ``moe``: the
    language model routes to 4 experts of 48, 2 a token (Qwen3-VL-MoE)."""
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    vision = dict(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
        num_position_embeddings=64, deepstack_visual_indexes=[0, 1],
        hidden_act="gelu_pytorch_tanh",
    )  # fmt: skip
    text: dict[str, Any] = dict(
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True},
    )  # fmt: skip
    classes = (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    if moe:
        classes = (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                    decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    return _write_qwen_vl(path, seed, *classes, vision, patch_size=16, **text)


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
    save_random_weights(LlavaForConditionalGeneration, config, path, seed)
    CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
                          ).save_pretrained(path)  # fmt: skip
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_SPECIAL_TOKENS = [
    "<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
    "<end_of_image>", "<image_soft_token>",
]  # fmt: skip
# Gemma's tokenizer has one token per run of newlines ("\n\n\n" is one token).
NEWLINE_MERGES = [("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n")]


def gemma3_tokenizer(merges: Sequence[tuple[str, str]] = ()):
    """The byte tokenizer with Gemma 3's special tokens (``boi_token``, ``eoi_token`` and
    ``image_token`` named as Gemma3Processor reads them), ``merges`` and newline-run
    tokens."""
    return byte_tokenizer(
        GEMMA3_SPECIAL_TOKENS, [*merges, *NEWLINE_MERGES], bos_token="<bos>",
        eos_token="<end_of_turn>",
        pad_token="<pad>", extra_special_tokens={"boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    )  # fmt: skip


def write_gemma3_mm(
    path: str, seed: int = 0, mm_tokens_per_image: int = 16,
    merges: Sequence[tuple[str, str]] = (),
) -> str:  # fmt: skip
    """A random Gemma 3 vision-language model (a 2-layer SigLIP tower on 64x64 images of
    8x8 patches, pooled to ``mm_tokens_per_image`` tokens; 3 text layers, sliding, sliding
    and full, with a 12-token window) with its tokenizer (``gemma3_tokenizer(merges)``),
    image processor, processor config and chat template, saved to ``path``."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    tok = gemma3_tokenizer(merges)
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA3_SPECIAL_TOKENS}
    text = Gemma3TextConfig(
        vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=12, max_position_embeddings=1024,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        bos_token_id=ids["<bos>"], eos_token_id=ids["<end_of_turn>"],
        pad_token_id=ids["<pad>"],
    )  # fmt: skip
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, image_size=64, patch_size=8,
                                vision_use_head=False)  # fmt: skip
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens_per_image,
        image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
    )  # fmt: skip
    save_random_weights(Gemma3ForConditionalGeneration, config, path, seed)
    image_processor = Gemma3ImageProcessorPil(
        size={"height": 64, "width": 64}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    Gemma3Processor(image_processor, tok, chat_template=GEMMA3_CHAT_TEMPLATE,
                    image_seq_length=mm_tokens_per_image).save_pretrained(path)  # fmt: skip
    tok.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]]}, f)
    return path


MISTRAL3_CHAT_TEMPLATE = (
    "<s>{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}[IMG]{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}[/INST]"
    "{% else %}{{ message['content'] }}</s>{% endif %}{% endfor %}"
)
MISTRAL3_SPECIAL_TOKENS = ["<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def write_mistral3(path: str, seed: int = 0, llava: bool = False) -> str:
    """A random Mistral 3 vision-language model (Mistral Small 3.1's architecture: a
    2-layer Pixtral tower with 14-pixel patches, the 2x2 patch merger, a 2-layer Mistral)
    with its tokenizer, image processor (images up to 112 pixels a side) and a chat
    template, saved to ``path``; ``llava``: Pixtral-12B's architecture instead (the same
    tower and language model in a ``LlavaForConditionalGeneration``, no patch merger)."""
    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
    )
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil,
    )

    tok = byte_tokenizer(MISTRAL3_SPECIAL_TOKENS, bos_token="<s>", eos_token="</s>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in MISTRAL3_SPECIAL_TOKENS}
    text = dict(
        model_type="mistral", vocab_size=272, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
    )  # fmt: skip
    vision = dict(
        model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_channels=3, image_size=112, patch_size=14, head_dim=16,
        rope_theta=10000.0,
    )  # fmt: skip
    if llava:
        config = LlavaConfig(
            vision_config=vision, text_config=text, image_token_index=ids["[IMG]"],
            vision_feature_layer=-1, vision_feature_select_strategy="full",
            projector_hidden_act="gelu", multimodal_projector_bias=True,
            tie_word_embeddings=False,
        )  # fmt: skip
        save_random_weights(LlavaForConditionalGeneration, config, path, seed)
    else:
        config = Mistral3Config(
            vision_config=vision, text_config=text, image_token_index=ids["[IMG]"],
            spatial_merge_size=2, vision_feature_layer=-1, projector_hidden_act="gelu",
            multimodal_projector_bias=False, tie_word_embeddings=False,
        )  # fmt: skip
        save_random_weights(Mistral3ForConditionalGeneration, config, path, seed)
    PixtralImageProcessorPil(
        size={"longest_edge": 112}, patch_size={"height": 14, "width": 14}
    ).save_pretrained(path)
    tok.chat_template = MISTRAL3_CHAT_TEMPLATE
    tok.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"]}, f)
    return path


INTERNVL_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>",
                           "<|endoftext|>"]
INTERNVL_CHAT_TEMPLATE = QWEN_CHAT_TEMPLATE.replace(
    "<|vision_start|><|image_pad|><|vision_end|>", "<IMG_CONTEXT>\n"
)


def write_internvl(path: str, seed: int = 0, text_model: str = "qwen2") -> str:
    """A random InternVL 3 in transformers' form (``InternVLForConditionalGeneration``: a
    2-layer InternViT on 56-pixel tiles, pixel shuffle to 4 tokens a tile, a 2-layer
    Qwen2, or ``text_model="qwen3"`` as InternVL 3.5) with its tokenizer, tiling image
    processor (1 to 4 tiles and a thumbnail) and chat template."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil,
    )

    tok = byte_tokenizer(INTERNVL_SPECIAL_TOKENS, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>")  # fmt: skip
    ids = {t: tok.convert_tokens_to_ids(t) for t in INTERNVL_SPECIAL_TOKENS}
    text = dict(
        model_type=text_model, vocab_size=272, hidden_size=64, intermediate_size=128, head_dim=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
    )  # fmt: skip
    vision = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=[56, 56], patch_size=[14, 14], norm_type="layer_norm",
        use_mean_pooling=False,
    )  # fmt: skip
    config = InternVLConfig(
        vision_config=vision, text_config=text, image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=4, downsample_ratio=0.5, projector_hidden_act="gelu",
        vision_feature_layer=-1, vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )  # fmt: skip
    save_random_weights(InternVLForConditionalGeneration, config, path, seed)
    GotOcr2ImageProcessorPil(
        size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1, max_patches=4
    ).save_pretrained(path)  # fmt: skip
    tok.chat_template = INTERNVL_CHAT_TEMPLATE
    tok.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": ids["<|im_end|>"]}, f)
    return path


def save_random_weights(model_cls: Any, config: Any, path: str, seed: int) -> None:
    """A ``model_cls(config)`` with every parameter drawn from N(0, 0.08^2) (seeded), saved
    to ``path``: the configs' ``initializer_range`` gives near-zero logits, these do not."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(path)


def random_image(seed: int, height: int, width: int):
    """A PIL RGB image of uniform random pixels (``numpy.random.RandomState(seed)``)."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))

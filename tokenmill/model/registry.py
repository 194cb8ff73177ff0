"""Architecture name (config.json's ``architectures[0]``) -> model class."""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under tokenmill.model.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "Llama4ForCausalLM": ("llama4", "Llama4ForCausalLM"),
    "Llama4ForConditionalGeneration": ("llama4", "Llama4ForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2VLForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "Mistral3ForConditionalGeneration": ("mistral3", "Mistral3ForConditionalGeneration"),
    "InternVLForConditionalGeneration": ("internvl", "InternVLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
}

# Architectures that take images (a vision encoder whose embeddings fill placeholder tokens).
_MULTIMODAL_MODELS = {
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "LlavaForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "InternVLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
}


# Embedding (pooling) architectures: encoders run by the embedding engine, one forward pass
# per input and no KV cache, instead of the generation engine.
_POOLING_MODELS: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "BertModel"),
    "BertForMaskedLM": ("bert", "BertForMaskedLM"),
}


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no implementation in tokenmill."""


def supported_architectures() -> list[str]:
    return sorted([*_MODELS, *_POOLING_MODELS])


def register_model(
    architecture: str, module: str, class_name: str, pooling: bool = False
) -> None:
    """Add an architecture (module relative to ``tokenmill.model.models``); ``pooling``
    marks an embedding model."""
    (_POOLING_MODELS if pooling else _MODELS)[architecture] = (module, class_name)


def is_pooling_model(architecture: str) -> bool:
    """Whether ``architecture`` is an embedding model (served by the embedding engine)."""
    return architecture in _POOLING_MODELS


def multimodal_architectures() -> list[str]:
    """The architectures whose vision encoder tokenmill runs, sorted."""
    return sorted(_MULTIMODAL_MODELS)


def is_multimodal_model(architecture: str) -> bool:
    """Whether ``architecture`` takes images in its prompts."""
    return architecture in _MULTIMODAL_MODELS


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class implementing ``architecture``.

    Raises:
        UnsupportedArchitectureError: not supported; the message lists what is.
    """
    entry = _MODELS.get(architecture) or _POOLING_MODELS.get(architecture)
    if entry is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}"
        )
    module = importlib.import_module(f"tokenmill.model.models.{entry[0]}")
    return getattr(module, entry[1])

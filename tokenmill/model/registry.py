"""Architecture name (config.json's ``architectures[0]``) -> model class."""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under tokenmill.model.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
}


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no implementation in tokenmill."""


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def register_model(architecture: str, module: str, class_name: str) -> None:
    """Add an architecture (module relative to ``tokenmill.model.models``)."""
    _MODELS[architecture] = (module, class_name)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class implementing ``architecture``.

    Raises:
        UnsupportedArchitectureError: not supported; the message lists what is.
    """
    entry = _MODELS.get(architecture)
    if entry is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}"
        )
    module = importlib.import_module(f"tokenmill.model.models.{entry[0]}")
    return getattr(module, entry[1])

"""Build a model on its device and fill its weights from safetensors, GGUF or dummy values."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from tokenmill.config import KernelConfig, LoadConfig, ModelConfig, kernel_config_scope
from tokenmill.hf_config import ModelLoadError
from tokenmill.model.attention.backend import AttentionBackend
from tokenmill.model.registry import get_model_class

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def expected_checkpoint_names(model: nn.Module) -> list[str]:
    """Hugging Face checkpoint names that would fill ``model`` (merged params expanded)."""
    names = []
    mapping = getattr(model, "stacked_params_mapping", [])
    for name, _ in model.named_parameters():
        parts = [(p, c) for p, c, _ in mapping if f".{p}." in name]
        if parts:
            names += [name.replace(f".{p}.", f".{c}.") for p, c in parts]
        else:
            names.append(name)
    if "lm_head.weight" not in names:
        names.append("lm_head.weight")
    return names


def release_freed_host_memory() -> None:
    """Give the heap memory that loading freed (read buffers, unpacked blocks) back to the
    OS: glibc keeps freed small and medium blocks in its arenas otherwise, and the process
    would stay that much larger for its whole life. No-op off glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resolve_load_format(model_config: ModelConfig, load_config: LoadConfig) -> str:
    fmt = load_config.load_format
    if fmt == "auto":
        return "gguf" if model_config.is_gguf else "safetensors"
    if fmt == "gguf" and not model_config.is_gguf:
        raise ModelLoadError(f"--load-format gguf needs a .gguf file, got {model_config.model}")
    if fmt == "safetensors" and model_config.is_gguf:
        raise ModelLoadError(f"{model_config.model} is a GGUF file, not safetensors")
    return fmt


def get_model(
    model_config: ModelConfig,
    load_config: LoadConfig,
    device: torch.device,
    backend: type[AttentionBackend],
    kernel_config: KernelConfig | None = None,
) -> nn.Module:
    """Build the model on ``device`` in the configured dtype, its layers taking their kernel
    choices from ``kernel_config`` (default: ``KernelConfig()``), and load its weights.

    Parameters are created on the target device, so weights are copied straight there
    (tensor by tensor from memory-mapped files).

    Raises:
        ModelLoadError: missing/corrupt files or tensors (names the file and tensor).
        UnsupportedArchitectureError: the architecture is not implemented.
    """
    from tokenmill.model.layers.quantization import (
        get_quantization_config,
        quantization_context,
    )
    from tokenmill.model.loader.quantized_weights import (
        create_quantized_weights,
        process_quantized_weights,
    )
    from tokenmill.model.loader.weights import initialize_dummy_weights

    fmt = resolve_load_format(model_config, load_config)
    model_cls = get_model_class(model_config.architecture)
    start = time.perf_counter()
    method = model_config.quantization
    if fmt == "dummy" and method == "gguf":
        method = None  # random weights are not GGUF blocks
    quant_config = get_quantization_config(method, model_config.hf_config, device.type)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype(model_config.dtype))
    try:
        with (
            torch.device(device),
            kernel_config_scope(kernel_config or KernelConfig()),
            quantization_context(quant_config),
        ):
            model = model_cls(model_config, backend)
            if quant_config is not None:
                create_quantized_weights(model, quant_config)
    finally:
        torch.set_default_dtype(old_dtype)
    model.eval().requires_grad_(False)
    with torch.no_grad():
        if fmt == "dummy":
            initialize_dummy_weights(model, seed=model_config.seed)
        elif fmt == "gguf":
            from tokenmill.model.loader.gguf_loader import iterate_gguf

            hf = model_config.hf_config
            weights = iterate_gguf(
                model_config.model,
                expected_checkpoint_names(model),
                hf.num_attention_heads,
                hf.get("num_key_value_heads", hf.num_attention_heads),
                keep_quantized=quant_config is not None and quant_config.name == "gguf",
            )
            model.load_weights(weights, source=model_config.model)
        else:
            from tokenmill.model.loader.safetensors_loader import (
                iterate_safetensors,
                list_safetensors_files,
            )

            files = list_safetensors_files(model_config.model)
            model.load_weights(iterate_safetensors(files), source=model_config.model)
        if quant_config is not None:
            process_quantized_weights(model, device)
    if device.type == "cpu":
        release_freed_host_memory()
    weight_bytes = sum(
        t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
    )
    logger.info(
        "Loaded %s (%s, %s weights%s) on %s in %.1f s: %.1f MiB of weights",
        model_config.architecture,
        model_config.dtype,
        fmt,
        f", {quant_config.describe()}" if quant_config is not None else "",
        device,
        time.perf_counter() - start,
        weight_bytes / 2**20,
    )
    return model

"""Build a model on its device and fill its weights from safetensors, GGUF or dummy values."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch
from torch import nn

from tokenmill.config import KernelConfig, LoadConfig, ModelConfig, kernel_config_scope
from tokenmill.distributed.parallel_state import (
    get_pipeline_parallel_rank,
    get_pipeline_parallel_world_size,
    pipeline_stage_layers,
)
from tokenmill.hf_config import ModelLoadError
from tokenmill.model.attention.backend import AttentionBackend
from tokenmill.model.loader.weights import (
    other_stage_prefixes,
    problems_message,
    skip_weight_writes,
)
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
    # A pipeline stage names the whole model's embedding and final norm too: a file holds
    # them (and a tied LM head on the last stage loads the embedding).
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        if name not in names and (name == "lm_head.weight" or other_stage_prefixes(model)):
            names.append(name)
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


def loaded_quantization(model_config: ModelConfig, fmt: str) -> str | None:
    """The quantization method the weights are loaded with: the configured one, except for
    random weights of a GGUF model (which are not GGUF blocks)."""
    if fmt == "dummy" and model_config.quantization == "gguf":
        return None
    return model_config.quantization


def loaded_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors a checkpoint load fills, by name: every parameter, and the buffers of
    layers with a quantization method (their weights in converted form: int4 planes, GGUF
    blocks). Buffers computed at construction (rotary tables) are not among them. A tensor
    reachable under several names (tied weights) is listed under each."""
    tensors = list(model.named_parameters(remove_duplicate=False))
    for prefix, module in model.named_modules(remove_duplicate=False):
        if getattr(module, "quant_method", None) is not None:
            tensors += [(f"{prefix}.{n}", b) for n, b in module.named_buffers(recurse=False)]
    return tensors


def get_model(
    model_config: ModelConfig,
    load_config: LoadConfig,
    device: torch.device,
    backend: type[AttentionBackend],
    kernel_config: KernelConfig | None = None,
    model_cls: type[nn.Module] | None = None,
) -> nn.Module:
    """Build the model on ``device`` in the configured dtype, its layers taking their kernel
    choices from ``kernel_config`` (default: ``KernelConfig()``), and load its weights.

    ``model_cls`` builds another model from the same checkpoint instead of the one its
    architecture names (e.g. ``DeepseekMTP``, the draft layers of a DeepSeek-V3 checkpoint).

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

    fmt = resolve_load_format(model_config, load_config)
    model_cls = model_cls or get_model_class(model_config.architecture)
    start = time.perf_counter()
    method = loaded_quantization(model_config, fmt)
    if fmt == "dummy" and model_config.quantization == "gguf":
        # random GGUF blocks would need a type per tensor the file names; dense weights of
        # the model's dtype stand in, at their size rather than the file's
        logger.warning(
            "--load-format dummy: random %s weights stand in for %s's GGUF blocks (memory and "
            "speed are not the quantized model's)", model_config.dtype, model_config.model,
        )
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
    keep_gguf = quant_config is not None and quant_config.name == "gguf"
    load_weights(model, model_config, fmt, keep_quantized=keep_gguf)
    if quant_config is not None:
        with torch.no_grad():
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


def load_weights(
    model: nn.Module,
    model_config: ModelConfig,
    fmt: str,
    path: str | None = None,
    keep_quantized: bool = False,
    dry_run: bool = False,
) -> None:
    """Fill ``model``'s parameters in place from a checkpoint.

    Args:
        model: a model built for ``model_config``.
        model_config: its configuration (head counts for GGUF's permuted tensors).
        fmt: ``dummy``, ``gguf`` or ``safetensors``.
        path: a model folder, a ``.safetensors`` file or a ``.gguf`` file; default: the
            model's own.
        keep_quantized: GGUF files: hand the layers their blocks instead of dequantized
            tensors (the model was built with the GGUF quantization methods).
        dry_run: run the same load from the files' headers (safetensors) or tensor infos
            (GGUF) with every write skipped (``skip_weight_writes``): it raises what the
            load would (names, shapes as each rank's weight loaders check them, missing
            tensors) and leaves the weights as they are.

    Raises:
        ModelLoadError: missing or corrupt files or tensors, or a checkpoint that does not
            fill every parameter (the message names the tensors).
    """
    from tokenmill.model.loader.weights import initialize_dummy_weights

    path = path or model_config.model
    dry = skip_weight_writes() if dry_run else contextlib.nullcontext()
    with torch.no_grad(), dry:
        if fmt == "dummy":
            if not dry_run:
                initialize_dummy_weights(model, seed=model_config.seed)
        elif fmt == "gguf":
            from tokenmill.model.loader.gguf_loader import iterate_gguf

            hf = model_config.hf_config
            weights = iterate_gguf(
                path,
                expected_checkpoint_names(model),
                hf.num_attention_heads,
                hf.get("num_key_value_heads", hf.num_attention_heads),
                keep_quantized=keep_quantized,
                layers=range(*pipeline_stage_layers(
                    model_config.get_num_layers(),
                    get_pipeline_parallel_rank(),
                    get_pipeline_parallel_world_size(),
                )),
                shapes_only=dry_run,
            )  # fmt: skip
            model.load_weights(weights, source=path)
        else:
            from tokenmill.model.loader.safetensors_loader import (
                iterate_safetensors,
                list_safetensors_files,
            )

            files = [path] if path.endswith(".safetensors") else list_safetensors_files(path)
            model.load_weights(iterate_safetensors(files, shapes_only=dry_run), source=path)


def check_weights(
    model: nn.Module,
    model_config: ModelConfig,
    load_config: LoadConfig,
    path: str | None = None,
) -> None:
    """Check that the checkpoint at ``path`` fits the running ``model`` as
    ``reload_weights`` would load it, writing nothing.

    Unquantized weights: a dry run of the load (``load_weights(dry_run=True)``: the same
    name mapping and weight loaders, this rank's slices and pipeline stage) from the files'
    headers (safetensors) or tensor infos (GGUF). Quantized weights are converted after
    loading, so only their checkpoint's kind is checked here; ``reload_weights`` checks
    their tensors on the second model it builds, before copying any.

    Args:
        model, model_config, load_config, path: as given to ``reload_weights``.

    Raises:
        ModelLoadError: as ``reload_weights`` (the message names every tensor that does not
            fit, the first few).
    """
    fmt, method = _reload_format(model_config, load_config, path)
    if method is None:
        load_weights(model, model_config, fmt, path, dry_run=True)


def _reload_format(
    model_config: ModelConfig, load_config: LoadConfig, path: str | None
) -> tuple[str, str | None]:
    """``(load format, quantization method)`` of weights loaded in place from ``path``.

    Raises:
        ModelLoadError: a checkpoint of the other kind than the running model's quantized
            weights.
    """
    fmt = resolve_load_format(model_config, load_config)
    if path is not None:
        fmt = "gguf" if path.endswith(".gguf") else "safetensors"
    method = loaded_quantization(model_config, fmt)
    if method is not None and (method == "gguf") != (fmt == "gguf"):
        want = "a .gguf file" if method == "gguf" else "a model folder or .safetensors file"
        raise ModelLoadError(
            f"{path}: the running model keeps its weights {method}-quantized, so new weights "
            f"must come as {want} quantized the same way"
        )
    return fmt, method


def reload_weights(
    model: nn.Module,
    model_config: ModelConfig,
    load_config: LoadConfig,
    device: torch.device,
    backend: type[AttentionBackend],
    kernel_config: KernelConfig | None = None,
    path: str | None = None,
    checked: bool = False,
) -> None:
    """Load weights again into the running ``model``, in place (its tensors keep their
    storage, so CUDA graphs and views of them stay valid). Nothing is written unless the
    whole checkpoint fits the model.

    Unquantized weights stream from the checkpoint into the parameters once
    ``check_weights`` has passed. Quantized ones are converted after loading (repacked,
    split into segments), so a second model is built from the checkpoint beside the running
    one and its tensors are copied over by name once all of them match: that takes a second
    copy of the weights on ``device`` while it runs. A file that passes the check and then
    cannot be read (an I/O error, GGUF blocks that do not dequantize) can still fail after
    some weights are written. With several ranks each checks its own share: call
    ``check_weights`` on every rank first (``Executor.check_weights``).

    Args:
        model: the running model, built by ``get_model`` from these configurations.
        model_config, load_config, device, backend, kernel_config: as given to ``get_model``.
        path: a model folder, a ``.safetensors`` file or a ``.gguf`` file; default: the
            model's own checkpoint, in its load format.
        checked: the caller has run ``check_weights`` on ``path`` (not run again).

    Raises:
        ModelLoadError: unreadable files, tensors that do not fit the model (the message
            names them; nothing was written), or a checkpoint of the other kind than the
            running model's quantized weights (a safetensors one for GGUF blocks, or a
            ``.gguf`` file for a safetensors quantization).
    """
    if not checked:
        check_weights(model, model_config, load_config, path)
    fmt, method = _reload_format(model_config, load_config, path)
    if method is None:
        load_weights(model, model_config, fmt, path)
        return
    fresh_config = dataclasses.replace(model_config, model=path or model_config.model)
    fresh_load = dataclasses.replace(load_config, load_format=fmt)
    fresh = get_model(fresh_config, fresh_load, device, backend, kernel_config)
    source = dict(loaded_tensors(fresh))
    pairs = [(tensor, source.get(name), name) for name, tensor in loaded_tensors(model)]
    problems = [
        f"tensor {name!r} is {_describe(new)} after loading, the running model's is "
        f"{_describe(tensor)}"
        for tensor, new, name in pairs
        if new is None or new.shape != tensor.shape or new.dtype != tensor.dtype
    ]
    if problems:
        raise ModelLoadError(problems_message(fresh_config.model, problems))
    with torch.no_grad():
        for tensor, new, _ in pairs:
            tensor.copy_(new)
        _copy_dense_up_weights(fresh, model)
    del fresh, source, pairs
    if device.type == "cpu":
        release_freed_host_memory()


def _describe(tensor: torch.Tensor | None) -> str:
    return "missing" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"


def _copy_dense_up_weights(fresh: nn.Module, model: nn.Module) -> None:
    """MLA layers with a quantized ``kv_b_proj`` keep a dense copy of it for the absorbed
    decode (``MLAImpl.dequantize_up_projection``), computed once after loading and not a
    loaded tensor: copy the fresh model's in place (CUDA graphs read its storage)."""
    from tokenmill.model.layers.mla import MLAAttention

    source = {n: m for n, m in fresh.named_modules() if isinstance(m, MLAAttention)}
    for name, layer in model.named_modules():
        if isinstance(layer, MLAAttention) and layer.impl.dense_up_weight is not None:
            layer.impl.dense_up_weight.copy_(source[name].impl.dense_up_weight)

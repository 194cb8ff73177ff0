"""Put checkpoint tensors into a model's parameters (one generic loader for every model).

A model declares how checkpoint names map onto its merged parameters
(``stacked_params_mapping``: ``(our_param_part, checkpoint_part, shard_id)``); each
parameter's ``weight_loader`` slices and copies (and, with tensor parallelism, shards).
Under ``skip_weight_writes`` the same code is a dry run: every check, no write.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from tokenmill.hf_config import ModelLoadError
from tokenmill.model.layers.linear import default_weight_loader
from tokenmill.model.layers.quantization.bitsandbytes import checkpoint_param_name
from tokenmill.model.layers.stage import PPMissingLayer
from tokenmill.model.layers.weight_shape import WeightShapeError

# Checkpoint tensors that hold no weights (buffers transformers used to save).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# Per-layer FP8 KV-cache scales of FP8 checkpoints (vLLM's and compressed-tensors' names,
# and the older ``k_proj.output_scale``) -> the attention layer's attribute; query and
# softmax-probability scales are read and dropped (they serve FP8 attention math).
KV_SCALE_SUFFIXES = {
    ".k_scale": "k_scale", ".v_scale": "v_scale",
    ".k_proj.output_scale": "k_scale", ".v_proj.output_scale": "v_scale",
    ".q_scale": None, ".prob_scale": None, ".q_proj.output_scale": None,
}

# Problems (and missing parameters) a load error lists.
MAX_LISTED = 8
# Names of the tensors of quantized checkpoints (GPTQ/AWQ, compressed-tensors, bitsandbytes,
# FP8) that an unquantized layer has no parameter for.
QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".g_idx", ".weight_packed", ".weight_scale",
                      ".weight_zero_point", ".weight_g_idx", ".SCB", ".weight.absmax",
                      ".weight_scale_inv")  # fmt: skip


def load_model_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: list[tuple[str, str, str | int]],
    skip: tuple[str, ...] = (),
    source: str = "checkpoint",
) -> None:
    """Load ``(name, tensor)`` pairs into ``model``.

    Args:
        model: the model; parameter names follow Hugging Face's checkpoint names except
            for the merged parameters named in ``stacked_params_mapping``.
        weights: checkpoint tensors by Hugging Face name (any dtype; converted on copy).
        stacked_params_mapping: ``(merged_part, checkpoint_part, shard_id)`` triples.
        skip: checkpoint names to ignore (e.g. ``lm_head.weight`` with tied embeddings).
        source: the file(s) the tensors come from, for error messages.

    Checkpoint tensors of modules another pipeline stage holds (``PPMissingLayer``) are
    skipped unread. A tensor that does not fit is noted and the others still load, so one
    error names every problem (the first ``MAX_LISTED``).

    Raises:
        ModelLoadError: tensors of the wrong shape, checkpoint tensors that match no
            parameter, or parameters that got no tensor. The message names them.
    """
    elsewhere = other_stage_prefixes(model)
    params = dict(model.named_parameters())
    for name, param in params.items():
        param._tm_name = name  # type: ignore[attr-defined]
    expected_shards: dict[str, set] = {}
    for part, _ckpt_part, shard_id in stacked_params_mapping:
        for name in params:
            if f".{part}." in name or name.startswith(f"{part}."):
                expected_shards.setdefault(name, set()).add(shard_id)
    loaded: dict[str, set] = {}
    problems: list[str] = []
    unmatched: list[str] = []
    for ckpt_name, tensor in weights:
        if ckpt_name in skip or ckpt_name.endswith(IGNORED_SUFFIXES):
            continue
        if elsewhere and ckpt_name.startswith(elsewhere):
            continue
        if ckpt_name.endswith(tuple(KV_SCALE_SUFFIXES)):
            _load_kv_scale(model, ckpt_name, tensor, source)
            continue
        name, shard_id = checkpoint_param_name(ckpt_name), None
        for part, ckpt_part, sid in stacked_params_mapping:
            if f".{ckpt_part}." in name:
                candidate = name.replace(f".{ckpt_part}.", f".{part}.")
                if candidate in params:
                    name, shard_id = candidate, sid
                    break
        param = params.get(name)
        if param is None:
            unmatched.append(ckpt_name)
            problems.append(
                f"tensor {ckpt_name!r} does not belong to any parameter of {type(model).__name__}"
            )
            continue
        loaded.setdefault(name, set()).add(shard_id)  # a wrong shape is its own problem
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is None:
                default_weight_loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except WeightShapeError as e:
            named = str(e).startswith(f"tensor {ckpt_name!r}")  # the message names it already
            problems.append(str(e) if named else f"tensor {ckpt_name!r}: {e}")
    quantized = [name for name in unmatched if name.endswith(QUANTIZED_SUFFIXES)]
    if quantized:
        # Quantized tensors matching no parameter: the config names no (or another)
        # quantization method, which is the one problem worth reading first.
        problems.insert(0, (
            f"tensors such as {quantized[0]!r} are quantized, but the model was built "
            "without that quantization: its config.json's quantization_config "
            "(quant_method) is missing or names another method"
        ))
    missing = _missing_parameters(params, loaded, expected_shards)
    if missing:
        problems.append(
            f"no weights for {len(missing)} parameter(s) of {type(model).__name__}: "
            f"{', '.join(missing[:MAX_LISTED])}{' ...' if len(missing) > MAX_LISTED else ''}"
        )
    if problems:
        raise ModelLoadError(problems_message(source, problems))


def _missing_parameters(
    params: dict[str, nn.Parameter], loaded: dict[str, set], expected_shards: dict[str, set]
) -> list[str]:
    """The parameters (or merged parts: ``name (shards ['k'])``) no tensor filled."""
    missing = []
    for name in params:
        got = loaded.get(name)
        if got is None:
            if not getattr(params[name], "tm_optional", False):  # e.g. quantization state
                missing.append(name)
        elif name in expected_shards and None not in got and got != expected_shards[name]:
            missing.append(f"{name} (shards {sorted(map(str, expected_shards[name] - got))})")
    return missing


def problems_message(source: str, problems: list[str]) -> str:
    """One error message for ``problems`` of the checkpoint ``source`` (the first
    ``MAX_LISTED``)."""
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    listed = "; ".join(problems[:MAX_LISTED])
    more = f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return f"{source}: {len(problems)} problems: {listed}{more}"


def _load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor, source: str) -> None:
    """Give the attention layer under ``name``'s block its K or V cache scale.

    Raises:
        ModelLoadError: no attention layer there, or not one value.
    """
    from tokenmill.model.layers.attention import Attention

    suffix = next(s for s in KV_SCALE_SUFFIXES if name.endswith(s))
    attr = KV_SCALE_SUFFIXES[suffix]
    if attr is None:
        return
    block = name[: -len(suffix)].removesuffix(".attn")
    try:
        parent = model.get_submodule(block)
    except AttributeError:
        parent = None
    layers = [m for m in parent.modules() if isinstance(m, Attention)] if parent else []
    if len(layers) != 1 or tensor.numel() != 1:
        raise ModelLoadError(f"{source}: tensor {name!r} is not one KV-cache scale of an "
                             "attention layer")
    if tensor.is_meta:  # a dry run: no value to check or set
        return
    value = float(tensor.float().reshape(()))
    if not value > 0:
        raise ModelLoadError(f"{source}: tensor {name!r}: KV-cache scale {value} is not positive")
    setattr(layers[0], attr, value)


class _SkipWrites(TorchFunctionMode):
    """Runs every in-place torch call (``copy_``, ``zero_``, ``t[i] = x``, ``out=``,
    ``.data = x``) on meta stand-ins of its tensors instead: the same shape and dtype
    checks, nothing written. Other calls run as they are."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        writes = name.endswith("_") and not name.endswith("__")
        if not (writes or name in ("__setitem__", "__set__") or "out" in kwargs):
            return func(*args, **kwargs)
        func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
        return kwargs["out"] if "out" in kwargs else args[0]


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not x.is_meta:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


@contextmanager
def skip_weight_writes() -> Iterator[None]:
    """A dry run of loading code: every in-place torch call made in this thread runs on
    meta tensors of its arguments' shapes (the checks run, no tensor is written).

    With checkpoint tensors that are meta too (``iterate_safetensors(shapes_only=True)``)
    a whole load runs from the file headers: names, shapes per rank, missing tensors.
    """
    with _SkipWrites():
        yield


def other_stage_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Name prefixes (``model.layers.7.``) of the modules of ``model`` that other pipeline
    stages hold: placeholders without weights (``PPMissingLayer``)."""
    return tuple(
        f"{name}."
        for name, module in model.named_modules()
        if isinstance(module, PPMissingLayer)
    )


def initialize_dummy_weights(model: nn.Module, seed: int = 0, low: float = -1e-3,
                             high: float = 1e-3) -> None:
    """Fill every parameter with uniform random values from ``seed`` (no file is read).

    For benchmarks: speed does not depend on weight values. Small values keep activations
    finite in any dtype. Parameters that are not floats (packed quantized weights) carry
    their own ``dummy_fill(param, generator)``.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            fill = getattr(param, "dummy_fill", None)
            if fill is not None:
                gen = torch.Generator(device=param.device).manual_seed(seed)
                seed += 1
                fill(param, gen)
                continue
            if not param.is_floating_point():
                _fill_dummy_integers(name, param, seed)
                continue
            if param.element_size() == 1:  # FP8: no random fill of its own
                values = torch.empty(param.shape, device=param.device)
                values.uniform_(low / 1e-3, high / 1e-3, generator=generator
                                if param.device.type == "cpu" else None)
                param.copy_(values)
                continue
            if param.device.type == "cpu":
                param.uniform_(low, high, generator=generator)
            else:
                # Draw on the device: a host round trip of 16 GB would dominate start-up.
                gen = torch.Generator(device=param.device).manual_seed(seed)
                seed += 1
                param.uniform_(low, high, generator=gen)


def _fill_dummy_integers(name: str, param: torch.Tensor, seed: int) -> None:
    """Quantized checkpoints' integer tensors: random bits for packed values and zero
    points; a group index (``g_idx``) keeps the in-order groups it was created with."""
    if name.endswith("g_idx") or param.numel() == 0:
        return
    gen = torch.Generator(device=param.device).manual_seed(seed)
    param.random_(generator=gen)

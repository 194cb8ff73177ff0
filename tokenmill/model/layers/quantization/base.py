"""The quantization seam: a ``QuantizationConfig`` (one per checkpoint) hands each linear
layer a ``LinearMethod`` that creates the layer's parameters, loads checkpoint tensors into
them, post-processes them once loaded and computes the product (vLLM's
``QuantizationConfig`` / ``LinearMethodBase`` split).

Parameters carry their layout (``set_layout``) so one loader slices any of them for merged
layers (q/k/v, gate/up) and tensor-parallel ranks: which dimension indexes output features
and input features, and how many features one element spans along each (8 for int4 values
packed in int32, the group size for group scales).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from tokenmill.config import current_kernel_config
from tokenmill.hf_config import ModelLoadError
from tokenmill.kernels.quant.int4_cpu import keeps_bf16_copy
from tokenmill.model.layers.quantization.tensors import as_float
from tokenmill.model.layers.weight_shape import WeightShapeError, check_shape


def keeps_cpu_bf16_copy() -> bool:
    """Whether the quantized CPU weights of the model being built keep a bfloat16 copy
    (``KernelConfig.cpu_bf16_weights``); read while the model is built, inside its
    ``kernel_config_scope``."""
    return keeps_bf16_copy(current_kernel_config().cpu_bf16_weights)


class QuantizationError(ModelLoadError, ValueError):
    """A checkpoint's quantization is unsupported or inconsistent; the message says which.
    (A ``ModelLoadError``: reported at start-up in one line, without a traceback.)"""


@dataclass(frozen=True)
class ShardSlice:
    """Where (part of) a checkpoint tensor goes, in output/input features.

    Attributes:
        shard_id: the merged part ("q", "k", "v", 0, 1, ...) or None for a whole tensor.
        dst_start: output offset of the part in the layer (None: the whole layer).
        size: output features of the part on this rank (None: the whole layer).
        src_start: output offset to read from the checkpoint tensor (tensor-parallel rank).
        in_start, in_size: input features to read (row-parallel ranks); None: all.
        src_size: output features the checkpoint tensor must have (the whole part, or the
            fused parts, unsharded); None: not checked here. A tensor of another size is
            refused rather than cut to this rank's slice.
    """

    shard_id: Any = None
    dst_start: int | None = None
    size: int | None = None
    src_start: int = 0
    in_start: int | None = None
    in_size: int | None = None
    src_size: int | None = None


# Merged layers and the checkpoint layers each holds (a checkpoint's ignore list names those).
MERGED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_parts(prefix: str) -> list[str]:
    """The checkpoint layers a layer called ``prefix`` holds (its own name unless merged)."""
    head, _, leaf = prefix.rpartition(".")
    parts = MERGED_PARTS.get(leaf)
    if parts is None:
        return [prefix]
    return [f"{head}.{p}" if head else p for p in parts]


def name_listed(name: str, patterns: list[str]) -> bool:
    """``name`` is one of ``patterns`` (full names, name suffixes, or ``re:`` regexes), as
    compressed-tensors' ``ignore`` and FP8's ``ignored_layers`` list layers."""
    for entry in patterns:
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif name == entry or name.endswith("." + entry):
            return True
    return False


def name_targeted(name: str, targets: list[str]) -> bool:
    """Whether a linear layer ``name`` is one of a compressed-tensors config group's
    ``targets``: the class name ``Linear`` (every linear layer), a full name or name
    suffix, or a ``re:`` regex; other class names (``Embedding``) name no linear layer."""
    return "Linear" in targets or name_listed(name, targets)


def left_unquantized(prefix: str, ignore: list[str], targets: list[str]) -> bool:
    """Whether a checkpoint whose ``ignore`` list and config group ``targets`` (names or
    ``re:`` patterns, see ``name_listed`` and ``name_targeted``) leave the layer ``prefix``
    unquantized (``layer_ignored``: a merged layer by its parts)."""
    return layer_ignored(prefix, lambda name: name_listed(name, ignore)
                         or not name_targeted(name, targets))


def layer_names(config: dict[str, Any], key: str) -> list[str]:
    """``config[key]``: a list of layer names or patterns (absent or null: empty).

    Raises:
        QuantizationError: anything but a list of strings (a bare string would otherwise
            be read character by character).
    """
    value = config.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise QuantizationError(
            f"quantization_config {key} must be a list of layer names, got {value!r}"
        )
    return value


def layer_ignored(prefix: str, skipped: Callable[[str], bool]) -> bool:
    """Whether the checkpoint leaves the layer ``prefix`` unquantized, ``skipped`` telling
    for each checkpoint layer; a merged layer is checked by its parts.

    Raises:
        QuantizationError: some of a merged layer's parts are left unquantized and others
            not (one layer holds one precision, as in vLLM).
    """
    names = checkpoint_parts(prefix)
    parts = [skipped(name) for name in names]
    if any(parts) and not all(parts):
        kept = [n.rpartition(".")[2] for n, p in zip(names, parts, strict=True) if p]
        raise QuantizationError(
            f"{prefix}: the checkpoint leaves {', '.join(kept)} unquantized but not the other "
            "parts of this merged layer; its parts must share one precision"
        )
    return all(parts)


def set_layout(
    param: nn.Parameter,
    output_dim: int | None = 0,
    input_dim: int | None = 1,
    output_div: int | Fraction = 1,
    input_div: int | Fraction = 1,
) -> nn.Parameter:
    """Record how ``param`` indexes features (see the module docstring) and return it.

    Args:
        output_dim: dimension of output features, None if the tensor has none (copied whole).
        input_dim: dimension of input features, None if it has none.
        output_div: output features per element along ``output_dim``.
        input_div: input features per element along ``input_dim``.
    """
    param.output_dim = output_dim  # type: ignore[attr-defined]
    param.input_dim = input_dim  # type: ignore[attr-defined]
    param.output_div = output_div  # type: ignore[attr-defined]
    param.input_div = input_div  # type: ignore[attr-defined]
    return param


def _units(features: int, div: int | Fraction, what: str) -> int:
    value = Fraction(features) / Fraction(div)
    if value.denominator != 1:
        raise QuantizationError(
            f"{what}: {features} features do not split into whole elements of {div}"
        )
    return int(value)


def _narrow(loaded: torch.Tensor, dim: int, start: int, size: int, name: str) -> torch.Tensor:
    """``loaded.narrow(dim, start, size)``.

    Raises:
        WeightShapeError: the range runs past the tensor (it is too small for this rank).
    """
    if start + size > loaded.shape[dim]:
        raise WeightShapeError(
            f"tensor {name!r} has shape {tuple(loaded.shape)}, too small for elements "
            f"{start}..{start + size} along dimension {dim}"
        )
    return loaded.narrow(dim, start, size)


def copy_shard(param: torch.Tensor, loaded: torch.Tensor, s: ShardSlice, name: str) -> None:
    """Copy the slice ``s`` of ``loaded`` into ``param`` following ``param``'s layout.

    Raises:
        WeightShapeError: the shapes disagree (the message names the tensor).
    """
    loaded = as_float(loaded)
    if loaded.is_floating_point() and not (param.is_floating_point() or param.dtype == torch.bool):
        # Packed integers (int4 words, zero points, g_idx) read from floats lose bits.
        raise WeightShapeError(
            f"tensor {name!r} is {loaded.dtype}; this layout keeps it as {param.dtype} "
            "(packed integers)"
        )
    if not loaded.is_floating_point() and param.is_floating_point():
        # Integer scales would be converted silently: the checkpoint was written wrongly.
        raise WeightShapeError(
            f"tensor {name!r} is {loaded.dtype}; this layout keeps it as {param.dtype} "
            "(floating point)"
        )
    if not (loaded.is_floating_point() or param.is_floating_point()) and (
        loaded.element_size() < param.element_size()
    ):
        # int4 words read from 8- or 16-bit integers lost their upper nibbles.
        raise WeightShapeError(
            f"tensor {name!r} is {loaded.dtype}; this layout keeps it as {param.dtype} "
            f"(packed {8 * param.element_size()}-bit integers)"
        )
    out_dim = getattr(param, "output_dim", 0)
    in_dim = getattr(param, "input_dim", None if param.dim() == 1 else 1)
    target = param.data
    if out_dim is not None and s.size is not None:
        div = getattr(param, "output_div", 1)
        size = _units(s.size, div, name)
        if s.dst_start is not None:
            target = target.narrow(out_dim, _units(s.dst_start, div, name), size)
        if s.src_size is not None and loaded.shape[out_dim] != _units(s.src_size, div, name):
            raise WeightShapeError(
                f"tensor {name!r} has shape {tuple(loaded.shape)}, expected "
                f"{_units(s.src_size, div, name)} along dimension {out_dim}"
            )
        if s.src_start or loaded.shape[out_dim] != size:
            loaded = _narrow(loaded, out_dim, _units(s.src_start, div, name), size, name)
    if in_dim is not None and s.in_start is not None and s.in_size is not None:
        div = getattr(param, "input_div", 1)
        loaded = _narrow(
            loaded, in_dim, _units(s.in_start, div, name), _units(s.in_size, div, name), name
        )
    label = name if s.shard_id is None else f"{name}[{s.shard_id}]"
    check_shape(label, target.shape, loaded.shape)
    target.copy_(loaded)


class LinearMethod(ABC):
    """How one linear layer holds its weight and computes ``y = x W^T (+ b)``.

    Shapes: ``x [T, input_size]`` -> ``[T, output_size]`` (per tensor-parallel rank).
    """

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None:
        """Register the layer's weight parameters (bias excluded: the layer owns it).

        Args:
            layer: the linear layer (parameters are set on it by name, as the checkpoint
                names them, e.g. ``qweight``).
            input_size: input features on this rank.
            output_sizes: output features of each merged part on this rank.
            dtype: the activations' dtype.
        """

    def load_weight(
        self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, s: ShardSlice
    ) -> None:
        """Put (a slice of) one checkpoint tensor into ``param`` (default: ``copy_shard``)."""
        copy_shard(param, loaded, s, getattr(param, "_tm_name", "?"))

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Convert the loaded checkpoint tensors into the form ``apply`` reads (once)."""

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x W^T (+ bias)``: ``[T, K]`` -> ``[T, N]`` in ``x``'s dtype."""

    def apply_gated(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """``silu(y[:, :N/2]) * y[:, N/2:]`` of ``y = x W^T (+ bias)`` in the product's own
        launch, where the method has such a kernel; None (the default) where it has not, and
        the caller runs ``apply`` and then the gate.

        Shapes: ``x [M, K]`` (gate rows over up rows in ``W``) -> ``[M, N/2]``.
        """
        return None

    @property
    def is_unquantized(self) -> bool:
        return False


class QuantizationConfig(ABC):
    """A checkpoint's quantization: which layers it covers and their methods.

    Attributes:
        name: the ``--quantization`` spelling (vLLM's).
    """

    name: str = ""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        """The method of the linear layer called ``prefix`` (unquantized where the
        checkpoint leaves it so)."""

    def get_moe_method(self, layer: nn.Module, prefix: str) -> Any:
        """The method of the MoE experts called ``prefix``; None keeps them unquantized.

        Raises:
            QuantizationError: the method cannot run these experts.
        """
        return None

    def quantizes_embeddings(self) -> bool:
        """Whether token embeddings and the LM head stay quantized (GGUF)."""
        return False

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.name

    def check_dtype(self, dtype: str, device: str) -> None:  # noqa: B027
        """Refuse an activation dtype or device the method cannot run.

        Raises:
            QuantizationError: with a one-line reason.
        """

"""compressed-tensors checkpoints (llm-compressor's output): 4-bit integer weights with
16-bit activations (W4A16, the ``pack-quantized`` format), and FP8 weights with FP8 or
16-bit activations (the ``float-quantized`` format; run by ``quantization.fp8``).

Per layer: ``weight_packed [N, K/8]`` int32 (signed values plus 8, packed along K),
``weight_scale [N, K/G]``, ``weight_shape [2]``, and for asymmetric schemes
``weight_zero_point [N/8, K/G]`` (packed along N), for act-order ``weight_g_idx [K]``
(compressed-tensors' ``PackedQuantizationCompressor``). Weights dequantize as
``(q - zero_point) * scale`` with signed ``q``; they then run as the other int4 formats
(``tokenmill.model.layers.quantization.int4``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.kernels.quant.int4_pack import unpack_cols, unpack_rows
from tokenmill.model.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    ShardSlice,
    layer_names,
    left_unquantized,
)
from tokenmill.model.layers.quantization.int4 import (
    Int4LinearMethod,
    Int4Weights,
    _param,
    in_order_g_idx,
    sort_by_group,
)
from tokenmill.model.layers.weight_shape import WeightShapeError

SUPPORTED = "compressed-tensors W4A16: format pack-quantized, 4-bit int weights, group or " \
    "channel strategy, no activation quantization"


def parse_w4a16(qc: dict[str, Any]) -> dict[str, Any]:
    """The weight scheme of a W4A16 ``quantization_config`` (one config group).

    Raises:
        QuantizationError: any other scheme (FP8, W8A8, several groups, other formats).
    """
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizationError(
            f"compressed-tensors with {len(groups)} config groups is not supported ({SUPPORTED})"
        )
    group = next(iter(groups.values()))
    weights = _normalized(group.get("weights") or {})
    fmt = group.get("format") or qc.get("format")
    if weights.get("type") == "float" or "float" in str(fmt):
        raise QuantizationError(f"compressed-tensors {fmt} is FP8, not W4A16")
    if (
        fmt != "pack-quantized"
        or weights.get("num_bits") != 4
        or weights.get("type", "int") != "int"
        or group.get("input_activations")
        or weights.get("strategy") not in ("group", "channel")
        or weights.get("dynamic")
    ):
        raise QuantizationError(
            f"compressed-tensors scheme (format {fmt}, {weights.get('num_bits')}-bit "
            f"{weights.get('type')} weights, strategy {weights.get('strategy')}, activations "
            f"{'quantized' if group.get('input_activations') else 'not quantized'}) is not "
            f"supported; supported: {SUPPORTED}"
        )
    if weights.get("strategy") == "group" and weights.get("group_size") not in (32, 64, 128):
        raise QuantizationError(
            f"compressed-tensors group_size {weights.get('group_size')} is not supported "
            "(32, 64 or 128)"
        )
    return weights


def _normalized(weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` as compressed-tensors reads them: strategy and act-order names in any
    case, and the older boolean ``actorder`` (true: ``group``, false: none)."""
    out = dict(weights)
    if isinstance(out.get("strategy"), str):
        out["strategy"] = out["strategy"].lower()
    actorder = out.get("actorder")
    if isinstance(actorder, bool):
        out["actorder"] = "group" if actorder else None
    elif isinstance(actorder, str):
        out["actorder"] = actorder.lower()
    return out


FP8_SUPPORTED = (
    "compressed-tensors FP8: format float-quantized, 8-bit float weights per tensor, channel "
    "or block, activations dynamic per token or tensor, static per tensor, dynamic per group "
    "(with block weights) or not quantized"
)


def group_targets(qc: dict[str, Any]) -> list[str]:
    """The layers the (one) config group quantizes: its ``targets`` (``Linear`` when the
    group names none).

    Raises:
        QuantizationError: targets that are not a list of names.
    """
    group = next(iter((qc.get("config_groups") or {}).values()), None) or {}
    if "targets" not in group:
        return ["Linear"]
    return layer_names(group, "targets")


def is_fp8(qc: dict[str, Any]) -> bool:
    """Whether a compressed-tensors ``quantization_config`` holds FP8 weights."""
    for group in (qc.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("type") == "float" or "float" in str(group.get("format") or ""):
            return True
    return "float" in str(qc.get("format") or "")


def parse_fp8(qc: dict[str, Any]):
    """The ``Fp8Scheme`` of a compressed-tensors FP8 ``quantization_config`` (one group).

    Raises:
        QuantizationError: any other FP8 layout (one line naming it and what is supported).
    """
    from tokenmill.model.layers.quantization.fp8 import Fp8Scheme

    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizationError(
            f"compressed-tensors with {len(groups)} config groups is not supported "
            f"({FP8_SUPPORTED})"
        )
    group = next(iter(groups.values()))
    w = _normalized(group.get("weights") or {})
    a = _normalized(group["input_activations"]) if group.get("input_activations") else None
    fmt = group.get("format") or qc.get("format")
    strategy = w.get("strategy")
    block = w.get("block_structure")
    ok = (fmt == "float-quantized" and w.get("num_bits") == 8 and w.get("type") == "float"
          and w.get("symmetric", True) and not w.get("dynamic")
          and strategy in ("tensor", "channel", "block"))
    if strategy == "block":
        ok = ok and isinstance(block, (list, tuple)) and len(block) == 2
    activations = "none"
    if a is not None:
        a_strategy = a.get("strategy")
        dynamic = bool(a.get("dynamic"))
        activations = {(True, "token"): "token", (True, "tensor"): "tensor",
                       (False, "tensor"): "static", (True, "group"): "group"}.get(
            (dynamic, a_strategy), "")
        ok = ok and a.get("num_bits") == 8 and a.get("type") == "float" and bool(activations)
        if activations == "group":
            ok = ok and strategy == "block" and a.get("group_size") == block[1]
    if not ok:
        raise QuantizationError(
            f"compressed-tensors scheme (format {fmt}, {w.get('num_bits')}-bit {w.get('type')} "
            f"weights per {strategy}, activations {_describe_activations(a)}) is not "
            f"supported; supported: {FP8_SUPPORTED}"
        )
    kind = {"tensor": "tensor", "channel": "channel", "block": "block"}[strategy]
    return Fp8Scheme(kind, activations, tuple(block) if strategy == "block" else None)


def _describe_activations(a: dict[str, Any] | None) -> str:
    if not a:
        return "not quantized"
    return (f"{a.get('num_bits')}-bit {a.get('type')} {'dynamic' if a.get('dynamic') else 'static'}"
            f" per {a.get('strategy')}")


class CompressedTensorsW4A16Method(Int4LinearMethod):
    """``weight_packed``, ``weight_scale``, ``weight_shape`` (+ zero points, + g_idx)."""

    def __init__(self, group_size: int, symmetric: bool, act_order: bool) -> None:
        super().__init__(group_size)
        self.symmetric = symmetric
        self.act_order = act_order
        names = ["weight_packed", "weight_scale", "weight_shape"]
        names += [] if symmetric else ["weight_zero_point"]
        names += ["weight_g_idx"] if act_order else []
        self.checkpoint_params = tuple(names)

    def create_weights(self, layer, input_size, output_sizes, dtype) -> None:
        self.check_group(layer, input_size)
        n, k, g = sum(output_sizes), input_size, self.group(input_size)
        layer.weight_packed = _param((n, k // 8), torch.int32, output_dim=0, input_dim=1,
                                     input_div=8)
        layer.weight_scale = _param((n, k // g), dtype, output_dim=0, input_dim=1, input_div=g)
        layer.weight_shape = _param((2,), torch.int64, output_dim=None, input_dim=None)
        if not self.symmetric:
            for size in output_sizes:
                if size % 8:
                    raise QuantizationError(
                        f"asymmetric compressed-tensors parts must be multiples of 8, got {size}"
                    )
            layer.weight_zero_point = _param((n // 8, k // g), torch.int32, output_dim=0,
                                             input_dim=1, output_div=8, input_div=g)
        if self.act_order:
            layer.weight_g_idx = in_order_g_idx(k, g)
        layer.int4_dtype = dtype

    def load_weight(self, layer, param, loaded, s: ShardSlice) -> None:
        if param is layer.weight_shape:
            # [output, input] of the unsharded checkpoint part; a shape that disagrees
            # with the layer means the checkpoint was written for another model.
            # WeightShapeError: the loader names the checkpoint tensor.
            if loaded.numel() != 2:
                raise WeightShapeError(f"has {loaded.numel()} values, not [output features, "
                                       "input features]")
            # src_size: the part's rows, or the fused parts' where one tensor holds them all
            expected = layer.checkpoint_shape(s.shard_id)
            if s.src_size is not None:
                expected = (s.src_size, expected[1])
            for dim, what in ((1, "input"), (0, "output")):
                if int(loaded[dim]) != expected[dim]:
                    raise WeightShapeError(f"says {int(loaded[dim])} {what} features, the "
                                           f"layer's part has {expected[dim]}")
            return
        super().load_weight(layer, param, loaded, s)

    def to_int4(self, layer: nn.Module) -> Int4Weights:
        g = self.group(layer.input_size)
        q = unpack_cols(layer.weight_packed.data)  # [N, K], signed value + 8
        if self.symmetric:
            zeros = torch.full_like(layer.weight_scale.data, 8, dtype=torch.float32)
        else:
            zeros = unpack_rows(layer.weight_zero_point.data).float()  # zero + 8
        perm = None
        if self.act_order:
            q, perm = sort_by_group(q, layer.weight_g_idx.data, g)
        return Int4Weights(q.contiguous(), zeros.contiguous(),
                           layer.weight_scale.data.float().contiguous(), g, perm)


class CompressedTensorsConfig(QuantizationConfig):
    """Every linear layer W4A16 but those ``ignore`` names (names or ``re:`` patterns)."""

    name = "compressed-tensors"

    def __init__(self, weights: dict[str, Any], ignore: list[str], targets: list[str]) -> None:
        self.weights = weights
        self.ignore = ignore
        self.targets = targets

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> QuantizationConfig:
        """The config of a W4A16 or FP8 (``Fp8Config``) ``quantization_config``.

        Raises:
            QuantizationError: an unsupported scheme.
        """
        ignore = layer_names(qc, "ignore")
        if is_fp8(qc):
            from tokenmill.model.layers.quantization.fp8 import Fp8Config

            return Fp8Config(parse_fp8(qc), ignore, cls.name, group_targets(qc))
        return cls(parse_w4a16(qc), ignore, group_targets(qc))

    def _ignored(self, prefix: str) -> bool:
        return left_unquantized(prefix, self.ignore, self.targets)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        from tokenmill.model.layers.quantization.unquantized import UnquantizedLinearMethod

        # MoE routers (the only replicated linear layers) stay unquantized, as in vLLM.
        if getattr(layer, "replicated", False):
            return UnquantizedLinearMethod()
        if self._ignored(prefix):
            return UnquantizedLinearMethod()
        w = self.weights
        group = -1 if w.get("strategy") == "channel" else int(w["group_size"])
        act_order = w.get("actorder") == "group"
        return CompressedTensorsW4A16Method(group, bool(w.get("symmetric", True)), act_order)

    def get_moe_method(self, layer: nn.Module, prefix: str):
        from tokenmill.model.layers.quantization.moe import Int4MoEMethod

        return Int4MoEMethod(self, prefix)

    def describe(self) -> str:
        w = self.weights
        group = "per-channel" if w.get("strategy") == "channel" else f"group {w['group_size']}"
        sym = "symmetric" if w.get("symmetric", True) else "asymmetric"
        return f"compressed-tensors W4A16, {group}, {sym}"

"""Group-quantized int4 weights: AWQ and GPTQ checkpoints (``--quantization awq|gptq``, and
their ``_marlin`` spellings, which load the same checkpoints).

Both dequantize as ``W[n, k] = (q[n, k] - z[g, n]) * s[g, n]`` with ``g`` the group of input
channel ``k`` (``k // group_size``, or GPTQ's ``g_idx[k]`` with act-order). After loading,
every format becomes one ``Int4Weights`` (values unpacked, input channels sorted by group
so that groups are contiguous, the sort kept as a permutation applied to ``x``), and then
the device's form:

- CPU: the native block product, or torch's int4 kernel (``tokenmill.kernels.quant.int4_cpu``).
- CUDA: the Triton dequantize-in-GEMM kernels of ``tokenmill.kernels.gemm.int4``.

Layouts: AutoAWQ's GEMM packing (``awq/utils/packing_utils.py``) and AutoGPTQ's
``QuantLinear.pack`` (``qweight`` packed along K, ``qzeros`` along N, ``zero - 1`` stored in
the original format); see ``tokenmill.kernels.quant.int4_pack``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.kernels.quant import int4_cpu
from tokenmill.kernels.quant.int4_pack import AWQ_ORDER, pack_k, unpack_cols, unpack_rows
from tokenmill.model.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    ShardSlice,
    copy_shard,
    keeps_cpu_bf16_copy,
    layer_ignored,
    layer_names,
    set_layout,
)
from tokenmill.model.layers.weight_shape import WeightShapeError


@dataclass
class Int4Weights:
    """A layer's int4 weight in one canonical form.

    Attributes:
        q: ``[N, K]`` uint8 values 0..15, input channels in group order.
        zeros: ``[N, K / group]`` float32 zero points (integers).
        scales: ``[N, K / group]`` float32.
        group: input channels per group.
        perm: ``[K]`` int64: input channel ``perm[j]`` is column ``j`` of ``q``; None when
            the checkpoint's order is kept.
    """

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group: int
    perm: torch.Tensor | None = None

    def dequantize(self, kernel_order: bool = False) -> torch.Tensor:
        """``[N, K]`` float32 in the checkpoint's input order, or with ``kernel_order`` in
        ``q``'s (group) order."""
        n, k = self.q.shape
        g = self.group
        q = self.q.float().view(n, k // g, g)
        w = (q - self.zeros.unsqueeze(-1)) * self.scales.unsqueeze(-1)
        w = w.view(n, k)
        if self.perm is None or kernel_order:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def sort_by_group(q: torch.Tensor, g_idx: torch.Tensor, group: int
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reorder input channels so each group's channels are contiguous (GPTQ act-order).

    Args:
        q: ``[N, K]`` values in the checkpoint's input order.
        g_idx: ``[K]`` group of each input channel.

    Returns:
        ``(q sorted, perm)``; perm is None when ``g_idx`` is already ``k // group``.

    Raises:
        QuantizationError: a group index outside ``[0, K/group)``, or a group that does not
            hold exactly ``group`` channels.
    """
    k = q.shape[1]
    g_idx = g_idx.to(torch.int64)
    if torch.equal(g_idx, torch.arange(k, device=g_idx.device) // group):
        return q, None
    if bool(((g_idx < 0) | (g_idx >= k // group)).any()):
        raise QuantizationError(
            f"g_idx holds groups outside 0..{k // group - 1} (input channels {k}, group size "
            f"{group})"
        )
    counts = torch.bincount(g_idx, minlength=k // group)
    if counts.numel() != k // group or bool((counts != group).any()):
        raise QuantizationError(
            f"g_idx does not give every group {group} input channels; this layout is not "
            "supported"
        )
    perm = torch.argsort(g_idx, stable=True)
    return q[:, perm], perm


class Int4LinearMethod(LinearMethod):
    """Shared by the int4 formats: ``to_int4`` turns the loaded checkpoint tensors into
    ``Int4Weights``; the device form and the product are common."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.bf16_copy = keeps_cpu_bf16_copy()

    def group(self, input_size: int) -> int:
        return input_size if self.group_size == -1 else self.group_size

    def check_group(self, layer: nn.Module, input_size: int) -> None:
        """Refuse a layer whose (this rank's) input features do not split into whole groups
        and whole int32 words of 8 int4 values.

        Raises:
            QuantizationError: naming the layer (its ``prefix``: its module name in the
                model) and the sizes.
        """
        if input_size % self.group(input_size) == 0 and input_size % 8 == 0:
            return
        name = getattr(layer, "prefix", "") or type(layer).__name__
        whole = layer.checkpoint_shape()[1]
        split = f" (this rank's share of {whole})" if whole != input_size else ""
        raise QuantizationError(
            f"layer {name} has {input_size} input features{split}, not a multiple of the "
            f"group size {self.group(input_size)} and of 8"
        )

    def to_int4(self, layer: nn.Module) -> Int4Weights:  # pragma: no cover - abstract
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = self.to_int4(layer)
        for name in self.checkpoint_params:
            delattr(layer, name)
        set_device_form(layer, w, self.bf16_copy)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        y = int4_product(layer, x)
        return y if bias is None else y + bias

    checkpoint_params: tuple[str, ...] = ()


def set_device_form(layer: nn.Module, w: Int4Weights, bf16_copy: bool = False) -> None:
    """Keep ``w`` on ``layer`` in the form its device's kernel reads (buffers, so the model's
    weight bytes count them); on the CPU with ``bf16_copy``, also the weights in bfloat16 in
    the kernel's input-channel order, for prompt tokens' products (``int4_cpu.planes_mm``)."""
    n, k = w.q.shape
    device = w.q.device
    layer.int4_perm = w.perm
    if w.perm is not None:
        layer.register_buffer("int4_perm_buf", w.perm, persistent=False)
    if device.type == "cpu":
        group = w.group
        scales, zeros = w.scales, w.zeros
        while group > 256 or group not in int4_cpu.KERNEL_GROUPS:  # per-channel: repeat
            sub = next(g for g in (256, 128, 64, 32) if group % g == 0)
            scales = scales.repeat_interleave(group // sub, dim=1)
            zeros = zeros.repeat_interleave(group // sub, dim=1)
            group = sub
        # W = (q - zeros) * scales
        layer.int4_planes = int4_cpu.make_planes(w.q, scales, -zeros * scales, group)
        for i, t in enumerate(t for p in layer.int4_planes for t in p.tensors()):
            layer.register_buffer(f"int4_plane_{i}", t, persistent=False)
        layer.int4_bf16 = None
        if bf16_copy:
            layer.int4_bf16 = w.dequantize(kernel_order=True).to(torch.bfloat16)
            layer.register_buffer("int4_bf16_buf", layer.int4_bf16, persistent=False)
        return
    dtype = layer.int4_dtype
    layer.register_buffer("int4_qweight", pack_k(w.q), persistent=False)
    layer.register_buffer("int4_scales", w.scales.t().contiguous().to(dtype), persistent=False)
    layer.register_buffer("int4_zeros", w.zeros.t().contiguous().to(torch.uint8),
                          persistent=False)
    layer.int4_group = w.group


def int4_product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` through the layer's device form."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if layer.int4_perm is not None:
        x2 = x2.index_select(1, layer.int4_perm)
    if x2.is_cuda:
        from tokenmill.kernels.gemm.int4 import int4_linear

        y = int4_linear(x2, layer.int4_qweight, layer.int4_scales, layer.int4_zeros,
                        layer.int4_group)
    else:
        y = int4_cpu.planes_mm(x2, layer.int4_planes, layer.int4_bf16)
    return y.reshape(*shape[:-1], y.shape[-1])


def _param(shape: tuple[int, ...], dtype: torch.dtype, **layout: Any) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    return set_layout(p, **layout)


def in_order_g_idx(input_size: int, group: int) -> nn.Parameter:
    """An act-order group index ``[K]`` int32 holding ``k // group`` (the groups in order)
    until a checkpoint says otherwise; ``--load-format dummy`` leaves it so."""
    p = _param((input_size,), torch.int32, output_dim=None, input_dim=0)
    p.data.copy_(torch.arange(input_size) // group)
    return p


class GPTQLinearMethod(Int4LinearMethod):
    """GPTQ: ``qweight [K/8, N]``, ``qzeros [K/G, N/8]``, ``scales [K/G, N]``, ``g_idx [K]``."""

    checkpoint_params = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, group_size: int, zeros_minus_one: bool) -> None:
        super().__init__(group_size)
        self.zeros_minus_one = zeros_minus_one

    def create_weights(self, layer, input_size, output_sizes, dtype) -> None:
        self.check_group(layer, input_size)
        n, k, g = sum(output_sizes), input_size, self.group(input_size)
        layer.qweight = _param((k // 8, n), torch.int32, output_dim=1, input_dim=0, input_div=8)
        layer.qzeros = _param((k // g, n // 8), torch.int32, output_dim=1, input_dim=0,
                              output_div=8, input_div=g)
        layer.scales = _param((k // g, n), dtype, output_dim=1, input_dim=0, input_div=g)
        layer.g_idx = in_order_g_idx(k, g)
        layer.int4_dtype = dtype

    def load_weight(self, layer, param, loaded, s: ShardSlice) -> None:
        expected = (layer.checkpoint_shape(s.shard_id)[1],)
        if param is layer.g_idx and loaded.shape != expected:
            # WeightShapeError: the loader names the checkpoint tensor.
            raise WeightShapeError(f"has shape {tuple(loaded.shape)}, expected {expected} "
                                   "(one group index per input feature)")
        if param is layer.g_idx and getattr(layer, "g_idx_loaded", False):
            # Merged parts share their input, so their g_idx must agree.
            if not torch.equal(layer.g_idx.data,
                               loaded.to(layer.g_idx.device, layer.g_idx.dtype)):
                raise QuantizationError(
                    f"tensor {getattr(param, '_tm_name', '?')}[{s.shard_id}]: merged parts "
                    "have different g_idx"
                )
            return
        copy_shard(param, loaded, s, getattr(param, "_tm_name", "?"))
        if param is layer.g_idx:
            layer.g_idx_loaded = True

    def to_int4(self, layer: nn.Module) -> Int4Weights:
        k = layer.input_size
        g = self.group(k)
        q = unpack_rows(layer.qweight.data).t()  # [N, K]
        zeros = unpack_cols(layer.qzeros.data).float()  # [K/G, N]
        if self.zeros_minus_one:
            zeros = zeros + 1
        g_idx = layer.g_idx.data
        # A row-parallel rank's slice starts at a later group: number its groups from 0.
        q, perm = sort_by_group(q, g_idx - g_idx.min(), g)
        return Int4Weights(q.contiguous(), zeros.t().contiguous(),
                           layer.scales.data.float().t().contiguous(), g, perm)


class AWQLinearMethod(Int4LinearMethod):
    """AWQ (GEMM): ``qweight [K, N/8]``, ``qzeros [K/G, N/8]``, ``scales [K/G, N]``."""

    checkpoint_params = ("qweight", "qzeros", "scales")

    def create_weights(self, layer, input_size, output_sizes, dtype) -> None:
        self.check_group(layer, input_size)
        n, k, g = sum(output_sizes), input_size, self.group(input_size)
        for size in output_sizes:
            if size % 8:
                raise QuantizationError(f"AWQ output parts must be multiples of 8, got {size}")
        layer.qweight = _param((k, n // 8), torch.int32, output_dim=1, input_dim=0, output_div=8)
        layer.qzeros = _param((k // g, n // 8), torch.int32, output_dim=1, input_dim=0,
                              output_div=8, input_div=g)
        layer.scales = _param((k // g, n), dtype, output_dim=1, input_dim=0, input_div=g)
        layer.int4_dtype = dtype

    def to_int4(self, layer: nn.Module) -> Int4Weights:
        g = self.group(layer.input_size)
        q = unpack_cols(layer.qweight.data, AWQ_ORDER).t().contiguous()  # [N, K]
        zeros = unpack_cols(layer.qzeros.data, AWQ_ORDER).float().t().contiguous()
        return Int4Weights(q, zeros, layer.scales.data.float().t().contiguous(), g)


class Int4Config(QuantizationConfig):
    """AWQ or GPTQ: every linear layer but those the checkpoint names unquantized."""

    def __init__(self, name: str, group_size: int, skip: list[str],
                 zeros_minus_one: bool = True) -> None:
        self.name = name
        self.group_size = group_size
        self.skip = skip
        self.zeros_minus_one = zeros_minus_one

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        from tokenmill.model.layers.quantization.unquantized import UnquantizedLinearMethod

        # MoE routers (the only replicated linear layers) stay unquantized, as in vLLM.
        if getattr(layer, "replicated", False):
            return UnquantizedLinearMethod()
        # A substring of the layer's name, as vLLM matches modules_to_not_convert
        # ("model.layers.1." skips that layer's projections).
        if layer_ignored(prefix, lambda name: any(s and s in name for s in self.skip)):
            return UnquantizedLinearMethod()
        if self.name == "awq":
            return AWQLinearMethod(self.group_size)
        return GPTQLinearMethod(self.group_size, self.zeros_minus_one)

    def get_moe_method(self, layer: nn.Module, prefix: str):
        from tokenmill.model.layers.quantization.moe import Int4MoEMethod

        return Int4MoEMethod(self, prefix)

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group size {self.group_size}"
        return f"{self.name} int4, {group}"


def awq_config(qc: dict[str, Any]) -> Int4Config:
    if not qc.get("zero_point", True):
        raise QuantizationError("awq without zero points (zero_point: false) is not supported")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    return Int4Config("awq", group, layer_names(qc, "modules_to_not_convert"))


def gptq_config(qc: dict[str, Any]) -> Int4Config:
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    skip = layer_names(qc, "modules_to_not_convert")
    return Int4Config("gptq", int(qc.get("group_size", 128)), skip,
                      zeros_minus_one=fmt == "gptq")

"""FP8 weights (float8_e4m3fn) and activations: ``--quantization fp8`` on a 16-bit checkpoint
(quantized while loading), vLLM's ``fp8`` checkpoints (``quant_method: fp8``: per-tensor
``weight_scale`` or 128x128 block ``weight_scale_inv``) and compressed-tensors' FP8 schemes
(``float-quantized``; see ``compressed_tensors.parse_fp8``).

Every layout becomes one FP8 weight ``[N, K]`` with either one scale per output channel
(per-tensor scales of merged parts become per-channel, exactly) or one per 128x128 block,
and one activation rule (``Fp8Scheme.activations``). Products:

- CUDA: up to ``skinny.MAX_M`` rows (decode) the skinny GEMM (``kernels.gemm.skinny``)
  streams the FP8 weight with its per-channel scales (W8A16: no activation quantization),
  the gate/up pair's SwiGLU in the same launch; larger batches quantize activations to FP8
  as the scheme says (per token: one Triton launch) and run ``torch._scaled_mm``;
  block-scaled weights, and shapes the skinny GEMM does not take, the W8A16 Triton kernel
  of ``kernels.gemm.fp8``.
- CPU: the scheme emulated in float32: activations quantized and dequantized as the
  scheme says, the FP8 weight dequantized exactly, ``F.linear``.

Online quantization uses per-channel weight scales and dynamic per-token activation
scales (vLLM's online ``fp8`` uses per-tensor ones: per-channel is at least as accurate
and runs as fast on row-wise-scaled FP8 GEMMs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.quant import fp8 as q8
from tokenmill.model.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    ShardSlice,
    copy_shard,
    layer_names,
    left_unquantized,
    set_layout,
)

WeightForm = Literal["online", "tensor", "channel", "block"]
Activations = Literal["token", "tensor", "static", "group", "none"]


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint stores FP8 weights and how activations are quantized.

    Attributes:
        weights: ``online`` (16-bit checkpoint, quantized per channel at load), ``tensor``,
            ``channel`` or ``block`` scales.
        activations: dynamic per ``token``, dynamic per ``tensor``, ``static`` (the
            checkpoint's ``input_scale``), per token and ``group`` of ``block[1]`` inputs, or
            ``none`` (W8A16: activations stay 16-bit).
        block: ``(bn, bk)`` of block scales, else None.
        scale_name: the checkpoint's name of the weight scale (``weight_scale``, or
            ``weight_scale_inv`` in vLLM's block-wise ``fp8`` format).
    """

    weights: WeightForm = "online"
    activations: Activations = "token"
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"

    def describe(self) -> str:
        w = {"online": "per-channel (quantized at load)", "tensor": "per-tensor",
             "channel": "per-channel"}.get(self.weights, f"block {self.block}")
        a = {"token": "dynamic per-token", "tensor": "dynamic per-tensor",
             "static": "static", "group": f"dynamic per-token groups of {self.block}",
             "none": "16-bit"}
        return f"FP8 weights {w}, activations {a[self.activations]}"


def _param(shape: tuple[int, ...], dtype: torch.dtype, **layout: Any) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    return set_layout(p, **layout)


class Fp8LinearMethod(LinearMethod):
    """One linear layer's FP8 weight (see the module docstring)."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer, input_size, output_sizes, dtype) -> None:
        sc = self.scheme
        n, k = sum(output_sizes), input_size
        weight_dtype = dtype if sc.weights == "online" else q8.FP8_DTYPE
        layer.weight = _param((n, k), weight_dtype)
        layer.fp8_dtype = dtype
        parts = len(output_sizes)
        if sc.weights == "tensor":
            setattr(layer, sc.scale_name, _param((parts,), torch.float32, output_dim=None,
                                                 input_dim=None))
        elif sc.weights == "channel":
            setattr(layer, sc.scale_name, _param((n, 1), torch.float32, output_dim=0,
                                                 input_dim=None))
        elif sc.weights == "block":
            bn, bk = sc.block  # type: ignore[misc]
            if parts > 1 and any(size % bn for size in output_sizes):
                raise QuantizationError(
                    f"{type(layer).__name__}: merged parts {output_sizes} are not multiples of "
                    f"the FP8 weight block {bn}"
                )
            setattr(layer, sc.scale_name, _param((-(-n // bn), -(-k // bk)), torch.float32,
                                                 output_div=bn, input_div=bk))
        if sc.activations == "static":
            layer.input_scale = _param((parts,), torch.float32, output_dim=None, input_dim=None)
        for name in ("weight_zero_point", "input_zero_point"):
            # compressed-tensors may store zero points of symmetric FP8 schemes (all 0).
            p = _param((0,), torch.float32, output_dim=None, input_dim=None)
            p.tm_optional = True  # type: ignore[attr-defined]
            setattr(layer, name, p)

    def load_weight(self, layer, param, loaded, s: ShardSlice) -> None:
        name = getattr(param, "_tm_name", "?")
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("zero_point"):
            if loaded.numel() and bool(loaded.float().abs().max() > 0):
                raise QuantizationError(f"tensor {name!r}: asymmetric FP8 is not supported")
            return
        if param.dim() == 1 and param.output_dim is None and leaf != "weight":
            _load_part_scalar(layer, param, loaded, s, name)
            return
        copy_shard(param, loaded, s, name)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        sc = self.scheme
        weight = layer.weight.data
        if sc.weights == "online":
            wq, scale = q8.quantize_per_channel(weight)
        else:
            wq, scale = weight, getattr(layer, sc.scale_name).data.float()
            if sc.weights == "tensor":
                sizes = torch.tensor(layer.output_partition_sizes, device=scale.device)
                scale = scale.repeat_interleave(sizes)
            elif sc.weights == "channel":
                scale = scale.reshape(-1)
        input_scale = layer.input_scale.data.max() if sc.activations == "static" else None
        for name in list(layer._parameters):
            if name != "bias":
                delattr(layer, name)
        layer.register_buffer("fp8_weight", wq.contiguous(), persistent=False)
        layer.register_buffer("fp8_scale", scale.contiguous(), persistent=False)
        if sc.weights != "block":
            layer.register_buffer("fp8_scale_row", scale.view(1, -1), persistent=False)
        layer.register_buffer("fp8_input_scale", input_scale, persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.is_cuda:
            y = self._cuda_product(layer, x2, bias)
        else:
            y = self._emulated_product(layer, x2, bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    def _quantize_input(self, layer: nn.Module, x: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        act = self.scheme.activations
        if x.is_cuda and act in ("token", "static"):
            from tokenmill.kernels.gemm import fp8 as gemm

            return gemm.quantize_rows(x if x.stride(-1) == 1 else x.contiguous(),
                                      layer.fp8_input_scale if act == "static" else None)
        if act == "token":
            return q8.quantize_per_token(x)
        if act == "tensor":
            return q8.quantize_dynamic_tensor(x)
        if act == "static":
            return q8.quantize_static(x, layer.fp8_input_scale)
        return q8.quantize_token_groups(x, self.scheme.block[1])  # type: ignore[index]

    def _emulated_product(self, layer, x, bias) -> torch.Tensor:
        """The scheme in float32 (CPU): what the FP8 kernels compute, up to summation order."""
        if self.scheme.activations == "none":
            xq, xs = x, torch.ones(x.shape[0], 1, device=x.device)
        else:
            xq, xs = self._quantize_input(layer, x)
        if self.scheme.activations == "group":
            bk = self.scheme.block[1]  # type: ignore[index]
            xd = xq.float() * xs.repeat_interleave(bk, 1)[:, : x.shape[1]]
        else:
            xd = xq.float() * xs
        w = q8.dequantize(layer.fp8_weight, layer.fp8_scale, self.scheme.block)
        y = F.linear(xd, w, None if bias is None else bias.float())
        return y.to(x.dtype)

    def apply_gated(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor | None:
        """The gate/up pair's SwiGLU in the skinny GEMM's launch where it runs the product."""
        x2 = x.reshape(-1, x.shape[-1])
        if not self._runs_skinny(layer, x2):
            return None
        from tokenmill.kernels.gemm import skinny

        y = skinny.skinny_linear(x2, layer.fp8_weight, bias, gated=True,
                                 weight_scale=layer.fp8_scale)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _runs_skinny(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Per-channel (or per-tensor) scales, decode-sized ``x [M, K]`` on CUDA, a shape
        the skinny GEMM takes (``KernelConfig.skinny_gemm`` "off" sends every product to
        the other kernels)."""
        from tokenmill.kernels.gemm import skinny

        return (
            x.is_cuda
            and self.scheme.weights != "block"
            and getattr(layer, "skinny_gemm", "auto") != "off"
            and x.shape[0] <= skinny.MAX_M
            and skinny.use_skinny_gemm(x, layer.fp8_weight)
        )

    def _cuda_product(self, layer, x, bias) -> torch.Tensor:
        from tokenmill.kernels.gemm import fp8 as gemm
        from tokenmill.kernels.gemm import skinny

        if self._runs_skinny(layer, x):
            return skinny.skinny_linear(x, layer.fp8_weight, bias, weight_scale=layer.fp8_scale)
        if (self.scheme.weights == "block" or self.scheme.activations == "none"
                or x.shape[0] <= skinny.MAX_M or not _scaled_mm_shapes(layer.fp8_weight)):
            return gemm.fp8_weight_gemm(x, layer.fp8_weight, layer.fp8_scale, bias,
                                        self.scheme.block)
        xq, xs = self._quantize_input(layer, x)
        y = gemm.scaled_mm_rowwise(xq, xs, layer.fp8_weight, layer.fp8_scale_row, x.dtype)
        return y if bias is None else y + bias


def _scaled_mm_shapes(wq: torch.Tensor) -> bool:
    """cuBLASLt FP8 GEMMs need N and K multiples of 16."""
    return wq.shape[0] % 16 == 0 and wq.shape[1] % 16 == 0


def _load_part_scalar(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
                      s: ShardSlice, name: str) -> None:
    """A per-tensor scale (``[]`` or ``[1]``) into the slot of its merged part (every slot
    for a checkpoint tensor that holds all parts)."""
    if loaded.numel() != 1:
        raise QuantizationError(
            f"tensor {name!r} has shape {tuple(loaded.shape)}; a per-tensor scale has one value"
        )
    value = loaded.reshape(()).float()
    if s.dst_start is None:
        param.data.fill_(value.item())
        return
    offsets = [0]
    for size in layer.output_partition_sizes:
        offsets.append(offsets[-1] + size)
    if s.dst_start not in offsets[:-1]:
        raise QuantizationError(f"tensor {name!r}[{s.shard_id}]: no merged part starts at "
                                f"output {s.dst_start}")
    param.data[offsets.index(s.dst_start)] = value


class Fp8Config(QuantizationConfig):
    """Every linear layer FP8 but MoE routers and the layers the checkpoint leaves
    unquantized (``ignore`` names or ``re:`` patterns; vLLM's ``ignored_layers`` /
    ``modules_to_not_convert``). Token embeddings and the LM head stay 16-bit."""

    def __init__(self, scheme: Fp8Scheme, ignore: list[str], name: str = "fp8",
                 targets: list[str] | None = None) -> None:
        self.scheme = scheme
        self.ignore = ignore
        self.name = name
        # compressed-tensors' config group targets; every linear layer otherwise
        self.targets = ["Linear"] if targets is None else targets

    @classmethod
    def from_config(cls, qc: dict[str, Any] | None) -> Fp8Config:
        """``--quantization fp8`` (``qc`` None: online) or a ``quant_method: fp8``
        ``quantization_config``.

        Raises:
            QuantizationError: a layout that is not implemented.
        """
        if not qc:
            return cls(Fp8Scheme(), [])
        act = str(qc.get("activation_scheme", "dynamic"))
        if act not in ("dynamic", "static"):
            raise QuantizationError(f"fp8 activation_scheme {act!r} (dynamic or static)")
        block = qc.get("weight_block_size")
        ignore = layer_names(qc, "ignored_layers") or layer_names(qc, "modules_to_not_convert")
        if block is not None:
            if act != "dynamic" or len(block) != 2:
                raise QuantizationError("fp8 block-wise weights need activation_scheme "
                                        f"dynamic and a [n, k] weight_block_size, got {block}")
            scheme = Fp8Scheme("block", "group", (int(block[0]), int(block[1])),
                               "weight_scale_inv")
            return cls(scheme, ignore)
        activations = "static" if act == "static" else "tensor"
        return cls(Fp8Scheme("tensor", activations), ignore)

    def _ignored(self, prefix: str) -> bool:
        return left_unquantized(prefix, self.ignore, self.targets)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        from tokenmill.model.layers.quantization.unquantized import UnquantizedLinearMethod

        if getattr(layer, "replicated", False) or self._ignored(prefix):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(self.scheme)

    def get_moe_method(self, layer: nn.Module, prefix: str):
        """Each expert's gate/up and down products as FP8 linear layers, in the routed loop
        over the experts that received tokens (``quantization.moe``)."""
        from tokenmill.model.layers.quantization.moe import Int4MoEMethod

        return Int4MoEMethod(self, prefix)

    def check_dtype(self, dtype: str, device: str) -> None:
        if device == "cuda":
            import torch as _torch

            if _torch.cuda.get_device_capability() < (8, 9):
                raise QuantizationError(
                    "FP8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper)"
                )
            if dtype == "float32":
                raise QuantizationError("FP8 on CUDA runs with --dtype bfloat16 or float16")

    def describe(self) -> str:
        return f"{self.name}: {self.scheme.describe()}"

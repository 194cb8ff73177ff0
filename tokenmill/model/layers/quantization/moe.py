"""Quantized MoE experts: each expert's gate/up and down products through a linear method's
quantized form, in a loop over the experts that received tokens (the same routing as
``tokenmill.kernels.moe.fused_moe.fused_experts_torch``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import current_kernel_config
from tokenmill.model.layers.quantization.base import QuantizationError, ShardSlice
from tokenmill.model.layers.quantization.gguf_segments import build_segments, segments_mm


def routed_loop(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert_mlp: Any,
) -> torch.Tensor:
    """``sum_j w[t, j] * expert_{ids[t, j]}(hidden[t])`` with ``expert_mlp(e, x) -> y``.

    Shapes: ``hidden [T, H]``, ``topk_* [T, k]`` -> ``[T, H]`` in ``hidden``'s dtype.
    """
    top_k = topk_ids.shape[1]
    out = torch.zeros_like(hidden)
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        # A graph cannot wait for the host to count each expert's tokens: every expert runs
        # on every token, weighted by its routing weight (0 where not chosen).
        weights = torch.zeros(hidden.shape[0], num_experts, device=hidden.device)
        weights.scatter_(1, topk_ids, topk_weights.float())
        for expert in range(num_experts):
            y = expert_mlp(expert, hidden) * weights[:, expert : expert + 1]
            out += y.to(out.dtype)
        return out
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    flat_weights = topk_weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start : start + count]
        start += count
        tokens = slots // top_k
        y = expert_mlp(expert, hidden[tokens]) * flat_weights[slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


class _Placeholder(nn.Module):
    """Receives per-expert checkpoint tensors under ``experts.w13`` / ``experts.w2``."""

    def __init__(self, loader: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        self.weight.weight_loader = loader


class GGUFMoEMethod:
    """Experts over GGUF blocks: stacked ``ffn_*_exps`` tensors arrive one expert at a time
    (``(expert, "gate"|"up"|"down")`` shard ids) and keep their blocks."""

    def create_weights(self, layer: nn.Module) -> None:
        self.parts: dict[tuple[int, str], Any] = {}
        # Called inside the model's device and default-dtype context.
        self.dtype = torch.get_default_dtype()
        self.device = torch.empty(0).device
        layer.w13 = _Placeholder(self._loader(layer))
        layer.w2 = _Placeholder(self._loader(layer))

    def _loader(self, layer: nn.Module) -> Any:
        def load(param: nn.Parameter, loaded: Any, shard_id: Any) -> None:
            if layer.tp_size > 1:
                raise QuantizationError("GGUF experts with tensor parallelism are not supported")
            expert, part = layer._parse_shard(shard_id, ("gate", "up", "down"))
            i, h = layer.intermediate_per_rank, layer.hidden_size
            expected = (h, i) if part == "down" else (i, h)
            if tuple(loaded.shape) != expected:
                raise QuantizationError(
                    f"tensor {getattr(param, '_tm_name', '?')}[{expert}, {part}] has shape "
                    f"{tuple(loaded.shape)}, expected {expected}"
                )
            self.parts[(expert, part)] = loaded

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dtype, device = self.dtype, self.device
        self.w13: list = []
        self.w2: list = []
        i = layer.intermediate_per_rank
        for e in range(layer.num_experts):
            gate, up, down = (self.parts.pop((e, p), None) for p in ("gate", "up", "down"))
            if gate is None or up is None or down is None:
                raise QuantizationError(f"expert {e} of an MoE layer is missing weights")
            self.w13.append(build_segments([(0, gate), (i, up)], dtype, device))
            self.w2.append(build_segments([(0, down)], dtype, device))
            for j, t in enumerate(s for segs in (self.w13[-1], self.w2[-1])
                                  for seg in segs for s in seg.tensors()):
                layer.register_buffer(f"gguf_expert_{e}_{j}", t, persistent=False)

    def apply(self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        def mlp(e: int, x: torch.Tensor) -> torch.Tensor:
            gate, up = segments_mm(self.w13[e], x).chunk(2, dim=-1)
            return segments_mm(self.w2[e], F.silu(gate) * up)

        return routed_loop(hidden, topk_weights, topk_ids, layer.num_experts, mlp)


class _ExpertLinear(nn.Module):
    """One expert's product held by a linear method (not registered on the model: its
    checkpoint tensors arrive through the MoE layer's stacked names)."""

    def __init__(self, input_size: int, output_sizes: list[int], method: Any, prefix: str
                 ) -> None:
        super().__init__()
        self.prefix = prefix  # named in error messages, as ``LinearBase.prefix``
        self.input_size = input_size
        self.output_partition_sizes = output_sizes
        self.tp_size, self.tp_rank = 1, 0
        self.skinny_gemm = current_kernel_config().skinny_gemm  # read by unquantized methods
        self.quant_method = method
        self.bias = None
        method.create_weights(self, input_size, output_sizes, torch.get_default_dtype())

    def checkpoint_shape(self, shard_id: Any = None) -> tuple[int, int]:  # noqa: ARG002
        """``(output, input)`` features of the expert's whole product (its gate and up
        tensors' own rows are each ``ShardSlice.src_size``); ``shard_id`` is the MoE
        layer's and does not index the parts."""
        return sum(self.output_partition_sizes), self.input_size


class Int4MoEMethod:
    """Experts of an AWQ/GPTQ/compressed-tensors checkpoint, or quantized to FP8 while
    loading: one linear of the config's method (int4 or FP8) per expert's gate/up (merged)
    and down projection, computed in the routed loop."""

    def __init__(self, config: Any, prefix: str) -> None:
        self.config = config
        self.prefix = prefix

    def create_weights(self, layer: nn.Module) -> None:
        if layer.tp_size > 1:
            raise QuantizationError("quantized experts with tensor parallelism are not supported")
        i, h = layer.intermediate_per_rank, layer.hidden_size
        method = self.config.get_linear_method

        def expert(size: int, sizes: list[int], name: str) -> _ExpertLinear:
            return _ExpertLinear(size, sizes, method(layer, name), name)

        self.w13 = [expert(h, [i, i], f"{self.prefix}.{e}.w13") for e in range(layer.num_experts)]
        self.w2 = [expert(i, [h], f"{self.prefix}.{e}.w2") for e in range(layer.num_experts)]
        layer.w13 = self._sink(self.w13, layer, ("gate", "up"))
        layer.w2 = self._sink(self.w2, layer, ("down",))

    def _sink(self, experts: list[_ExpertLinear], layer: nn.Module, parts: tuple[str, ...]
              ) -> nn.Module:
        """A module whose parameters carry the checkpoint names and route each expert's
        tensor to that expert's layer."""
        sink = nn.Module()
        i = layer.intermediate_per_rank
        for name, template in experts[0].named_parameters(recurse=False):
            def load(param, loaded, shard_id, name=name):
                e, part = layer._parse_shard(shard_id, parts)
                target = experts[e]
                if part == "down":
                    s = ShardSlice(shard_id)
                else:
                    s = ShardSlice(shard_id, 0 if part == "gate" else i, i, 0, src_size=i)
                target_param = getattr(target, name)
                target_param._tm_name = getattr(param, "_tm_name", name)
                target.quant_method.load_weight(target, target_param, loaded, s)

            placeholder = nn.Parameter(torch.empty(0, dtype=template.dtype), requires_grad=False)
            placeholder.weight_loader = load
            if getattr(template, "tm_optional", False):  # e.g. FP8 zero points
                placeholder.tm_optional = True  # type: ignore[attr-defined]
            sink.register_parameter(name, placeholder)
        return sink

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for kind, experts in (("w13", self.w13), ("w2", self.w2)):
            for e, expert in enumerate(experts):
                expert.quant_method.process_weights_after_loading(expert)
                for name, t in expert.named_buffers(recurse=False):
                    layer.register_buffer(f"{kind}_{e}_{name}", t, persistent=False)
                for name, p in expert.named_parameters(recurse=False):
                    layer.register_buffer(f"{kind}_{e}_{name}", p.data, persistent=False)

    def apply(self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        def mlp(e: int, x: torch.Tensor) -> torch.Tensor:
            w13, w2 = self.w13[e], self.w2[e]
            gate, up = w13.quant_method.apply(w13, x).chunk(2, dim=-1)
            return w2.quant_method.apply(w2, F.silu(gate) * up)

        return routed_loop(hidden, topk_weights, topk_ids, layer.num_experts, mlp)

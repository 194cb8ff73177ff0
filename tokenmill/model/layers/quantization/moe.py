"""Quantized MoE experts: each expert's gate/up and down products through a linear method's
quantized form, in a loop over the experts that received tokens (the same routing as
``fused_experts_torch``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.layers.quantization.base import QuantizationError
from tokenmill.model.layers.quantization.gguf import build_segments, segments_mm
from tokenmill.model.layers.quantization.tensors import GGUFTensor


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


__all__ = ["GGUFMoEMethod", "GGUFTensor", "routed_loop"]

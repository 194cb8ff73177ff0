"""The blocks of the Qwen2.5-VL vision tower: bidirectional attention within each window
(or, in the full-attention blocks, each image) of the packed patches, and the SwiGLU MLP.

On CUDA in half precision all windows of a step's images run as one FlashAttention
variable-length call (``torch.nn.attention.varlen``); elsewhere (and on a torch without
it) one SDPA call per window, as transformers does. On CUDA the block's RMSNorms (the
second one with the residual add), the patches' rotary embedding and the SiLU gate are one
Triton kernel each instead of chains of float32 torch passes, and the MLP's gate and up
projections are one GEMM.

The MLP's intermediate size is padded with zeros to a multiple of 128 (Qwen2.5-VL's 3,420
is not a multiple of 8, so cuBLAS can only pick slow unaligned GEMM kernels for it); a
zero gate and up row gives ``silu(0) * 0 = 0``, and the down projection's zero columns add
nothing, so the outputs are those of the unpadded weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.activation import silu_and_mul
from tokenmill.kernels.device import use_triton
from tokenmill.kernels.norm import rms_norm
from tokenmill.kernels.vision import vision_rotary_inplace, vision_rotary_torch
from tokenmill.math_utils import cdiv
from tokenmill.model.layers.weight_shape import check_shape

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch
    varlen_attn = None


class VisionWindowAttention(nn.Module):
    """``forward(hidden [S, dim], cu_seqlens [W + 1] int32, position_embeddings=(cos, sin)
    [S, head_dim]) -> [S, dim]``; parameter names as the checkpoint's (``qkv``, ``proj``).

    Args:
        dim: hidden size of the tower.
        num_heads: attention heads.
    """

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        max_seqlen: int | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        s = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).view(s, 3, self.num_heads, -1).unbind(1)
        assert position_embeddings is not None
        cos, sin = position_embeddings
        if use_triton(q):
            vision_rotary_inplace(q, k, cos.contiguous(), sin.contiguous())
        else:
            q, k = vision_rotary_torch(q, cos, sin), vision_rotary_torch(k, cos, sin)
        dtype = q.dtype
        scale = self.head_dim**-0.5
        if varlen_attn is not None and q.is_cuda and dtype in (torch.float16, torch.bfloat16):
            cu = cu_seqlens.to(torch.int32)
            longest = int(max_seqlen) if max_seqlen else int((cu[1:] - cu[:-1]).max())
            out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale)
        else:
            out = self._per_window(q, k, v, cu_seqlens, scale)
        return self.proj(out.reshape(s, -1))

    @staticmethod
    def _per_window(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:  # fmt: skip
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        outs = [
            F.scaled_dot_product_attention(
                qw.transpose(0, 1), kw.transpose(0, 1), vw.transpose(0, 1), scale=scale
            ).transpose(0, 1)
            for qw, kw, vw in zip(q.split(lengths), k.split(lengths), v.split(lengths),
                                  strict=True)  # fmt: skip
        ]
        return torch.cat(outs)


# The padded intermediate size is a multiple of this (aligned, whole GEMM tiles).
_MLP_ALIGN = 128


class VisionMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with the gate and up projections merged into
    ``gate_up_proj`` (``[2P, hidden]``, gate rows first) and the intermediate size padded
    to ``P`` (see the module docstring). Checkpoint tensors ``gate_proj``/``up_proj`` load
    into it as shards 0 and 1 (the model's ``stacked_params_mapping``), ``down_proj`` into
    the first ``intermediate_size`` columns.

    Args:
        hidden_size: the tower's width.
        intermediate_size: the checkpoint's MLP width.
        hidden_act: transformers' activation name (``silu`` has the fused kernel).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.intermediate_size = intermediate_size
        self.padded_size = cdiv(intermediate_size, _MLP_ALIGN) * _MLP_ALIGN
        self.hidden_act = hidden_act
        self.act_fn = ACT2FN[hidden_act]
        self.gate_up_proj = nn.Linear(hidden_size, 2 * self.padded_size, bias=True)
        self.down_proj = nn.Linear(self.padded_size, hidden_size, bias=True)
        for param in (self.gate_up_proj.weight, self.gate_up_proj.bias):
            param.weight_loader = self._load_gate_up
            param.dummy_fill = self._dummy_fill
        self.down_proj.weight.weight_loader = self._load_down
        self.down_proj.weight.dummy_fill = self._dummy_fill
        self._zero_padding()

    def _zero_padding(self) -> None:
        i, p = self.intermediate_size, self.padded_size
        with torch.no_grad():
            for param in (self.gate_up_proj.weight, self.gate_up_proj.bias):
                param[i:p].zero_()
                param[p + i :].zero_()
            self.down_proj.weight[:, i:].zero_()

    def _load_gate_up(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None
    ) -> None:
        if shard_id not in (0, 1):
            raise ValueError(f"gate_up_proj takes gate (0) and up (1) shards, got {shard_id}")
        start = shard_id * self.padded_size
        target = param.data[start : start + self.intermediate_size]
        check_shape(getattr(param, "_tm_name", "?"), target.shape, loaded.shape)
        target.copy_(loaded)
        param.data[start + self.intermediate_size : start + self.padded_size].zero_()

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None) -> None:
        target = param.data[:, : self.intermediate_size]
        check_shape(getattr(param, "_tm_name", "?"), target.shape, loaded.shape)
        target.copy_(loaded)
        param.data[:, self.intermediate_size :].zero_()

    def _dummy_fill(self, param: nn.Parameter, generator: torch.Generator) -> None:
        """``--load-format dummy``: the loader's uniform values, the padding kept zero."""
        param.data.uniform_(-1e-3, 1e-3, generator=generator)
        self._zero_padding()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.hidden_act == "silu" and use_triton(gate_up):
            hidden = silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.padded_size, dim=-1)
            hidden = self.act_fn(gate) * up
        return self.down_proj(hidden)


class VisionBlock(nn.Module):
    """``h + mlp(norm2(h'))`` with ``h' = h + attn(norm1(h))``: transformers'
    ``Qwen2_5_VLVisionBlock`` with tokenmill's attention and MLP; on CUDA the norms are the
    fused RMSNorm kernel (the second one adding the attention's residual).

    Args:
        norm1, norm2: the block's RMSNorm modules (their ``weight`` and
            ``variance_epsilon``; the torch path calls them).
        attn: ``VisionWindowAttention``.
        mlp: ``VisionMLP``.
    """

    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        """Shapes: ``hidden_states [S, dim]`` -> ``[S, dim]``; other arguments as
        ``VisionWindowAttention.forward``."""
        kwargs = {k: v for k, v in kwargs.items() if k == "max_seqlen"}
        if not use_triton(hidden_states):
            h = hidden_states + self.attn(
                self.norm1(hidden_states), cu_seqlens, position_embeddings, **kwargs
            )
            return h + self.mlp(self.norm2(h))
        h = hidden_states.contiguous()
        x = rms_norm(h, self.norm1.weight, self.norm1.variance_epsilon)
        a = self.attn(x, cu_seqlens, position_embeddings, **kwargs)
        x, h = rms_norm(a, self.norm2.weight, self.norm2.variance_epsilon, residual=h)
        return h + self.mlp(x)

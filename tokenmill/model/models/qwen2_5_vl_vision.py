"""Attention of the Qwen2.5-VL vision tower: bidirectional attention within each window
(or, in the full-attention blocks, each image) of the packed patches.

On CUDA in half precision all windows of a step's images run as one FlashAttention
variable-length call (``torch.nn.attention.varlen``); elsewhere (and on a torch without
it) one SDPA call per window, as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch
    varlen_attn = None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


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
        cos, sin = (t.unsqueeze(-2).float() for t in position_embeddings)
        dtype = q.dtype
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(dtype)
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

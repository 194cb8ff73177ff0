"""Paged attention on CUDA with Triton kernels: the backend adapter over
``tokenmill.kernels.attention`` (kernel structure and launches in ``kernels/attention/
paged.py``)."""

from __future__ import annotations

import torch

from tokenmill.kernels.attention import paged
from tokenmill.kernels.attention.batch_split import BatchSplit, batch_split
from tokenmill.kernels.attention.cache_write import reshape_and_cache
from tokenmill.kernels.attention.launch import UNIFORM_MAX_PREFILLS
from tokenmill.model.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    DecodeRotary,
)


def step_split(metadata: AttentionMetadata) -> BatchSplit:
    """The step's ``BatchSplit``, worked out by its first layer and kept on ``metadata``
    for the others (with the split workspaces and launches they share)."""
    split = metadata.backend_state.get("triton")
    if split is None:
        split = metadata.backend_state["triton"] = batch_split(metadata)
    return split


class TritonAttentionImpl(AttentionImpl):
    """Paged attention with Triton kernels (``kernels.attention.paged.PagedAttention``).

    Same arguments and semantics as ``AttentionImpl``; ``out`` must be contiguous in its
    last dimension.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kernels = paged.PagedAttention(
            self.num_heads, self.head_dim, self.scale, self.num_kv_heads,
            self.sliding_window, self.logits_soft_cap, self.attention_chunk_size, self.sinks,
        )  # fmt: skip

    def set_key_scale(self, k_scale: float) -> None:
        super().set_key_scale(k_scale)
        self.kernels.set_scale(self.scale)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
    ) -> None:
        reshape_and_cache(key, value, kv_cache, slot_mapping, num_tokens)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.kernels.attend(query, kv_cache, metadata, step_split(metadata), out)

    def attend_decode_rotary(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rotary: DecodeRotary,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.kernels.attend_decode_rotary(
            query, key, value, kv_cache, metadata, step_split(metadata),
            rotary.cos_sin_cache, rotary.rotary_dim, rotary.is_neox_style, out,
        )  # fmt: skip


class TritonAttentionBackend(AttentionBackend):
    """Triton paged-attention kernels for CUDA (also run by the Triton interpreter)."""

    name = "triton"
    supports_cascade = True
    supports_uniform_grids = True
    uniform_max_prefills = UNIFORM_MAX_PREFILLS
    supports_decode_rotary = True

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def decode_warm_up_cases(
        num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, max_decodes: int,
        max_context: int, device: torch.device,
    ) -> list[tuple[int, int]]:  # fmt: skip
        return paged.decode_warm_up_cases(
            num_kv_heads, group, head_dim, dtype, max_decodes, max_context, device
        )

"""Multi-head latent attention on CUDA with Triton kernels: the backend adapter over
``kernels/attention/mla_cache.py`` (rotation and latent write in one launch) and
``kernels/attention/mla_decode.py`` (decode attention over the paged latent cache). Prompt
tokens take the torch path of ``MLAImpl`` (expanded keys and values, torch's SDPA)."""

from __future__ import annotations

import torch

from tokenmill.kernels.attention.mla_cache import mla_rope_and_cache
from tokenmill.kernels.attention.mla_decode import mla_decode
from tokenmill.model.attention.mla import MLAImpl, TorchMLABackend


class TritonMLAImpl(MLAImpl):
    """``MLAImpl`` with the Triton write and decode kernels (CUDA, or Triton's interpreter)."""

    fuses_rope = True

    def rope_and_write(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox_style: bool,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
    ) -> None:
        mla_rope_and_cache(
            positions, query, kv_c, k_pe, cos_sin_cache, is_neox_style, self.dims.num_heads,
            self.dims.qk_nope_head_dim, kv_cache, slot_mapping, num_tokens,
        )  # fmt: skip

    def attend_latent(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> torch.Tensor:
        return mla_decode(q_lat, q_pe, kv_cache, block_table, seq_lens, self.scale, max_seq_len)


class TritonMLABackend(TorchMLABackend):
    """MLA with Triton kernels for CUDA (also run by the Triton interpreter)."""

    name = "triton_mla"

    @staticmethod
    def get_impl_cls() -> type[MLAImpl]:  # type: ignore[override]
        return TritonMLAImpl

"""The multi-head latent attention layer (DeepSeek-V2, arXiv:2405.04434): holds its layer's
latent cache and calls the MLA backend (``model/attention/mla.py``)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata, KVCacheSpec
from tokenmill.model.attention.mla import MLADims, MLAImpl
from tokenmill.model.layers import attention as attention_layer
from tokenmill.model.layers.attention import Attention
from tokenmill.model.layers.rotary import RotaryEmbedding


class MLAAttention(Attention):
    """Multi-head latent attention for one layer over its paged latent cache.

    ``forward(q [T, H * (nope + rope)], kv_c [T, R], k_pe [T, P], metadata, positions)
    -> [T, H * v]``: ``kv_c`` is the normalised latent, the rotary parts of ``q`` and
    ``k_pe`` arrive unrotated. The layer rotates them, writes ``[kv_c | k_pe]`` into its
    cache (``[num_blocks, block_size, R + P]``, bound by ``bind_kv_caches``; one entry per
    token for all heads, where ``Attention`` keeps K and V heads) and attends. Like
    ``Attention`` it is split into ``store_kv`` and ``attend`` (the piecewise CUDA graphs
    call them apart) and routed through ``attention_hook``.

    Args:
        dims: the layer's sizes (heads on this rank).
        scale: softmax scale.
        layer_idx: which cache the layer owns.
        backend: an MLA backend (``get_attn_backend(..., use_mla=True)``).
        kv_b_proj: the layer's up-projection (``[H * (nope + v), R]`` weight), which the
            prompt path applies to the latents and the decode path absorbs.
        rotary_emb: the rotary embedding of the ``P`` rotary dimensions.

    Raises:
        ValueError: ``backend`` is not an MLA backend.
    """

    def __init__(
        self,
        dims: MLADims,
        scale: float,
        layer_idx: int,
        backend: type[AttentionBackend],
        kv_b_proj: nn.Module,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        nn.Module.__init__(self)
        impl_cls = backend.get_impl_cls()
        if not (isinstance(impl_cls, type) and issubclass(impl_cls, MLAImpl)):
            raise ValueError(f"backend {backend.name!r} has no multi-head latent attention")
        self.dims = dims
        self.num_heads = dims.num_heads
        self.head_dim = dims.qk_head_dim
        self.num_kv_heads = 1
        self.layer_idx = layer_idx
        self.sliding_window = None
        self.attention_chunk_size = None  # every MLA layer is global (``is_local`` False)
        self.rotary_emb = rotary_emb
        self.rope_in_decode = False
        self.kv_cache: torch.Tensor | None = None
        # Attention's FP8 cache scales: the latent cache is never FP8 (refused at start-up).
        self.k_scale = self.v_scale = 1.0
        self._kv_scales: tuple[float, float] | None = None
        self.impl = impl_cls(dims, scale, kv_b_proj)

    @property
    def output_size(self) -> int:
        return self.num_heads * self.dims.v_head_dim

    def bind_cache(self, kv_cache: torch.Tensor | None) -> None:
        """Attend over ``kv_cache`` from now on (None: unbind). The latent cache is in the
        model's dtype: an FP8 cache is refused at start-up for MLA models, so there is no
        K/V scale to apply."""
        self.kv_cache = kv_cache

    def kv_cache_spec(self) -> KVCacheSpec:
        """One latent of ``kv_lora_rank + qk_rope_head_dim`` values per token."""
        return KVCacheSpec(1, self.dims.latent_dim, num_tensors=1)

    def describe_cache(self) -> str:
        d = self.dims
        full = d.num_heads * (d.qk_head_dim + d.v_head_dim)
        return (
            f"a latent of {d.latent_dim} values (kv_lora_rank {d.kv_lora_rank} + rope "
            f"{d.qk_rope_head_dim}; full K and V heads would be {full})"
        )

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        metadata: AttentionMetadata,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hook = attention_layer._attention_hook
        if hook is not None:
            return hook(self, query, kv_c, k_pe, metadata, positions)
        query = self.store_kv(
            query, kv_c, k_pe, metadata.slot_mapping, metadata.num_actual_tokens, positions
        )
        return self.attend(query, metadata)

    def store_kv(  # type: ignore[override]
        self,
        query: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotate ``query``'s rotary parts (in place) and ``k_pe``, and store the first
        ``num_tokens`` tokens' ``[kv_c | k_pe]`` in the cache (negative slots skipped).

        Returns:
            ``query``, rotated.

        Raises:
            ValueError: ``positions`` is None.
        """
        if positions is None:
            raise ValueError(f"layer {self.layer_idx} applies RoPE and needs positions")
        rope, d, cache = self.rotary_emb, self.dims, self._cache()
        if self.impl.fuses_rope:
            self.impl.rope_and_write(
                positions, query, kv_c, k_pe, rope.cos_sin_cache, rope.is_neox_style, cache,
                slot_mapping, num_tokens,
            )  # fmt: skip
            return query
        q = query.view(query.shape[0], d.num_heads, d.qk_head_dim)
        q[..., d.qk_nope_head_dim :] = rope.rotate(positions, q[..., d.qk_nope_head_dim :])
        k_pe = rope.rotate(positions, k_pe[:, None, :]).squeeze(1)
        self.impl.write_latent(kv_c, k_pe, cache, slot_mapping, num_tokens)
        return query

"""Copies between KV blocks of the paged cache (the worker's half of copy-on-write)."""

from __future__ import annotations

import torch


def block_dim(layer_cache: torch.Tensor) -> int:
    """The block dimension of one layer's cache: 1 in the K/V layout ``[2, num_blocks,
    block_size, num_kv_heads, head_dim]``, 0 in MLA's latent layout ``[num_blocks,
    block_size, latent]`` (see the backends' ``get_kv_cache_shape``)."""
    return 1 if layer_cache.dim() == 5 else 0


def copy_kv_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Copy whole KV blocks, in every layer: block ``dst`` becomes a copy of block ``src``.

    Args:
        kv_caches: per layer, in its backend's layout (see ``block_dim``).
        pairs: (source block id, destination block id); no destination is also a source.
    """
    if not pairs or not kv_caches:
        return
    device = kv_caches[0].device
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
    for cache in kv_caches:
        blocks = cache.movedim(block_dim(cache), 0)  # a view: writes reach the cache
        blocks[dst] = blocks[src]

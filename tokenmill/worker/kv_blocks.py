"""Copies between KV blocks of the paged cache (the worker's half of copy-on-write)."""

from __future__ import annotations

import torch


def copy_kv_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Copy whole KV blocks, in every layer: block ``dst`` becomes a copy of block ``src``.

    Args:
        kv_caches: per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        pairs: (source block id, destination block id); no destination is also a source.
    """
    if not pairs or not kv_caches:
        return
    device = kv_caches[0].device
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
    for cache in kv_caches:
        cache[:, dst] = cache[:, src]

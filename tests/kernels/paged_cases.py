"""Paged KV caches for the attention tests: each request's context in shuffled blocks."""

from __future__ import annotations

import torch


def scattered_cache(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                    gen: torch.Generator, fill: float, spare_blocks: int, spare_columns: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 cache ``[2, NB, block_size, Hkv, D]`` filled with ``fill`` and random K/V at
    every request's positions, in blocks drawn at random, and the block table ``[B, W]``
    int32 whose columns past a request's blocks hold other valid ids (``spare_blocks`` more
    blocks than the contexts need, ``spare_columns`` more columns than the longest)."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed) + spare_columns
    table = torch.randint(num_blocks, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), fill)
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    for i, n in enumerate(seq_lens):
        blocks = [free.pop() for _ in range(needed[i])]
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
        flat[:, slots] = torch.randn(2, n, num_kv_heads, head_dim, generator=gen)
    return cache, table

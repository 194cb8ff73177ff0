"""The paged KV cache's tensors: their element type, one arena for every layer, and copies
between blocks (the worker's half of copy-on-write)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from tokenmill.worker.host_memory import zeroed_tensor

if TYPE_CHECKING:
    from tokenmill.model.attention.backend import AttentionBackend, KVCacheSpec


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


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for ``--kv-cache-dtype``: ``auto`` keeps the model's.

    Raises:
        ValueError: an unknown spelling.
    """
    if cache_dtype == "auto":
        return model_dtype
    table = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}
    if cache_dtype not in table:
        raise ValueError(f"--kv-cache-dtype {cache_dtype!r}: auto, fp8, fp8_e4m3 or fp8_e5m2")
    return table[cache_dtype]


def allocate_kv_arena(
    specs: Sequence[KVCacheSpec],
    backend: type[AttentionBackend],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    allocate: Callable[[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One zero-filled ``[layers, *layout]`` tensor for the layers' caches, ``layout`` being
    the backend's (``get_kv_cache_shape``) for each layer's ``KVCacheSpec``.

    Zero-filled: attention reads padded block-table entries under a mask, and masked
    garbage could be NaN, which a mask does not cancel (0 * NaN = NaN). On the CPU the
    zeros come from the kernel page by page as blocks are first used.

    Args:
        allocate: gives a ``uint8`` device tensor of that many bytes for the cache (sleep
            mode's stable-address memory); default: ``torch``'s allocator.

    Raises:
        ValueError: layers that cache different shapes.
    """
    shapes = set()
    for spec in specs:
        shape = backend.get_kv_cache_shape(
            num_blocks, block_size, spec.num_kv_heads, spec.head_size
        )
        assert math.prod(shape) == num_blocks * block_size * spec.values_per_token()
        shapes.add(tuple(shape))
    if len(shapes) != 1:
        raise ValueError(f"the attention layers cache different shapes: {sorted(shapes)}")
    shape = (len(specs), *shapes.pop())
    if allocate is None:
        return zeroed_tensor(shape, dtype, device)
    nbytes = math.prod(shape) * dtype.itemsize
    return allocate(nbytes).view(dtype).view(shape).zero_()

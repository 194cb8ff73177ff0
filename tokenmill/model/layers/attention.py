"""The attention layer models use: holds its layer's KV cache and calls the backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tokenmill.kernels.rotary import rotary_and_cache
from tokenmill.model.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    DecodeRotary,
    KVCacheSpec,
)
from tokenmill.model.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Paged attention for one layer.

    ``forward(q [T, H*D], k [T, Hkv*D], v [T, Hkv*D], metadata, positions) -> [T, H*D]``.
    The model runner binds ``kv_cache`` (``[2, num_blocks, block_size, Hkv, D]``) before the
    first forward (see ``bind_kv_caches``).

    A layer given its model's rotary embedding applies it to ``q`` and ``k`` itself, from
    ``positions`` (``[T]`` int): where the rotation runs fused (CUDA, a power-of-two half
    rotary dimension) the rotation and the KV-cache write are one kernel
    (``kernels.rotary.rotary_and_cache``), one launch and one pass over the keys less per
    layer, and in decode-only steps on a backend that ``supports_decode_rotary`` both happen
    inside the decode attention launch; elsewhere the torch rotation, then the backend's
    write. Without one, ``q`` and ``k`` arrive rotated (or need no rotation).

    An FP8 cache (``--kv-cache-dtype fp8``) holds ``k / k_scale`` and ``v / v_scale`` with
    the layer's per-tensor scales (``k_scale``, ``v_scale``: the checkpoint's, else 1.0, as
    vLLM): the key scale is folded into the softmax scale and the output is multiplied by
    the value scale (attention is linear in V).

    Args:
        num_heads, head_dim, num_kv_heads: head layout on this rank.
        scale: softmax scale.
        layer_idx: index of the layer (which KV cache tensor it owns).
        backend: the attention backend class.
        sliding_window: window in tokens for sliding-window layers, else None.
        logits_soft_cap: attention-score soft cap, else None.
        rotary_emb: the rotary embedding to apply to ``q`` and ``k``, else None.
        attention_chunk_size: chunk in tokens for chunked local-attention layers, else None.
        sinks: ``[num_heads]`` per-head sink logits (a parameter of the model, filled when
            its weights load), else None. See ``AttentionImpl`` for all three features.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        backend: type[AttentionBackend],
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        rotary_emb: RotaryEmbedding | None = None,
        attention_chunk_size: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.attention_chunk_size = attention_chunk_size
        self.impl = backend.get_impl_cls()(
            num_heads, head_dim, scale, num_kv_heads, sliding_window, logits_soft_cap,
            attention_chunk_size, sinks,
        )  # fmt: skip
        self.rotary_emb = rotary_emb
        # Decode-only steps rotate and write the new K/V inside the decode launch.
        self.rope_in_decode = backend.supports_decode_rotary
        self.kv_cache: torch.Tensor | None = None
        self.k_scale = 1.0
        self.v_scale = 1.0
        # (k_scale, v_scale) while an FP8 cache is bound and a scale is not 1, else None.
        self._kv_scales: tuple[float, float] | None = None

    def bind_cache(self, kv_cache: torch.Tensor | None) -> None:
        """Attend over ``kv_cache`` from now on (None: unbind); an FP8 cache takes the
        layer's ``k_scale`` / ``v_scale``."""
        self.kv_cache = kv_cache
        fp8 = kv_cache is not None and kv_cache.element_size() == 1
        scaled = fp8 and (self.k_scale != 1.0 or self.v_scale != 1.0)
        self._kv_scales = (self.k_scale, self.v_scale) if scaled else None
        self.impl.set_key_scale(self.k_scale if fp8 else 1.0)

    def _scaled_kv(self, key: torch.Tensor, value: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kv_scales is None:
            return key, value
        k_scale, v_scale = self._kv_scales
        return key / k_scale, value / v_scale

    def _unscale(self, out: torch.Tensor) -> torch.Tensor:
        if self._kv_scales is not None and self._kv_scales[1] != 1.0:
            out.mul_(self._kv_scales[1])
        return out

    @property
    def is_local(self) -> bool:
        """Whether a query sees only part of its context (a sliding window or a chunk)."""
        return self.sliding_window is not None or self.attention_chunk_size is not None

    @property
    def output_size(self) -> int:
        """Width of the layer's output rows: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    def kv_cache_spec(self) -> KVCacheSpec:
        """What the layer caches per token: K and V, ``num_kv_heads`` heads of ``head_dim``."""
        return KVCacheSpec(self.num_kv_heads, self.head_dim)

    def describe_cache(self) -> str:
        """What the layer caches per token, in words (start-up log)."""
        return f"K and V of {self.num_kv_heads} heads x {self.head_dim}"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if _attention_hook is not None:
            return _attention_hook(self, query, key, value, metadata, positions)
        if self.decodes_with_rotary(query, metadata):
            rope = self.rotary_emb
            rotary = DecodeRotary(rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style)
            key, value = self._scaled_kv(key, value)
            return self._unscale(self.impl.attend_decode_rotary(
                query, key, value, self._cache(), metadata, rotary
            ))
        query = self.store_kv(
            query, key, value, metadata.slot_mapping, metadata.num_actual_tokens, positions
        )
        return self.attend(query, metadata)

    def decodes_with_rotary(self, query: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """Whether this step's attention is a decode-only one whose kernel rotates the query
        and key and writes the new K/V itself (``impl.attend_decode_rotary``): the backend
        takes the rotation in decode, every request brings one token, there is no cascade,
        uniform grid or read of this step's K/V, and the rotation runs fused (CUDA) or in
        the host's native decode kernel. ``query``: the step's queries (or a tensor on
        their device, of their dtype).

        Raises:
            RuntimeError: it is such a step and no KV cache is bound.
        """
        rope = self.rotary_emb
        return bool(
            self.rope_in_decode
            and rope is not None
            and metadata.max_query_len == 1
            and not metadata.common_prefix_len
            and not metadata.uniform_grids
            and not metadata.reads_step_kv
            and (rope.runs_fused(query) or self.impl.host_decode_rotary(query, self._cache(), rope))
        )

    def store_kv(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotate ``query`` and ``key`` by the layer's rotary embedding (if it has one), then
        store the first ``num_tokens`` tokens' K/V in the layer's cache (negative slots
        skipped; see ``AttentionImpl.write_kv``).

        Returns:
            The query to attend with: ``query`` rotated in place (fused path), a new rotated
            tensor (torch path), or ``query`` itself (no rotary embedding).

        Raises:
            ValueError: the layer has a rotary embedding and ``positions`` is None.
        """
        rope = self.rotary_emb
        key, value = self._scaled_kv(key, value)
        if rope is not None:
            if positions is None:
                raise ValueError(f"layer {self.layer_idx} applies RoPE and needs positions")
            if rope.runs_fused(query):
                rotary_and_cache(
                    positions, query, key, value, rope.cos_sin_cache, rope.head_dim,
                    rope.rotary_dim, rope.is_neox_style, self._cache(), slot_mapping, num_tokens,
                )  # fmt: skip
                return query
            query, key = rope(positions, query, key)
        self.impl.write_kv(key, value, self._cache(), slot_mapping, num_tokens)
        return query

    def attend(
        self, query: torch.Tensor, metadata: AttentionMetadata, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention over the layer's cache as it is; see ``AttentionImpl.attend``."""
        return self._unscale(self.impl.attend(query, self._cache(), metadata, out))

    def _cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError(f"layer {self.layer_idx} has no KV cache bound")
        return self.kv_cache


# What every Attention layer calls instead of its backend while ``attention_hook`` is active:
# ``hook(layer, query, key, value, metadata, positions)``.
AttentionHook = Callable[
    [Attention, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None],
    torch.Tensor,
]
_attention_hook: AttentionHook | None = None


def attention_hook_active() -> bool:
    """Whether an ``attention_hook`` block is running."""
    return _attention_hook is not None


@contextmanager
def attention_hook(hook: AttentionHook) -> Iterator[None]:
    """Route every ``Attention.forward`` through ``hook(layer, query, key, value, metadata,
    positions)`` for the duration of the block; its return value is the layer's output.

    The piecewise CUDA graphs use this to split a forward pass at its attention calls.
    Not re-entrant, and global to the process (one model runs per process and thread).
    """
    global _attention_hook
    if _attention_hook is not None:
        raise RuntimeError("an attention hook is already active")
    _attention_hook = hook
    try:
        yield
    finally:
        _attention_hook = None


def bind_kv_caches(model: nn.Module, kv_caches: list[torch.Tensor]) -> None:
    """Give each Attention layer of ``model`` its KV cache tensor: ``kv_caches[i]`` to the
    layer with the ``i``-th smallest ``layer_idx`` (a pipeline stage holds some layers only).

    Raises:
        ValueError: the number of caches differs from the number of attention layers.
    """
    layers = sorted(
        (m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx
    )
    if len(layers) != len(kv_caches):
        raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} attention layers")
    for layer, cache in zip(layers, kv_caches, strict=True):
        layer.bind_cache(cache)


def kv_cache_specs(model: nn.Module) -> list[KVCacheSpec]:
    """Each Attention layer's ``kv_cache_spec()``, in ``layer_idx`` order (the order of the
    caches ``bind_kv_caches`` takes)."""
    layers = sorted(
        (m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx
    )
    return [layer.kv_cache_spec() for layer in layers]


def describe_kv_cache(model: nn.Module, dtype: torch.dtype) -> str:
    """One line on what a token costs in ``model``'s KV cache, for the start-up log."""
    layers = sorted(
        (m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx
    )
    per_token = sum(layer.kv_cache_spec().bytes_per_token(dtype) for layer in layers)
    return (
        f"{len(layers)} layers x {layers[0].describe_cache()} = {per_token} bytes in "
        f"{str(dtype).removeprefix('torch.')}"
    )


def unbind_kv_caches(model: nn.Module) -> None:
    """Drop every Attention layer's reference to its KV cache (so the memory can be freed)."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.bind_cache(None)

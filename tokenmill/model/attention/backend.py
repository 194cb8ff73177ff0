"""The attention backend seam: metadata the model runner builds, and the interface a
backend implements (torch reference on CPU, Triton kernels on CUDA).

Paged attention (Kwon et al., SOSP 2023): each request's KV lives in fixed-size blocks
anywhere in the cache; the block table maps a request's logical blocks to physical ones,
and the slot mapping says where each new token's K/V is written.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Where each scheduled token's query and KV live, for one forward pass.

    Tokens are flat: request ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]``,
    which are the last ``query_len`` positions of its ``seq_len``-token context.

    Attributes:
        num_actual_tokens: scheduled tokens (inputs may be padded past this).
        num_reqs: requests in the batch.
        query_start_loc: ``[num_reqs + 1]`` int32, cumulative query lengths.
        seq_lens: ``[num_reqs]`` int32, context length of each request including this
            step's tokens.
        block_table: ``[num_reqs, max_blocks]`` int32, physical block ids per request
            (entries past a request's blocks are unspecified but valid ids).
        slot_mapping: ``[num_tokens]`` int64, ``block_id * block_size + offset`` of each
            token's K/V; -1 for padding tokens (not written).
        max_query_len: the longest query (tokens) in the batch.
        max_seq_len: the longest context (tokens) in the batch.
        query_start_loc_cpu: host copy of ``query_start_loc`` (no device sync to read it).
        seq_lens_cpu: host copy of ``seq_lens``.
        num_decodes: how many of the first requests have ``query_len == 1`` (the runner
            puts decode requests first when it can; 0 if unknown).
        common_prefix_len: tokens at the start of every one of those ``num_decodes``
            requests' contexts that they hold in the same physical blocks (a shared prompt
            prefix found by prefix caching), a multiple of the block size below each
            request's last position; 0 when none or not looked for. A backend may read
            these keys once for all of them (cascade attention) or ignore the hint.
        uniform_grids: launch every kernel over the whole padded batch, with grids and
            arguments from ``num_reqs``, ``num_actual_tokens`` and ``max_seq_len`` alone,
            the kernels finding each request's work (decode or prompt tokens, lengths) in
            the device tensors; the host copies and ``num_decodes`` are not read. Then any
            mix of decodes and prompt chunks replays one CUDA graph captured for its padded
            token count (``worker/mixed_graph.py``). Padding requests have one token or
            none and a context of 0. Only backends with ``supports_uniform_grids`` see it.
        prefill_range: with ``uniform_grids``, ``[2]`` int32 on the device: the first
            request that is not one of the leading decodes, and how many follow it (at most
            the backend's ``uniform_max_prefills``).
        reads_step_kv: some request reads KV that this step writes for another request (a
            prefix-cache hit, made when it was admitted this step, on a block that another
            request fills in this step; ``SchedulerOutput.reads_step_kv``). Kernels then
            must not read the cache before the step's KV writes have completed; without
            it, every cache slot a request reads other than its own new ones was written
            by an earlier step.
        last_key_pos: ``[num_tokens]`` int32 on the device, the position of the last key
            each query token sees: its own where attention is causal, the last token of its
            span for a token of a bidirectional span (Gemma 3's image placeholders, which
            attend to each other both ways); local windows still count from the token's own
            position. None: causal everywhere. Every span lies wholly in the step's chunk
            of its request (the scheduler never ends a chunk inside one), so the keys a
            token sees are always in the cache when it attends; such steps run eagerly,
            never with ``uniform_grids``.
        backend_state: what a backend works out once per step and its layers share (the
            Triton backend's batch split, split workspaces and launches), by backend name;
            empty in a new metadata, ``dataclasses.replace`` included. A captured CUDA
            graph keeps its capture's metadata alive for the workspaces it replays into.
    """

    num_actual_tokens: int
    num_reqs: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_decodes: int = 0
    common_prefix_len: int = 0
    uniform_grids: bool = False
    prefill_range: torch.Tensor | None = None
    reads_step_kv: bool = False
    last_key_pos: torch.Tensor | None = None
    backend_state: dict[str, Any] = field(default_factory=dict, init=False, repr=False)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer keeps in the paged KV cache for each token.

    Attributes:
        num_kv_heads: heads stored per token.
        head_size: values per stored head.
        num_tensors: 2 where keys and values are stored apart (the backend's
            ``[2, num_blocks, block_size, num_kv_heads, head_size]``); 1 where one entry per
            token is the source of both, as multi-head latent attention's compressed latent
            (``[num_blocks, block_size, head_size]``, DeepSeek-V2, arXiv:2405.04434).
    """

    num_kv_heads: int
    head_size: int
    num_tensors: int = 2

    def values_per_token(self) -> int:
        """Cached values of one token in this layer."""
        return self.num_tensors * self.num_kv_heads * self.head_size

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of one token in this layer, in ``dtype``."""
        return self.values_per_token() * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class DecodeRotary:
    """The rotary embedding a decode launch applies itself (``attend_decode_rotary``).

    Attributes:
        cos_sin_cache: float32 ``[max_pos, rotary_dim]``, ``cos | sin`` per position.
        rotary_dim: dimensions rotated (the first ones of each head); ``rotary_dim / 2`` a
            power of two.
        is_neox_style: rotate the two halves (else adjacent pairs).
    """

    cos_sin_cache: torch.Tensor
    rotary_dim: int
    is_neox_style: bool


class AttentionImpl(abc.ABC):
    """One layer's attention over the paged KV cache.

    Args:
        num_heads: query heads (on this rank).
        head_dim: size of each head.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        num_kv_heads: key/value heads; ``num_heads`` must be a multiple (GQA,
            Ainslie et al. 2023).
        sliding_window: if set, a query at position p sees keys at positions > p - window.
        logits_soft_cap: if set, scores become ``cap * tanh(scores / cap)`` (Gemma 2).
        attention_chunk_size: if set, the sequence is cut into chunks of this many tokens
            and a query at position p sees only the keys of its own chunk, positions
            ``p // chunk * chunk .. p`` (chunked local attention, Llama 4).
        sinks: if set, ``[num_heads]`` learned logits, one per query head, that join each
            row's softmax denominator as a key whose value is zero: the weights become
            ``exp(s_j) / (exp(sink) + sum_k exp(s_k))`` over the scaled (and capped) scores
            ``s`` (attention sinks, Xiao et al. 2023, arXiv:2309.17453; gpt-oss). Held by
            reference: the model loads its values after the layer is built.

    Raises:
        ValueError: ``num_heads`` is not a multiple of ``num_kv_heads``, both a window and
            a chunk size are given, or ``sinks`` is not ``[num_heads]``.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        attention_chunk_size: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        if sliding_window is not None and attention_chunk_size is not None:
            raise ValueError("a layer has either a sliding window or attention chunks, not both")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must be [{num_heads}], got {list(sinks.shape)}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.softmax_scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.attention_chunk_size = attention_chunk_size
        self.sinks = sinks

    def set_key_scale(self, k_scale: float) -> None:
        """Keys are stored divided by ``k_scale`` (an FP8 cache's per-tensor scale): scores
        take it back through the softmax scale, ``scale = softmax_scale * k_scale``."""
        self.scale = self.softmax_scale * k_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into their slots (``write_kv``), then attend (``attend``).

        Args:
            query: ``[num_tokens, num_heads * head_dim]``.
            key: ``[num_tokens, num_kv_heads * head_dim]``.
            value: ``[num_tokens, num_kv_heads * head_dim]``.
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
            metadata: the batch layout.
            out: optional destination, as for ``attend``.

        Returns:
            ``[num_tokens, num_heads * head_dim]``, same dtype as ``query``; rows past
            ``metadata.num_actual_tokens`` are unspecified.
        """
        self.write_kv(key, value, kv_cache, metadata.slot_mapping, metadata.num_actual_tokens)
        return self.attend(query, kv_cache, metadata, out)

    @abc.abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
    ) -> None:
        """Store the first ``num_tokens`` tokens' K/V in their slots.

        Args:
            key, value: ``[>= num_tokens, num_kv_heads * head_dim]``.
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
            slot_mapping: ``[>= num_tokens]`` int, ``block_id * block_size + offset``;
                tokens with a negative slot (padding) are skipped.
            num_tokens: tokens to write.
        """

    @abc.abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over the cache as it is (this step's K/V already written).

        Args:
            query: ``[num_tokens, num_heads * head_dim]``; rows may be strided.
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
            metadata: the batch layout.
            out: optional ``[num_tokens, num_heads * head_dim]`` destination, rows
                contiguous, ``query.dtype`` (a CUDA graph's static buffer); allocated when
                None.

        Returns:
            ``out``: every row of a real token is written; rows past
            ``metadata.num_actual_tokens`` are unspecified.

        Raises:
            ValueError: ``kv_cache`` or ``out`` has a layout the backend cannot address.
        """

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
        """Rotate, write this step's K/V and attend in one launch, for a decode-only batch:
        ``query`` and ``key`` arrive unrotated, each token at position ``seq_len - 1``.
        Backends whose class sets ``supports_decode_rotary`` implement it; the attention
        layer calls it only on those, for steps with ``max_query_len == 1`` and no
        ``common_prefix_len``, ``uniform_grids`` or ``reads_step_kv``.

        Args:
            query: ``[num_reqs, num_heads * head_dim]``, unrotated (left as it is).
            key, value: ``[num_reqs, num_kv_heads * head_dim]``, unrotated.
            kv_cache, metadata, out: as for ``attend``.
            rotary: the rotary table and layout.

        Returns:
            ``out``, as for ``attend``.

        Raises:
            NotImplementedError: the backend has no such launch.
            ValueError: a batch that is not decode-only, or layouts the backend cannot
                address.
        """
        raise NotImplementedError(f"{type(self).__name__} does not rotate inside attention")

    def host_decode_rotary(self, query: torch.Tensor, kv_cache: torch.Tensor, rope: Any) -> bool:
        """Whether ``attend_decode_rotary`` takes this decode step where the rotary embedding
        has no fused GPU kernel (``rope.runs_fused`` is False): backends with a host path
        (the CPU's native kernel) say so; the others take such steps unfused."""
        return False


class AttentionBackend(abc.ABC):
    """A family of attention kernels: names itself and builds per-layer implementations."""

    name: str = "abstract"
    # Reads ``AttentionMetadata.common_prefix_len`` (cascade attention); others ignore it.
    supports_cascade: bool = False
    # Honours ``AttentionMetadata.uniform_grids`` (whole-step graphs of mixed batches) for
    # batches with at most this many requests after the leading decodes.
    supports_uniform_grids: bool = False
    uniform_max_prefills: int = 0
    # Implements ``AttentionImpl.attend_decode_rotary`` (RoPE and the KV write inside the
    # decode launch).
    supports_decode_rotary: bool = False

    @staticmethod
    @abc.abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    def decode_warm_up_cases(
        num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, max_decodes: int,
        max_context: int, device: torch.device,
    ) -> list[tuple[int, int]]:  # fmt: skip
        """(decode count, context tokens) pairs at which eager decode steps launch every
        decode kernel variant that the backend picks by batch size and context length, so
        that start-up can compile them all; empty where nothing depends on them.
        ``group``: query heads per KV head."""
        return []

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

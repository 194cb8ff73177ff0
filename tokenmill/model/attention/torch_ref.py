"""Reference paged attention in plain torch: the CPU backend, and the ground truth the GPU
kernels are tested against.

Decode requests (one query token each) take the native paged decode kernel
(``tokenmill_cpu.paged_decode_attention``, ``kernels/cpu/csrc/paged_attention.cpp``) where it
applies: a contiguous float32, bfloat16 or float16 cache on the CPU, a head size that is a
multiple of 16, and a layer with at most a sliding window (no soft cap, sinks or attention
chunks). It reads each request's keys straight from its blocks, one task per (request, kv
head); in a decode-only step of a layer with RoPE (``attend_decode_rotary``) the same task
first rotates and stores its kv head's new key and value and rotates its query heads. Elsewhere
they are attended in batched torch calls over their gathered blocks, one call
per padded key length (``DECODE_KEY_GRANULE``). Either way a request's result is
bit-identical whatever else is in the batch: the kernel's sums run over the request's own keys
in a fixed order, and torch's are cut to the same padded length. Prompt chunks go one request
at a time, with a causal mask aligned to the end of the context (query ``r`` of a chunk after
``c`` cached tokens sees keys ``0..c+r``), narrowed by the layer's sliding window or attention
chunk. Soft-capped scores and attention sinks take an explicit float32 softmax; plain layers
take torch's fused attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.kernels.cpu.native import native_ops
from tokenmill.math_utils import cdiv
from tokenmill.model.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    DecodeRotary,
)

FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Cache dtypes the native decode kernel reads.
NATIVE_DECODE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def write_to_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V in its slot.

    Args:
        key, value: ``[T, num_kv_heads * head_dim]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[T]`` int, non-negative slots.
    """
    _, num_blocks, block_size, h, d = kv_cache.shape
    slots = slot_mapping.long()
    key, value = (to_cache_dtype(x.view(-1, h, d), kv_cache.dtype) for x in (key, value))
    if kv_cache.dtype in FP8_TYPES:  # copied as bytes (no FP8 index_copy_ on CPU)
        kv_cache, key, value = (t.view(torch.uint8) for t in (kv_cache, key, value))
    kv_cache[0].view(num_blocks * block_size, h, d).index_copy_(0, slots, key)
    kv_cache[1].view(num_blocks * block_size, h, d).index_copy_(0, slots, value)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache's dtype; FP8 saturates at its largest finite value (as the CUDA
    kernels' conversion does) instead of overflowing to NaN."""
    if x.dtype == dtype:
        return x
    if dtype in FP8_TYPES:
        limit = torch.finfo(dtype).max
        x = x.float().clamp(-limit, limit)
    return x.to(dtype)


def context_slots(block_ids: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Cache slots of the first ``length`` tokens through block table rows.

    Args:
        block_ids: ``[..., nb]`` int block ids covering ``length`` tokens.
        length: tokens.
        block_size: tokens per block.

    Returns:
        ``[..., length]`` int64 ``block_id * block_size + offset``.
    """
    offsets = torch.arange(block_size, device=block_ids.device)
    slots = block_ids.long()[..., None] * block_size + offsets  # [..., nb, block_size]
    return slots.flatten(-2)[..., :length]


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """K or V of ``cache [num_blocks, block_size, H, D]`` at ``slots [...]`` -> ``[..., H,
    D]``: one row copy per slot."""
    if cache.dtype in FP8_TYPES:  # gathered as bytes (no FP8 indexing on CPU)
        return gather_slots(cache.view(torch.uint8), slots).view(cache.dtype)
    rows = cache.reshape(-1, *cache.shape[-2:]).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[-2:])


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None,
    is_causal: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention with GQA. q ``[B, H, Lq, D]``, k/v ``[B, Hkv, Lk, D]``, mask
    broadcastable to ``[B, H, Lq, Lk]`` (True = attend); ``sinks`` ``[H]`` logits that join
    each row's softmax denominator (``AttentionImpl``)."""
    group = q.shape[1] // k.shape[1]
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=group > 1
        )
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    if is_causal:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)
    # The sink is one more logit per row whose value is zero: it only adds to the
    # denominator.
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


class TorchAttentionImpl(AttentionImpl):
    """Paged attention in torch ops (see module docstring)."""

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
    ) -> None:
        n = num_tokens
        slots = slot_mapping[:n]
        if n == 0 or int(slots.min()) >= 0:
            write_to_kv_cache(key[:n], value[:n], kv_cache, slots)
        else:  # padding tokens of CUDA-graph-shaped batches have slot -1
            valid = slots >= 0
            write_to_kv_cache(key[:n][valid], value[:n][valid], kv_cache, slots[valid])

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n = metadata.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_dim)
        plan = batch_plan(metadata)
        if plan["all_decode"] and out is None and n == query.shape[0]:
            return self._decode(q, kv_cache, metadata, plan).reshape(n, -1)
        if out is None:
            out = torch.zeros_like(query)
        o = out[:n].view(n, self.num_heads, self.head_dim)
        if plan["decode_reqs"].numel():
            o[plan["decode_tokens"]] = self._decode(q, kv_cache, metadata, plan)
        starts = plan["starts"]
        seq_lens = plan["seq_lens"]
        last_key_pos = metadata.last_key_pos
        for i in plan["prefill_reqs"]:
            s, e = starts[i], starts[i + 1]
            last = None if last_key_pos is None else last_key_pos[s:e]
            o[s:e] = self._prefill(q[s:e], kv_cache, metadata.block_table[i], seq_lens[i], last)
        return out

    def host_decode_rotary(self, query: torch.Tensor, kv_cache: torch.Tensor, rope: Any) -> bool:
        """The native kernel rotates and stores the new K/V of CPU decode steps: a cache it
        reads, and a rotary table of positions (``rope.rotates_at_context_end``)."""
        return (
            query.device.type == "cpu"
            and getattr(rope, "rotates_at_context_end", False)
            and rope.cos_sin_cache.dtype == torch.float32
            and self.native_decode_ops(kv_cache) is not None
        )

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
        ops = self.native_decode_ops(kv_cache)
        plan = batch_plan(metadata)
        if ops is None or plan["prefill_reqs"]:
            raise ValueError("the CPU's rotary decode takes decode-only steps on a cache its "
                             "native kernel reads")  # fmt: skip
        n = query.shape[0]
        q = query.view(n, self.num_heads, self.head_dim)
        # Padded rows (CUDA-graph sizes, context 0) attend to nothing and store nothing: the
        # kernel takes the real decodes' rows only, the rest of the output is zero.
        padded = not plan["all_decode"] or n != metadata.num_actual_tokens
        rows = plan["decode_tokens"] if padded else slice(0, n)
        table, seq_lens = native_decode_rows(plan, metadata)
        o = ops.paged_decode_attention_rotary(
            q[rows].float(), key[rows].float(), value[rows].float(), kv_cache,
            metadata.slot_mapping[rows].long().contiguous(), table, seq_lens,
            rotary.cos_sin_cache, rotary.rotary_dim, rotary.is_neox_style, self.scale,
            self.sliding_window or 0,
        ).flatten(1).to(query.dtype)
        if out is None and not padded:
            return o
        if out is None:
            out = torch.zeros_like(query)
        elif padded:
            out[:n].zero_()
        out[rows] = o
        return out

    def _window_mask(
        self, q_pos: torch.Tensor, k_pos: torch.Tensor, q_last: torch.Tensor | None = None
    ) -> torch.Tensor:
        """True where a query at ``q_pos`` may see a key at ``k_pos`` (up to ``q_last``,
        by default ``q_pos``: causal; and within the sliding window or the query's
        attention chunk)."""
        mask = k_pos <= (q_pos if q_last is None else q_last)
        if self.sliding_window is not None:
            mask &= k_pos > q_pos - self.sliding_window
        if self.attention_chunk_size is not None:
            mask &= k_pos >= q_pos // self.attention_chunk_size * self.attention_chunk_size
        return mask

    def _prefill(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_ids: torch.Tensor,
        seq_len: int,
        last_key_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One request's prompt chunk ``q`` ``[q_len, H, D]`` (the last ``q_len`` of its
        ``seq_len`` positions) over its cached keys; ``last_key_pos`` ``[q_len]``: the last
        key each token sees (``AttentionMetadata.last_key_pos``), None: causal."""
        q_len = q.shape[0]
        bs = kv_cache.shape[2]
        slots = context_slots(block_ids[: cdiv(seq_len, bs)], seq_len, bs)
        k, v = (gather_slots(kv_cache[i], slots).to(q.dtype) for i in (0, 1))
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        local = self.sliding_window is not None or self.attention_chunk_size is not None
        if q_len == seq_len and not local and last_key_pos is None:
            out = _attend(qt, kt, vt, None, self.scale, self.logits_soft_cap, is_causal=True,
                          sinks=self.sinks)  # fmt: skip
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            q_last = None if last_key_pos is None else last_key_pos.to(q_pos.dtype)[:, None]
            mask = self._window_mask(q_pos, k_pos, q_last)
            out = _attend(qt, kt, vt, mask, self.scale, self.logits_soft_cap, sinks=self.sinks)
        return out.squeeze(0).transpose(0, 1)

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, plan: dict
    ) -> torch.Tensor:
        """The step's decode queries ``[B, H, D]`` over their contexts -> ``[B, H, D]``, by
        the native kernel where it applies, else by torch over the padded-length groups."""
        qd = q if plan["all_decode"] else q[plan["decode_tokens"]]  # [B, H, D]
        ops = self.native_decode_ops(kv_cache)
        if ops is not None:
            table, seq_lens = native_decode_rows(plan, metadata)
            window = self.sliding_window or 0
            out = ops.paged_decode_attention(qd.float(), kv_cache, table, seq_lens, self.scale,
                                             window)  # fmt: skip
            return out.to(qd.dtype)
        groups = _decode_groups(plan, metadata, kv_cache.shape[2])
        if len(groups) == 1:
            return self._decode_group(qd, kv_cache, groups[0])
        out = torch.empty_like(qd)
        for group in groups:
            out[group.rows] = self._decode_group(qd[group.rows], kv_cache, group)
        return out

    def native_decode_ops(self, kv_cache: torch.Tensor) -> Any | None:
        """``torch.ops.tokenmill_cpu`` where this layer's decode rows can take its paged
        decode kernel (see the module docstring), else None (the torch path)."""
        if (
            kv_cache.device.type != "cpu"
            or kv_cache.dtype not in NATIVE_DECODE_DTYPES
            or not kv_cache.is_contiguous()
            or self.head_dim % 16
            or self.logits_soft_cap is not None
            or self.sinks is not None
            or self.attention_chunk_size is not None
        ):
            return None
        return native_ops()

    def _decode_group(
        self, qd: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup
    ) -> torch.Tensor:
        """The group's decode queries ``[Bg, H, D]`` over their keys -> ``[Bg, H, D]``."""
        # Through the group's slot table, made once per step and shared by every layer.
        k, v = (
            gather_slots(kv_cache[i], group.slots).to(qd.dtype).transpose(1, 2) for i in (0, 1)
        )  # [Bg, Hkv, Lp, D]
        mask = self._decode_mask(group, qd.device)
        return _attend(
            qd.unsqueeze(2), k, v, mask, self.scale, self.logits_soft_cap, sinks=self.sinks
        ).squeeze(2)

    def _decode_mask(self, group: DecodeGroup, device: torch.device) -> torch.Tensor | None:
        """``[Bg, 1, 1, Lp]`` keys each of the group's queries may see, made once per step
        for each (window, chunk) pair; None when every query sees all ``Lp`` keys."""
        key = (self.sliding_window, self.attention_chunk_size)
        if key not in group.masks:
            if key == (None, None) and bool((group.seq_lens == group.padded_len).all()):
                group.masks[key] = None
            else:
                k_pos = torch.arange(group.padded_len, device=device)[None, :]
                mask = self._window_mask((group.seq_lens - 1)[:, None], k_pos)
                group.masks[key] = mask[:, None, None, :]
        return group.masks[key]


# On the torch path, decode requests attend over their keys padded to a multiple of this many
# tokens, those with the same padded length in one call. torch's attention gives a row
# different bits at different key lengths (its blocking follows the length), so padding a
# request's keys to the longest request of the step would make its greedy output depend on
# the batch.
DECODE_KEY_GRANULE = 64


@dataclass
class DecodeGroup:
    """Decode requests whose contexts round up to the same ``padded_len`` keys.

    Attributes:
        rows: ``[Bg]`` int64 positions among the step's decode requests.
        slots: ``[Bg, padded_len]`` int64 cache slots; those past a request's length point
            into valid blocks and are masked.
        seq_lens: ``[Bg]`` context lengths.
        padded_len: keys per request, a multiple of ``DECODE_KEY_GRANULE``.
        masks: attention masks by (sliding window, chunk), made on first use.
    """

    rows: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    padded_len: int
    masks: dict = field(default_factory=dict)


def _decode_groups(
    plan: dict, metadata: AttentionMetadata, block_size: int
) -> list[DecodeGroup]:
    """The step's decode requests grouped by padded context length, made once per step."""
    groups = plan.get("decode_groups")
    if groups is None:
        lens = plan["decode_seq_lens"]
        groups = plan["decode_groups"] = []
        for padded_len, rows in padded_len_groups(lens):
            blocks = padded_block_ids(
                metadata.block_table[plan["decode_reqs"][rows]], padded_len, block_size
            )
            slots = context_slots(blocks, padded_len, block_size).contiguous()
            groups.append(DecodeGroup(rows, slots, lens[rows], padded_len))
    return groups


def native_decode_rows(
    plan: dict, metadata: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's decode requests' block table rows ``[B, W]`` and context lengths ``[B]``,
    int32, as the native kernel takes them; made once per step."""
    rows = plan.get("native_decode_rows")
    if rows is None:
        if plan["all_decode"]:
            table = metadata.block_table[: metadata.num_reqs]
        else:
            table = metadata.block_table[plan["decode_reqs"]]
        seq_lens = plan["decode_seq_lens"].to(torch.int32)
        rows = plan["native_decode_rows"] = (table.to(torch.int32).contiguous(), seq_lens)
    return rows


def padded_len_groups(seq_lens: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(padded_len, rows)`` for each distinct context length rounded up to
    ``DECODE_KEY_GRANULE`` (``seq_lens [B]`` int; rows ``[Bg]`` int64), shortest first."""
    padded = (seq_lens + DECODE_KEY_GRANULE - 1) // DECODE_KEY_GRANULE * DECODE_KEY_GRANULE
    return [
        (length, torch.nonzero(padded == length).view(-1))
        for length in sorted(set(padded.tolist()))
    ]


def padded_block_ids(table: torch.Tensor, padded_len: int, block_size: int) -> torch.Tensor:
    """Block table rows ``[B, >= 0]`` cut or widened to the ``cdiv(padded_len, block_size)``
    blocks that cover ``padded_len`` tokens; block 0 stands in past the table's width (its
    keys are masked)."""
    need = cdiv(padded_len, block_size)
    blocks = table[:, :need]
    if blocks.shape[1] < need:
        blocks = torch.cat([blocks, blocks.new_zeros(blocks.shape[0], need - blocks.shape[1])], 1)
    return blocks


def batch_plan(metadata: AttentionMetadata) -> dict:
    """Split the batch into decode and prefill requests, once per step (cached on the
    metadata object, since every layer needs the same split)."""
    plan = getattr(metadata, "_torch_plan", None)
    if plan is not None:
        return plan
    starts = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    num_reqs = metadata.num_reqs
    # Padding requests (context length 0) attend to nothing; their output stays zero.
    decode = [i for i in range(num_reqs) if starts[i + 1] - starts[i] == 1 and seq_lens[i] > 0]
    prefill = [i for i in range(num_reqs) if starts[i + 1] - starts[i] > 1 and seq_lens[i] > 0]
    device = metadata.block_table.device
    plan = {
        "starts": starts,
        "seq_lens": seq_lens,
        "prefill_reqs": prefill,
        "decode_reqs": torch.tensor(decode, dtype=torch.long, device=device),
        "decode_tokens": torch.tensor([starts[i] for i in decode], dtype=torch.long, device=device),
        "decode_seq_lens": torch.tensor([seq_lens[i] for i in decode], device=device),
        # Every token is a decode, request i's at row i: no gather or scatter of rows.
        "all_decode": bool(decode) and len(decode) == num_reqs == metadata.num_actual_tokens,
    }
    metadata._torch_plan = plan  # type: ignore[attr-defined]
    return plan


class TorchAttentionBackend(AttentionBackend):
    """The torch reference backend (CPU, and the test oracle for GPU kernels)."""

    name = "torch"
    # On the CPU, where ``TorchAttentionImpl.host_decode_rotary`` says so.
    supports_decode_rotary = True

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchAttentionImpl

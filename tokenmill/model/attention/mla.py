"""Multi-head latent attention (MLA, DeepSeek-V2, arXiv:2405.04434) over a paged latent cache:
the torch implementation (CPU, and the reference of the Triton one) and its backend.

MLA compresses each token's keys and values into one latent ``c = norm(W_DKV h)`` of
``kv_lora_rank`` values plus one rotary key ``k_pe`` of ``qk_rope_head_dim`` values shared by
every head; the cache holds ``[c | k_pe]`` per token, one entry instead of full K and V
heads. A head's key is ``[W_UK_h c | k_pe]`` and its value ``W_UV_h c``, where ``kv_b_proj``
stacks ``[W_UK_h; W_UV_h]`` per head.

- Prompt tokens (a query chunk of more than one token) expand their context's latents into
  full keys and values with ``kv_b_proj`` and attend as ordinary multi-head attention (a
  long context a piece at a time, merged by online softmax).
- Decode tokens attend in the latent space with the absorbed projections (the paper's
  section 2.1.3): the query's non-rotary part becomes ``q_lat_h = W_UK_h^T q_nope_h``
  (``kv_lora_rank`` values), scores are ``q_lat_h . c + q_pe_h . k_pe``, the softmax-weighted
  sum of the latents is taken back to a head's value space by ``W_UV_h``. No key or value is
  ever expanded: one pass over the cached latents serves every head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.math_utils import cdiv
from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.model.attention.torch_ref import padded_block_ids, padded_len_groups


@dataclass(frozen=True)
class MLADims:
    """The sizes of one MLA layer (on this rank).

    Attributes:
        num_heads: query heads.
        qk_nope_head_dim: the non-rotary part of each query and key head.
        qk_rope_head_dim: the rotary part (one rotary key shared by every head).
        v_head_dim: each value head.
        kv_lora_rank: the compressed latent.
    """

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class MLAStepPlan:
    """Which of a step's requests decode and which compute prompt tokens (host lists).

    Attributes:
        starts: ``query_start_loc`` as a list.
        seq_lens: context lengths as a list.
        decode_reqs: requests with one query token and a context (``[D]`` int64, device).
        decode_tokens: their token rows (``[D]`` int64, device).
        decode_max_len: their longest context.
        prefill_reqs: requests with more than one query token.
    """

    starts: list[int]
    seq_lens: list[int]
    decode_reqs: torch.Tensor
    decode_tokens: torch.Tensor
    decode_max_len: int
    prefill_reqs: list[int]


def step_plan(metadata: AttentionMetadata) -> MLAStepPlan:
    """The step's split into decode and prompt requests, worked out by its first MLA layer
    and kept on ``metadata`` for the others. Padding requests (context 0) are in neither."""
    plan = metadata.backend_state.get("mla")
    if plan is not None:
        return plan
    starts = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    n = metadata.num_reqs
    q_lens = [starts[i + 1] - starts[i] for i in range(n)]
    decode = [i for i in range(n) if q_lens[i] == 1 and seq_lens[i] > 0]
    device = metadata.block_table.device
    plan = metadata.backend_state["mla"] = MLAStepPlan(
        starts=starts,
        seq_lens=seq_lens,
        decode_reqs=torch.tensor(decode, dtype=torch.long, device=device),
        decode_tokens=torch.tensor([starts[i] for i in decode], dtype=torch.long, device=device),
        decode_max_len=max((seq_lens[i] for i in decode), default=0),
        prefill_reqs=[i for i in range(n) if q_lens[i] > 1 and seq_lens[i] > 0],
    )
    return plan


def attend_latent_torch(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """Decode attention in the latent space, in float32 (the Triton kernel's reference).

    Args:
        q_lat: ``[H, B, R]`` absorbed queries (``W_UK^T q_nope`` per head).
        q_pe: ``[B, H, P]`` rotated rotary queries.
        kv_cache: ``[num_blocks, block_size, R + P]`` latents ``[c | k_pe]``.
        block_table: ``[B, >= blocks of the longest context]`` int block ids.
        seq_lens: ``[B]`` int context lengths; a request with 0 gets zeros.
        kv_lora_rank: ``R``.
        scale: softmax scale.

    Returns:
        ``[H, B, R]`` in ``q_lat``'s dtype: per head, the softmax-weighted sum of the
        context's latents ``c``.
    """
    num_heads, batch, rank = q_lat.shape
    out = q_lat.new_zeros(num_heads, batch, rank)
    # Each request over its own context rounded up to DECODE_KEY_GRANULE keys, those of one
    # padded length together: a request's result then does not depend on the batch.
    for length, rows in padded_len_groups(seq_lens):
        if length == 0:
            continue  # a context of 0 has no key: zeros
        blocks = padded_block_ids(block_table[rows], length, kv_cache.shape[1]).long()
        ctx = kv_cache[blocks].reshape(rows.numel(), -1, kv_cache.shape[-1])[:, :length]
        c, pe = ctx[..., :kv_lora_rank].float(), ctx[..., kv_lora_rank:].float()
        scores = torch.einsum("hbr,blr->bhl", q_lat[:, rows].float(), c)
        scores = (scores + torch.einsum("bhp,blp->bhl", q_pe[rows].float(), pe)) * scale
        visible = torch.arange(length, device=q_lat.device)[None, :] < seq_lens[rows, None]
        probs = torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
        out[:, rows] = torch.einsum("bhl,blr->hbr", probs, c).to(q_lat.dtype)
    return out


class MLAImpl:
    """One MLA layer's attention over the paged latent cache, in torch.

    ``write_latent`` stores this step's ``[c | k_pe]`` (rotated) in their slots; ``attend``
    computes the attention output of every query token (see the module docstring for the
    prompt and decode paths). A subclass whose ``fuses_rope`` is set rotates and writes in
    one launch (``rope_and_write``) and may replace ``attend_latent`` (the decode kernel).

    Args:
        dims: the layer's sizes.
        scale: softmax scale.
        kv_b_proj: the layer's up-projection, weight ``[H * (nope + v), R]`` (per head the
            ``W_UK`` rows, then the ``W_UV`` rows). A dense weight is read at each call,
            never copied; a quantized one is dequantized once by ``dequantize_up_projection``.
    """

    fuses_rope = False
    # Longest context expanded whole; longer ones go a piece at a time.
    max_expanded_context = 8192
    # Float32 scores held at once by ``_attend_in_pieces`` (heads x queries x keys).
    piece_scores = 1 << 27

    def __init__(self, dims: MLADims, scale: float, kv_b_proj: nn.Module) -> None:
        self.dims = dims
        self.scale = scale
        self.kv_b_proj = kv_b_proj
        self.dense_up_weight: torch.Tensor | None = None

    def dequantize_up_projection(self, dtype: torch.dtype, device: torch.device) -> None:
        """Keep a dense ``[H * (nope + v), R]`` copy of a quantized ``kv_b_proj`` for the
        absorbed decode (which multiplies by ``W_UK`` and ``W_UV`` per head, not by the whole
        projection); the prompt path keeps the quantized product. The copy is the layer's
        product with the identity, so it is whatever the quantization method computes.
        A dense ``kv_b_proj`` keeps no copy."""
        if self._dense_weight() is not None:
            return
        rank = self.dims.kv_lora_rank
        with torch.no_grad():
            eye = torch.eye(rank, dtype=dtype, device=device)
            self.dense_up_weight = self.kv_b_proj(eye).to(dtype).t().contiguous()

    def _dense_weight(self) -> torch.Tensor | None:
        w = getattr(self.kv_b_proj, "weight", None)
        if isinstance(w, torch.Tensor) and w.is_floating_point() and w.dim() == 2:
            return w
        return self.dense_up_weight

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK [H, nope, R], W_UV [H, v, R])``: views of ``kv_b_proj``'s dense weight.

        Raises:
            RuntimeError: a quantized ``kv_b_proj`` not yet dequantized.
        """
        d = self.dims
        w = self._dense_weight()
        if w is None:
            raise RuntimeError("MLA decode needs dequantize_up_projection() after loading")
        w = w.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, -1)
        return w[:, : d.qk_nope_head_dim], w[:, d.qk_nope_head_dim :]

    def write_latent(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
    ) -> None:
        """Store the first ``num_tokens`` tokens' ``[c | k_pe]`` in their slots.

        Args:
            kv_c: ``[>= num_tokens, R]`` normalised latents.
            k_pe: ``[>= num_tokens, P]`` rotated rotary keys.
            kv_cache: ``[num_blocks, block_size, R + P]``.
            slot_mapping: ``[>= num_tokens]`` int; negative slots (padding) are skipped.
        """
        n = num_tokens
        slots = slot_mapping[:n].long()
        latent = torch.cat([kv_c[:n], k_pe[:n]], dim=-1).to(kv_cache.dtype)
        valid = slots >= 0
        if not bool(valid.all()):
            latent, slots = latent[valid], slots[valid]
        kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slots, latent)

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
        """Rotate the query's rotary part in place and write ``[c | rotated k_pe]`` in one
        launch (implementations with ``fuses_rope``)."""
        raise NotImplementedError(f"{type(self).__name__} does not rotate inside the write")

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of every query token over the latent cache (this step's written).

        Args:
            query: ``[T, H * (nope + rope)]``, rotary parts rotated; rows may be strided.
            kv_cache: ``[num_blocks, block_size, R + P]``.
            metadata: the batch layout. A step whose longest query is one token attends
                every request as a decode from the device tensors alone (a CUDA graph
                replays it); others split the batch on the host copies.
            out: optional ``[T, H * v]`` destination with contiguous rows.

        Returns:
            ``out``: rows of real tokens written; rows past ``num_actual_tokens`` and of
            padding requests are unspecified.
        """
        d = self.dims
        n = metadata.num_actual_tokens
        if out is None:
            out = query.new_zeros(query.shape[0], d.num_heads * d.v_head_dim)
        q = query[:n].view(n, d.num_heads, d.qk_head_dim)
        o = out[:n].view(n, d.num_heads, d.v_head_dim)
        if metadata.max_query_len == 1:
            o.copy_(self._decode(q, kv_cache, metadata.block_table[:n], metadata.seq_lens[:n],
                                 metadata.max_seq_len))  # fmt: skip
            return out
        plan = step_plan(metadata)
        if plan.decode_reqs.numel():
            o[plan.decode_tokens] = self._decode(
                q[plan.decode_tokens], kv_cache, metadata.block_table[plan.decode_reqs],
                metadata.seq_lens[plan.decode_reqs], plan.decode_max_len,
            )  # fmt: skip
        if plan.prefill_reqs:
            self._prefill(q, o, kv_cache, metadata.block_table, plan)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> torch.Tensor:
        """Absorbed decode attention: ``q [B, H, nope + rope]`` -> ``[B, H, v]``."""
        d = self.dims
        w_uk, w_uv = self._up_weights()
        q_lat = torch.bmm(q[..., : d.qk_nope_head_dim].transpose(0, 1), w_uk)  # [H, B, R]
        latent = self.attend_latent(
            q_lat, q[..., d.qk_nope_head_dim :], kv_cache, block_table, seq_lens, max_seq_len
        )
        return torch.bmm(latent, w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, v]

    def attend_latent(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> torch.Tensor:
        """``attend_latent_torch``; ``max_seq_len`` bounds ``seq_lens`` (unused here)."""
        return attend_latent_torch(
            q_lat, q_pe, kv_cache, block_table, seq_lens, self.dims.kv_lora_rank, self.scale
        )

    def _prefill(
        self,
        q: torch.Tensor,
        o: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        plan: MLAStepPlan,
    ) -> None:
        """Prompt tokens: expand the prompt requests' contexts into keys and values (one
        up-projection for all of them), then causal attention per request, aligned to the
        context's end. A context longer than ``max_expanded_context`` is expanded a piece at
        a time instead (``_attend_in_pieces``): the expanded keys and values take
        ``H * (2 nope + rope + v)`` values per context token."""
        d = self.dims
        block_size = kv_cache.shape[1]
        latents = kv_cache.view(-1, d.latent_dim)
        short: list[tuple[int, int]] = []
        slots = []
        for i in plan.prefill_reqs:
            length = plan.seq_lens[i]
            blocks = block_table[i, : cdiv(length, block_size)].long()
            offsets = torch.arange(block_size, device=blocks.device)
            req_slots = (blocks[:, None] * block_size + offsets).reshape(-1)[:length]
            if length > self.max_expanded_context:
                s, e = plan.starts[i], plan.starts[i + 1]
                o[s:e] = self._attend_in_pieces(q[s:e], latents[req_slots])
            else:
                short.append((i, length))
                slots.append(req_slots)
        if not short:
            return
        ctx = latents[torch.cat(slots)]
        k_nope, k_pe, v = self._expand(ctx, q.dtype)
        offset = 0
        for i, length in short:
            s, e = plan.starts[i], plan.starts[i + 1]
            ctx_slice = slice(offset, offset + length)
            offset += length
            k = torch.cat(
                [k_nope[ctx_slice], k_pe[ctx_slice, None, :].expand(-1, d.num_heads, -1)], dim=-1
            )
            o[s:e] = causal_attention(q[s:e], k, v[ctx_slice], self.scale)

    def _expand(
        self, ctx: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Latents ``[L, R + P]`` -> ``k_nope [L, H, nope]``, ``k_pe [L, P]``,
        ``v [L, H, v]`` in ``dtype``."""
        d = self.dims
        kv = self.kv_b_proj(ctx[:, : d.kv_lora_rank].to(dtype).contiguous())
        kv = kv.view(-1, d.num_heads, d.qk_nope_head_dim + d.v_head_dim)
        k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
        return k_nope, ctx[:, d.kv_lora_rank :].to(dtype), v

    def _attend_in_pieces(self, q: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """Causal attention of the last ``Lq`` positions of a long context over all of it,
        expanding ``piece_scores / (H * Lq)`` context tokens at a time and merging the
        pieces by online softmax (running maximum and sum, as FlashAttention; Dao et al.
        2022, arXiv:2205.14135), in float32.

        Shapes: ``q [Lq, H, nope + rope]``, ``ctx [L, R + P]`` latents -> ``[Lq, H, v]``.
        """
        d = self.dims
        q_len, length = q.shape[0], ctx.shape[0]
        piece = max(16, self.piece_scores // (d.num_heads * q_len))
        qf = q.transpose(0, 1).float()  # [H, Lq, D]
        q_pos = torch.arange(length - q_len, length, device=q.device)[:, None]
        m = qf.new_full((d.num_heads, q_len, 1), float("-inf"))
        total = qf.new_zeros(d.num_heads, q_len, 1)
        acc = qf.new_zeros(d.num_heads, q_len, d.v_head_dim)
        for start in range(0, length, piece):
            k_nope, k_pe, v = self._expand(ctx[start : start + piece], q.dtype)
            scores = torch.einsum("hqd,khd->hqk", qf[..., : d.qk_nope_head_dim], k_nope.float())
            scores += torch.einsum("hqp,kp->hqk", qf[..., d.qk_nope_head_dim :], k_pe.float())
            k_pos = torch.arange(start, start + k_pe.shape[0], device=q.device)[None, :]
            scores = (scores * self.scale).masked_fill(k_pos > q_pos, float("-inf"))
            # Every query sees position 0, so ``m`` is finite from the first piece on.
            m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
            probs = torch.exp(scores - m_new)
            rescale = torch.exp(m - m_new)
            total = total * rescale + probs.sum(dim=-1, keepdim=True)
            acc = acc * rescale + torch.einsum("hqk,khv->hqv", probs, v.float())
            m = m_new
        return (acc / total).transpose(0, 1).to(q.dtype)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of the last ``Lq`` positions of an ``L``-token context over all of it:
    query ``r`` sees keys ``0 .. L - Lq + r``.

    Shapes: ``q [Lq, H, D]``, ``k [L, H, D]``, ``v [L, H, Dv]`` -> ``[Lq, H, Dv]``.
    """
    q_len, length = q.shape[0], k.shape[0]
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if q_len == length:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(length - q_len, length, device=q.device)[:, None]
        mask = torch.arange(length, device=q.device)[None, :] <= q_pos
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.squeeze(0).transpose(0, 1)


class TorchMLABackend(AttentionBackend):
    """MLA in torch (CPU, and the reference of the Triton MLA backend).

    ``get_impl_cls`` gives an ``MLAImpl`` class (built by ``MLAAttention`` layers, not
    ``Attention``); its cache is one ``[num_blocks, block_size, R + P]`` tensor per layer.
    """

    name = "torch_mla"

    @staticmethod
    def get_impl_cls() -> type[MLAImpl]:  # type: ignore[override]
        return MLAImpl

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        if num_kv_heads != 1:
            raise ValueError(f"an MLA cache holds one latent per token, not {num_kv_heads} heads")
        return (num_blocks, block_size, head_dim)

"""Proposers that run layers of their own over a paged KV cache: a draft model, an EAGLE head,
the target's MTP layers.

Their KV lives in caches with the target's block ids (``Proposer.kv_cache_layers``), so the
scheduler's block tables and slot mapping serve both and freeing a request's blocks frees
its draft KV too. Each step:

1. One pass over every scheduled request's verified tokens (its scheduled tokens but the
   rejected drafts) and, for a request that got tokens, its new last token: it writes the
   draft's KV of each position the target computed and yields the first draft of each
   proposing request from its last position. A chunk of a prompt is drafted over as the
   target computes it, so the draft's KV never lags the target's.
2. ``k - 1`` passes of one token per proposing request: its previous draft, one position
   further (slots the scheduler set aside as lookahead), greedy (argmax) drafts.

The step's host inputs reach the device in one staged copy before the first pass, the
single-token passes need nothing from the host (a CUDA graph per padded batch size replays
them where one was captured), and the drafts come back in one read after the last pass
(``draft_passes.py``). The scheduler needs them on the host to plan the next step.

EAGLE-style proposers are *shifted*: at position ``p`` they read the target's hidden state at
``p`` and the token at ``p + 1``; a plain draft model reads the token at ``p``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenmill.config import EngineConfig
from tokenmill.math_utils import cdiv
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.model.attention.selector import get_attn_backend
from tokenmill.model.layers.attention import Attention, bind_kv_caches
from tokenmill.spec_decode.proposer import Proposer, VerifiedStep
from tokenmill.worker.cuda_graph import next_size
from tokenmill.worker.proposers.draft_passes import (
    DecodePasses,
    DraftBuffers,
    DraftGraphs,
    first_pass_table_width,
    single_token_seq_lens,
)


class ModelProposer(Proposer):
    """The passes of a proposer with layers and a KV cache (see the module docstring).

    Subclasses load their layers in ``load_model`` (setting ``self.module``, whose
    ``Attention`` layers get the draft KV caches) and implement ``forward`` and
    ``greedy_tokens``.

    Args:
        config: the engine configuration (its speculative configuration set).
        device: where the target runs.
    """

    # Input at position p: the token at p + 1 and the target's hidden state at p (EAGLE).
    shifted = False

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        spec = config.speculative_config
        assert spec is not None
        super().__init__(spec.num_speculative_tokens)
        self.config = config
        self.device = device
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len
        self.attn_backend = get_attn_backend(device.type)
        self.module: nn.Module | None = None
        sc = config.scheduler_config
        k = self.num_speculative_tokens
        # A first pass takes the step's tokens and one more per request.
        self.buffers = DraftBuffers(
            sc.max_num_batched_tokens + sc.max_num_seqs, sc.max_num_seqs,
            cdiv(self.max_model_len, self.block_size), self.max_model_len, k, device,
        )  # fmt: skip
        self.buffers.model = DecodePasses(self, self.buffers, k - 1)
        # The single-token passes' CUDA graphs (``plan_graphs``); None: eager.
        self.graphs: DraftGraphs | None = None
        # Tests set this (ascending sizes) on CPU to pad the single-token passes' batches as
        # the graphs do.
        self.pad_batches_to: list[int] | None = None

    @abc.abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass: ``[T]`` tokens at ``[T]`` positions (and, shifted, ``[T, H]`` hidden
        states) -> ``([T, H]`` states for the logits, ``[T, H]`` states the next pass reads
        at the following position, or None for a plain draft model)."""

    @abc.abstractmethod
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` states for the logits -> ``[N]`` int64 drafts: the argmax over the
        target's vocabulary."""

    def kv_cache_layers(self) -> list[tuple[int, int]]:
        assert self.module is not None, "load_model first"
        layers = sorted(
            (m for m in self.module.modules() if isinstance(m, Attention)),
            key=lambda m: m.layer_idx,
        )
        return [(m.num_kv_heads, m.head_dim) for m in layers]

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        assert self.module is not None
        bind_kv_caches(self.module, kv_caches)

    # ---- CUDA graphs ---------------------------------------------------------------------

    def carried_shape(self) -> tuple[int, torch.dtype] | None:
        """Width and dtype of the hidden state a pass hands the next (shifted proposers);
        None for a plain draft model."""
        return None

    def plan_graphs(self, pool: tuple[int, int] | None) -> DraftGraphs | None:
        """The CUDA graphs of the single-token passes, uncaptured, in the model runner's
        graph ``pool``; None with one draft per step (no single-token pass)."""
        if self.num_speculative_tokens < 2:
            return None
        carried = self.carried_shape()
        if carried is not None:
            self.buffers.carry_buffer(*carried)
        self.graphs = DraftGraphs(self.buffers, pool=pool)
        return self.graphs

    # ---- the passes ---------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, step: VerifiedStep) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in range(step.num_reqs)]
        which = np.flatnonzero(step.propose)
        # Proposing requests first: their block-table rows are then the single-token
        # passes' rows too.
        order = np.concatenate([which, np.flatnonzero(~step.propose)])
        first = self._stage_step(step, order, len(which))
        hidden_in = None
        if self.shifted:
            assert step.hidden_states is not None and first.hidden_rows is not None
            hidden_in = self.target_features(step, first.hidden_rows)
        buf = self.buffers
        n = first.metadata.num_actual_tokens
        out, carried = self.forward(
            buf.input_ids.device[:n], buf.positions.device[:n], hidden_in, first.metadata
        )
        b = len(which)
        if b == 0:
            return drafts
        tokens = self.greedy_tokens(out[first.last])
        buf.drafts[:b, 0].copy_(tokens)
        if self.num_speculative_tokens > 1:
            last_carried = carried[first.last] if carried is not None else None
            self._single_token_passes(b, first, tokens, last_carried)
        table = buf.drafts[:b].tolist()  # the proposer's one sync
        for i, row_drafts in zip(which.tolist(), table, strict=True):
            drafts[i] = row_drafts
        return drafts

    def target_features(self, step: VerifiedStep, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows), H]``: what a shifted proposer reads of the target at the step's
        token indices ``rows`` (default: its final hidden states)."""
        assert step.hidden_states is not None
        return step.hidden_states[rows]

    def _stage_step(self, step: VerifiedStep, order: np.ndarray, num_proposing: int) -> _FirstPass:
        """Stage every host input of the step's passes in one copy: the first pass over the
        step's requests in ``order`` (the ``num_proposing`` proposing ones first) and the
        block-table rows the single-token passes read."""
        ids, positions, query_lens, hidden_rows = self._first_pass_inputs(step, order)
        rows = step.rows[order]
        n, r, bs = len(ids), len(rows), self.block_size
        # Positions past ``max_model_len`` (none for real tokens) are clamped, writing nothing.
        past_end = positions >= self.max_model_len
        positions = np.minimum(positions, self.max_model_len - 1)
        req = np.repeat(np.arange(r), query_lens)
        slots = step.block_table[rows[req], positions // bs].astype(np.int64) * bs + positions % bs
        slots[past_end] = -1
        cu = np.zeros(r + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu[1:])
        seq_lens = (positions[cu[1:] - 1] + 1).astype(np.int32)
        last = (cu[1 : num_proposing + 1] - 1).astype(np.int64)
        first_single = positions[last] + 1  # each proposing request's second draft position
        width = first_pass_table_width(
            seq_lens, first_single, self.num_speculative_tokens - 1, bs, self.buffers.max_blocks
        )
        buf = self.buffers
        staging = buf.staging
        staging.begin()
        staging.put_into(ids, buf.input_ids.device[:n])
        staging.put_into(positions, buf.positions.device[:n])
        staging.put_into(slots, buf.slot_mapping.device[:n])
        staging.put_into(cu, buf.query_start_loc.device[: r + 1])
        staging.put_into(seq_lens, buf.seq_lens.device[:r])
        table = np.ascontiguousarray(step.block_table[rows, :width])
        staging.put_into(table, buf.block_table.device[:r, :width])
        last_t = staging.put(last)
        rows_t = staging.put(hidden_rows) if self.shifted else None
        staging.flush()
        not_one = np.flatnonzero(query_lens != 1)
        metadata = buf.buffer_metadata(
            n,
            r,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=torch.from_numpy(cu),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            num_decodes=int(not_one[0]) if len(not_one) else r,
        )
        return _FirstPass(metadata, last_t, rows_t, first_single)

    def _first_pass_inputs(
        self, step: VerifiedStep, order: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Tokens ``[T']``, positions ``[T']`` and per-request query lengths ``[R]`` of the
        first pass over the step's requests in ``order``, and (shifted) the step's token
        index whose hidden state each reads."""
        starts = step.query_start_loc[:-1].astype(np.int64)[order]
        verified = (step.num_scheduled - step.num_rejected)[order]  # the request's own tokens
        num_computed = step.num_computed[order]
        sampled = step.sampled[order]
        rows = step.rows[order]
        shift = 1 if self.shifted else 0
        # Tokens taken from the step's inputs, then one more: the new token of a request that
        # sampled (a shifted proposer's last position also reads the next prompt token).
        taken = verified - shift
        extra = np.where(sampled, 1, shift).astype(np.int64)
        query_lens = taken + extra
        total = int(query_lens.sum())
        within = np.arange(total) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
        req = np.repeat(np.arange(len(order)), query_lens)
        from_step = within < taken[req]
        ids = np.empty(total, dtype=np.int64)
        ids[from_step] = step.input_ids[(starts + shift)[req][from_step] + within[from_step]]
        # The extra token: the row's token at ``num_computed + verified`` (a new sampled
        # token, or the prompt token after this step's chunk).
        ends = np.cumsum(query_lens)[extra > 0] - 1
        ids[ends] = step.token_ids[rows[extra > 0], (num_computed + verified)[extra > 0]]
        positions = num_computed[req] + within
        hidden_rows = starts[req] + within
        return ids, positions.astype(np.int64), query_lens.astype(np.int64), hidden_rows

    def _single_token_passes(
        self,
        num_proposing: int,
        first: _FirstPass,
        tokens: torch.Tensor,
        carried: torch.Tensor | None,
    ) -> None:
        """Drafts 2..k of the ``num_proposing`` proposing requests (rows ``0..B`` of the
        buffers) into the draft table: a graph's replay where one takes the batch, else the
        same passes eagerly. ``tokens [B]`` are their first drafts, ``carried [B, H]`` the
        first pass's hidden states at them (shifted proposers)."""
        buf, b = self.buffers, num_proposing
        graphs = self.graphs if self.graphs is not None and self.graphs.can_run(b) else None
        if graphs is not None:
            size = graphs.padded_size(b)
        else:
            size = (next_size(self.pad_batches_to, b) if self.pad_batches_to else None) or b
        positions = buf.positions.device
        buf.input_ids.device[:b].copy_(tokens)
        positions[:b].copy_(positions.index_select(0, first.last) + 1)
        positions[b:size].fill_(-1)  # padding rows
        if carried is not None:
            buf.carry_buffer(carried.shape[-1], carried.dtype)[:b].copy_(carried)
        if graphs is not None:
            graphs.replay(size)
            return
        first_np = np.full(size, -1, dtype=np.int64)
        first_np[:b] = first.single_token_positions
        metadata = [
            self._single_token_metadata(first_np, j)
            for j in range(self.num_speculative_tokens - 1)
        ]
        assert buf.model is not None
        buf.model(buf.input_ids.device[:size], positions[:size], metadata)

    def _single_token_metadata(self, first: np.ndarray, step: int) -> AttentionMetadata:
        """Metadata of single-token pass ``step`` (0-based) over ``len(first)`` rows whose
        first positions are ``first`` (-1: padding), with exact host context lengths."""
        size = len(first)
        seq_lens = single_token_seq_lens(first, step, self.max_model_len)
        return self.buffers.buffer_metadata(
            size,
            size,
            max_query_len=1,
            max_seq_len=max(int(seq_lens.max()), 1),
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            num_decodes=size,
        )


@dataclass
class _FirstPass:
    """The staged first pass of a step.

    Attributes:
        metadata: its attention metadata over the proposer's buffers.
        last: ``[B]`` int64 on the device: the first pass's token index of each proposing
            request's last position.
        hidden_rows: ``[T']`` int64 on the device: the step's token whose target hidden
            state each first-pass token reads (shifted proposers), else None.
        single_token_positions: ``[B]`` int64 (host): each proposing request's position of
            its first single-token pass.
    """

    metadata: AttentionMetadata
    last: torch.Tensor
    hidden_rows: torch.Tensor | None
    single_token_positions: np.ndarray

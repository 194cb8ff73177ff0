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

EAGLE-style proposers are *shifted*: at position ``p`` they read the target's hidden state at
``p`` and the token at ``p + 1``; a plain draft model reads the token at ``p``.
"""

from __future__ import annotations

import abc

import numpy as np
import torch
from torch import nn

from tokenmill.config import EngineConfig
from tokenmill.math_utils import cdiv
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.model.attention.selector import get_attn_backend
from tokenmill.model.layers.attention import Attention, bind_kv_caches
from tokenmill.spec_decode.proposer import Proposer, VerifiedStep


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

    # ---- the passes ---------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, step: VerifiedStep) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in range(step.num_reqs)]
        ids, positions, query_lens, hidden_rows = self._first_pass_inputs(step)
        hidden_in = None
        if self.shifted:
            assert step.hidden_states is not None
            hidden_in = self.target_features(step, torch.from_numpy(hidden_rows).to(self.device))
        metadata = self._metadata(step, step.rows, positions, query_lens)
        out, carried = self.forward(
            torch.from_numpy(ids).to(self.device), metadata.positions, hidden_in, metadata.attn
        )
        which = np.flatnonzero(step.propose)
        if len(which) == 0:
            return drafts
        last = np.cumsum(query_lens)[which] - 1
        last_t = torch.from_numpy(last).to(self.device)
        tokens = [self.greedy_tokens(out[last_t])]
        position = positions[last]
        hidden = carried[last_t] if carried is not None else None
        rows = step.rows[which]
        for _ in range(self.num_speculative_tokens - 1):
            position = position + 1
            ones = np.ones(len(which), dtype=np.int64)
            metadata = self._metadata(step, rows, position, ones)
            out, carried = self.forward(tokens[-1], metadata.positions, hidden, metadata.attn)
            tokens.append(self.greedy_tokens(out))
            hidden = carried
        table = torch.stack(tokens, dim=1).tolist()  # the proposer's one sync
        for i, row_drafts in zip(which.tolist(), table, strict=True):
            drafts[i] = row_drafts
        return drafts

    def target_features(self, step: VerifiedStep, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows), H]``: what a shifted proposer reads of the target at the step's
        token indices ``rows`` (default: its final hidden states)."""
        assert step.hidden_states is not None
        return step.hidden_states[rows]

    def _first_pass_inputs(
        self, step: VerifiedStep
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Tokens ``[T']``, positions ``[T']`` and per-request query lengths ``[R]`` of the
        first pass, and (shifted) the step's token index whose hidden state each reads."""
        starts = step.query_start_loc[:-1].astype(np.int64)
        verified = step.num_scheduled - step.num_rejected  # inputs that are the request's tokens
        shift = 1 if self.shifted else 0
        # Tokens taken from the step's inputs, then one more: the new token of a request that
        # sampled (a shifted proposer's last position also reads the next prompt token).
        taken = verified - shift
        extra = np.where(step.sampled, 1, shift).astype(np.int64)
        query_lens = taken + extra
        total = int(query_lens.sum())
        within = np.arange(total) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
        req = np.repeat(np.arange(step.num_reqs), query_lens)
        from_step = within < taken[req]
        ids = np.empty(total, dtype=np.int64)
        ids[from_step] = step.input_ids[(starts + shift)[req][from_step] + within[from_step]]
        # The extra token: the row's token at ``num_computed + verified`` (a new sampled
        # token, or the prompt token after this step's chunk).
        ends = np.cumsum(query_lens)[extra > 0] - 1
        extra_rows = step.rows[extra > 0]
        extra_pos = (step.num_computed + verified)[extra > 0]
        ids[ends] = step.token_ids[extra_rows, extra_pos]
        positions = step.num_computed[req] + within
        hidden_rows = starts[req] + within
        return ids, positions.astype(np.int64), query_lens.astype(np.int64), hidden_rows

    def _metadata(
        self,
        step: VerifiedStep,
        rows: np.ndarray,
        positions: np.ndarray,
        query_lens: np.ndarray,
    ) -> _Pass:
        """Attention metadata of a pass over ``rows`` (InputBatch rows), their tokens at
        ``positions``. Positions past ``max_model_len`` (drafts that could never be used)
        are clamped and write nothing."""
        past_end = positions >= self.max_model_len
        positions = np.minimum(positions, self.max_model_len - 1)
        req = np.repeat(np.arange(len(rows)), query_lens)
        bs = self.block_size
        slots = step.block_table[rows[req], positions // bs].astype(np.int64) * bs + positions % bs
        slots[past_end] = -1
        cu = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu[1:])
        seq_lens = (positions[cu[1:] - 1] + 1).astype(np.int32)
        max_blocks = cdiv(int(seq_lens.max()), bs)
        table = np.ascontiguousarray(step.block_table[rows, :max_blocks])
        not_one = np.flatnonzero(query_lens != 1)
        num_decodes = int(not_one[0]) if len(not_one) else len(rows)
        d = self.device
        cu_t, seq_t = torch.from_numpy(cu), torch.from_numpy(seq_lens)
        attn = AttentionMetadata(
            num_actual_tokens=len(positions),
            num_reqs=len(rows),
            query_start_loc=cu_t.to(d),
            seq_lens=seq_t.to(d),
            block_table=torch.from_numpy(table).to(d),
            slot_mapping=torch.from_numpy(slots).to(d),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=cu_t,
            seq_lens_cpu=seq_t,
            num_decodes=num_decodes,
        )
        return _Pass(attn, torch.from_numpy(positions).to(d))


class _Pass:
    """A pass's attention metadata and its ``[T]`` int64 positions on the device."""

    def __init__(self, attn: AttentionMetadata, positions: torch.Tensor) -> None:
        self.attn = attn
        self.positions = positions

"""The proposer seam: what a verified step hands a proposer, and what it must return.

A proposer drafts up to ``k`` tokens for each request of a step that asks for them; the
target verifies them in the request's next step. Proposers see plain arrays and tensors (the
model runner's batch as numpy, the step's hidden states on the device); those with layers
of their own reuse the worker's input staging and CUDA-graph machinery
(``worker/proposers/``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass
class VerifiedStep:
    """One step after verification, as a proposer sees it.

    Host arrays are numpy; ``R`` is the step's request count and ``T`` its token count.

    Attributes:
        token_ids: ``[max_reqs, max_model_len]`` int32, the model runner's token table: a
            request's tokens in its row, this step's tokens appended (entries past
            ``num_tokens`` are stale).
        num_tokens: ``[max_reqs]`` int32, tokens per row.
        block_table: ``[max_reqs, max_blocks]`` int32, block ids per row.
        rows: ``[R]`` the step's requests' rows, in batch order.
        num_computed: ``[R]`` tokens with KV before the step.
        num_scheduled: ``[R]`` tokens the step computed (drafts included).
        num_rejected: ``[R]`` drafts the target rejected: the last ``num_rejected`` inputs of
            the request are not its tokens, and their KV is to be overwritten.
        sampled: ``[R]`` bool: the request got tokens this step; its last token is new (no
            KV yet), at position ``num_computed + num_scheduled - num_rejected``.
        propose: ``[R]`` bool: the request wants drafts for its next step.
        input_ids: ``[T]`` int64, the step's input tokens.
        query_start_loc: ``[R + 1]`` int32, where each request's tokens start in the step.
        hidden_states: ``[>= T, H]`` on the device: the target's hidden states at the step's
            tokens (after its final norm); None unless the proposer asks for them.
        aux_hidden_states: ``[>= T, n * H]`` on the device: the target's residual stream at
            the input of its ``aux_hidden_layers`` (EAGLE-3); None unless asked for.
    """

    token_ids: np.ndarray
    num_tokens: np.ndarray
    block_table: np.ndarray
    rows: np.ndarray
    num_computed: np.ndarray
    num_scheduled: np.ndarray
    num_rejected: np.ndarray
    sampled: np.ndarray
    propose: np.ndarray
    input_ids: np.ndarray
    query_start_loc: np.ndarray
    hidden_states: torch.Tensor | None = None
    aux_hidden_states: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.rows)


class Proposer(abc.ABC):
    """Drafts tokens for the requests of a verified step.

    The contract (``tests/spec_decode/test_proposer_contract.py`` checks every proposer):
    ``propose`` returns one list per request of the step, in batch order, of at most
    ``num_speculative_tokens`` token ids in ``[0, vocab_size)``, empty where ``propose`` is
    False; a request's drafts depend only on that request (batch-independent); a proposer
    keeps no per-request state between steps beyond KV slots of the request's own blocks,
    so finished, aborted and preempted requests need nothing from it.

    Args:
        num_speculative_tokens: k, the most drafts per request.
    """

    # The target's hidden states the proposer reads (``VerifiedStep.hidden_states``).
    needs_hidden_states = False

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    def load_model(self, target: nn.Module) -> None:  # noqa: B027 - optional hook
        """Load what the proposer runs; ``target`` is the loaded target model (EAGLE heads
        share its embedding and LM head, MTP layers are part of it)."""

    def aux_hidden_layers(self) -> tuple[int, ...]:
        """Target layers whose input residual stream the proposer reads (EAGLE-3); the
        model runner has the target keep them (``VerifiedStep.aux_hidden_states``)."""
        return ()

    def kv_cache_layers(self) -> list[tuple[int, int]]:
        """``(num_kv_heads, head_dim)`` of each attention layer the proposer runs with a KV
        cache of its own (empty: none). The model runner allocates those caches with the
        target's block count, block size and dtype, so that block ``b`` holds the target's
        and the proposer's KV of the same tokens and one block pool accounts for both."""
        return []

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:  # noqa: B027
        """Take the caches of ``kv_cache_layers`` (``[2, num_blocks, block_size, heads,
        head_dim]`` each, in that order)."""

    def plan_graphs(self, pool: tuple[int, int] | None) -> Any:
        """CUDA graphs of the proposer's passes, uncaptured (a ``worker.cuda_graph.
        PaddedGraphs``, which the model runner captures with its own, in its memory
        ``pool``), or None: the proposer runs no graphs (the default)."""
        return None

    @abc.abstractmethod
    def propose(self, step: VerifiedStep) -> list[list[int]]:
        """The drafts of each of the step's requests (see the class contract)."""

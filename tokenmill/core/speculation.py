"""The scheduler's side of speculative decoding. Torch-free.

Draft tokens are scheduled like any other: a request's ``spec_token_ids`` extend the tokens
the step computes for it (``num_tokens + len(spec_token_ids) - num_computed_tokens``, under
the same token budget), and the drafts that fit are handed to the worker. After the step,
``num_computed_tokens`` is taken back by the drafts the target rejected: their KV slots hold
values of tokens that were never generated, and the next step overwrites them (they lie past
every full block entered into the prefix cache, which holds known tokens only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.core.engine_io import SpecDecodingStats
from tokenmill.core.request import Request
from tokenmill.core.step_plan import StepPlan

if TYPE_CHECKING:
    from tokenmill.config import SpeculativeConfig


class Speculation:
    """Drafts in and out of the scheduler, and the acceptance counters.

    Args:
        num_speculative_tokens: k, the most drafts a request verifies per step.
        num_lookahead_tokens: KV slots a request needs past the tokens of a step, where the
            proposer writes its own KV (``SpeculativeConfig.num_lookahead_tokens``).
        shifted_kv: the proposer's KV at a position depends on the next token too (EAGLE
            and MTP read token ``p + 1`` at position ``p``), so the last block of a
            prefix-cache hit is recomputed rather than shared.
    """

    def __init__(
        self, num_speculative_tokens: int, num_lookahead_tokens: int = 0, shifted_kv: bool = False
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.shifted_kv = shifted_kv
        self.stats = SpecDecodingStats.new(num_speculative_tokens)

    @classmethod
    def create(cls, config: SpeculativeConfig | None) -> Speculation | None:
        """The scheduler's speculation for ``config``; None without speculative decoding."""
        if config is None:
            return None
        shifted = config.method in ("eagle", "eagle3", "mtp")
        return cls(config.num_speculative_tokens, config.num_lookahead_tokens, shifted)

    def take_scheduled(self, plan: StepPlan) -> dict[str, list[int]]:
        """The drafts each running request of ``plan`` verifies in the step (those its
        scheduled tokens reach past its known tokens); the requests' drafts are used up.

        Call before ``num_computed_tokens`` advances by the step.
        """
        scheduled: dict[str, list[int]] = {}
        for request in plan.running_reqs:
            if not request.spec_token_ids:
                continue
            num_new = plan.num_scheduled_tokens[request.request_id]
            num_drafts = request.num_computed_tokens + num_new - request.num_tokens
            if num_drafts > 0:
                scheduled[request.request_id] = request.spec_token_ids[:num_drafts]
            request.spec_token_ids = []
        return scheduled

    def on_verified(self, request: Request, num_drafts: int, num_sampled: int) -> None:
        """A step verified ``num_drafts`` drafts of ``request`` and returned ``num_sampled``
        tokens (the accepted drafts and one of the target's own): take its computed tokens
        back by the rejected drafts and count the draft."""
        num_accepted = max(0, num_sampled - 1)
        request.num_computed_tokens -= num_drafts - num_accepted
        self.stats.observe_draft(num_drafts, num_accepted)

    def set_drafts(self, request: Request, drafts: list[int], max_context_len: int) -> None:
        """Keep ``drafts`` for ``request``'s next step, cut to what it can still use: its
        ``max_tokens`` and the context length each leave room for the target's own token
        after the drafts. Requests with structured outputs never speculate (their grammar
        would have to check each draft)."""
        if not drafts or request.grammar is not None:
            request.spec_token_ids = []
            return
        room = max_context_len - request.num_tokens - 1
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        request.spec_token_ids = list(drafts[: max(0, room)])

    def make_stats(self) -> SpecDecodingStats:
        """The counters since the last call; resets them."""
        stats, self.stats = self.stats, SpecDecodingStats.new(self.num_speculative_tokens)
        return stats

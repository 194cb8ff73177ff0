"""Admission headroom: keep KV blocks free for the growth the running requests will need.

A scheduler that admits waiting requests whenever their prompt fits overcommits the KV
cache: the running requests keep growing by one token per step, and once the cache is full
the newest one is preempted and later recomputed from scratch. Under a KV-bound load (long
prompts, many requests) that recompute is pure waste: every preemption throws away a whole
prefill. Admission therefore also asks that the blocks left free after admitting cover the
*expected* growth of every running request, as SGLang's scheduler does with its "new token
ratio" (Zheng et al. 2024, "SGLang: Efficient Execution of Structured Language Model
Programs"; the idea here is the same, the estimator is ours):

    expected growth of r = uncomputed prompt tokens
                           + ratio * min(max_tokens - outputs so far, GROWTH_CAP_TOKENS)

``ratio`` is learned from finished requests: the exponential moving average of the share
of their output budget they actually used (1.0 for ``ignore_eos`` benchmarks, small for
chat requests that stop early under a large ``max_tokens``). It starts at 1.0 (no
overcommit before anything is known) and rises again after a preemption, which shows the
estimate was too low. Preemption stays the safety net: the headroom is an estimate.

Torch-free, like the rest of core/.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tokenmill.math_utils import cdiv

if TYPE_CHECKING:
    from collections.abc import Iterable

    from tokenmill.core.request import Request

# Output tokens a request is expected to add at most: an unset max_tokens means "up to the
# context length", far more than typical outputs, and must not freeze admission.
GROWTH_CAP_TOKENS = 4096
# Weight of one finished request in the moving average of budget use.
RATIO_EMA_WEIGHT = 0.05
# Bounds of the ratio, and how much one preemption raises it.
MIN_RATIO = 0.05
MAX_RATIO = 1.0
PREEMPTION_RATIO_STEP = 0.1


class AdmissionHeadroom:
    """Estimates the KV blocks the running requests will still need.

    Args:
        block_size: tokens per KV block.
        max_context_len: the most tokens a request can hold (prompt + output).
    """

    def __init__(self, block_size: int, max_context_len: int) -> None:
        self.block_size = block_size
        self.max_context_len = max_context_len
        self.ratio = MAX_RATIO

    def _output_budget(self, request: Request) -> int:
        """Output tokens the request may still produce, capped at GROWTH_CAP_TOKENS."""
        room = self.max_context_len - request.num_tokens
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens)
        return max(0, min(room, GROWTH_CAP_TOKENS))

    def growth_blocks(self, request: Request, num_allocated_ahead: int = 0) -> int:
        """Blocks ``request`` is expected to need beyond those it holds.

        Args:
            request: a running (or just admitted) request.
            num_allocated_ahead: tokens beyond ``num_computed_tokens`` that already have
                blocks (those scheduled in the step being planned).

        Rounded down: the free slots of a request's partly filled last block absorb its
        first tokens, half a block on average, which rounding down roughly accounts for.
        """
        computed = request.num_computed_tokens + num_allocated_ahead
        uncomputed = max(0, request.num_tokens - computed)
        expected = uncomputed + math.ceil(self.ratio * self._output_budget(request))
        return expected // self.block_size

    def reserved_blocks(self, running: Iterable[Request], scheduled: dict[str, int]) -> int:
        """Blocks to keep free for the expected growth of ``running``, given the tokens
        ``scheduled`` (request id -> tokens, already allocated) in the step being planned."""
        return sum(self.growth_blocks(r, scheduled.get(r.request_id, 0)) for r in running)

    def quick_bound_blocks(self, num_running: int) -> int:
        """``reserved_blocks`` for running requests that have their prompts computed, at
        the most: when this many blocks stay free, the scheduler skips the exact sum (a
        prompt still being prefilled in chunks may then be underestimated, which only
        makes admission as optimistic as without headroom)."""
        return num_running * cdiv(GROWTH_CAP_TOKENS + 1, self.block_size)

    def on_finished(self, request: Request) -> None:
        """Learn from a request that ended by itself (stop or length, not abort)."""
        budget = min(GROWTH_CAP_TOKENS, self.max_context_len - request.num_prompt_tokens)
        if request.max_tokens is not None:
            budget = min(budget, request.max_tokens)
        if budget <= 0:
            return
        used = min(1.0, request.num_output_tokens / budget)
        ratio = (1 - RATIO_EMA_WEIGHT) * self.ratio + RATIO_EMA_WEIGHT * used
        self.ratio = min(MAX_RATIO, max(MIN_RATIO, ratio))

    def on_preempted(self) -> None:
        """A preemption happened: the growth estimate was too low."""
        self.ratio = min(MAX_RATIO, self.ratio + PREEMPTION_RATIO_STEP)

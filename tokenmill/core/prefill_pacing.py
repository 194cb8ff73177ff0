"""Prefill pacing: spread a short queue's prompts over several steps while others decode.

A step that computes prompt tokens stalls every decoding request for as long as it runs (a
full 8192-token budget is ~200 ms for an 8B model on an H200, twenty decode steps), and
under a closed-loop load a burst of prompts admitted in one step finishes together and
comes back together. So while other requests decode, a step computes at most
``pacing_tokens`` of the queued prompt work, up to ``QUEUE_LIMIT_BUDGETS`` step budgets of
it; only what the queue holds beyond that (an overload) is computed at once. With no
request decoding there is no stall to bound, and the budget is used whole. This is
Sarathi-Serve's bounded stall (Agrawal et al. 2024, "Taming Throughput-Latency Tradeoff in
LLM Inference with Sarathi-Serve"); the price is more, shorter stalls for the decodes.

Two modes count the pacing tokens:

- ``step`` (servers' default): a paced step's tokens in all, its decodes first, prompt
  tokens filling the rest and at least ``PROMPT_FLOOR_FRACTION`` of the pacing tokens:
  Sarathi-Serve's token budget, at the cheap end of the products' cost staircase;
- ``prompt``: a paced step's prompt tokens beside its decodes: a lower TTFT for a higher
  TPOT.

Steps that mix a prompt chunk with decodes replay CUDA graphs, so a server on CUDA paces at
``SERVING_PACING_TOKENS`` unless told otherwise; offline runs and CPU servers do not, and
``--prefill-pacing-tokens 0`` keeps vLLM's full-budget steps. The measurements behind the
constants: benchmarks/RESULTS.md. Torch-free, like the rest of core/.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from tokenmill.core.kv_cache_manager import KVCacheManager
    from tokenmill.core.request import Request

# The default of a server on CUDA (tokens per step): a 256-token chunk costs less than half
# a 512-token one beside a step of decodes bound by reading the weights.
SERVING_PACING_TOKENS = 256
# Step budgets of queued prompt work that are paced; the excess is computed at once. With
# one, requests finishing together still overflowed it now and then, and each full-budget
# step stalled every decode for ~190 ms.
QUEUE_LIMIT_BUDGETS = 2
# Counting decodes, the fewest prompt tokens a paced step still takes, as a fraction of the
# pacing tokens, so that prompts keep moving when the decodes alone reach the pacing tokens.
PROMPT_FLOOR_FRACTION = 0.25


def is_prefilling(request: Request) -> bool:
    """True while ``request`` still has prompt tokens to compute (a new request, one
    being prefilled in chunks, or one resumed after preemption)."""
    return request.num_computed_tokens < request.num_prompt_tokens


class PrefillPacing:
    """Decides each step's allowance of prompt tokens.

    Args:
        pacing_tokens: prompt tokens per step while requests decode and the queue is short.
        budget_tokens: the step's token budget (``max_num_batched_tokens``).
        queue_limit_tokens: the queued prefill work (tokens) up to which pacing applies;
            default ``QUEUE_LIMIT_BUDGETS`` times ``budget_tokens``.
        count_decodes: if True, ``pacing_tokens`` bounds a paced step's tokens in all, its
            decodes first, and the prompt tokens fill the rest (at least
            ``PROMPT_FLOOR_FRACTION`` of ``pacing_tokens``).

    Raises:
        ValueError: a non-positive argument.
    """

    def __init__(
        self,
        pacing_tokens: int,
        budget_tokens: int,
        queue_limit_tokens: int | None = None,
        count_decodes: bool = False,
    ) -> None:
        if queue_limit_tokens is None:
            queue_limit_tokens = QUEUE_LIMIT_BUDGETS * budget_tokens
        if min(pacing_tokens, budget_tokens, queue_limit_tokens) <= 0:
            raise ValueError(
                f"pacing_tokens ({pacing_tokens}), budget_tokens ({budget_tokens}) and "
                f"queue_limit_tokens ({queue_limit_tokens}) must be positive"
            )
        self.pacing_tokens = pacing_tokens
        self.count_decodes = count_decodes
        self.prompt_floor = max(1, int(PROMPT_FLOOR_FRACTION * pacing_tokens))
        self.queue_limit_tokens = queue_limit_tokens
        # From this much queued work on, the part beyond the limit fills a step by itself.
        self.unpaced_tokens = queue_limit_tokens + budget_tokens

    def allowance(
        self, running: Iterable[Request], waiting: Iterable[Request], kv: KVCacheManager
    ) -> int | None:
        """Prompt tokens the next step may compute, or None for no limit beyond the
        token budget.

        Args:
            running: the running requests (decoding, or partway through their prompt).
            waiting: the queued requests, in the order they would be admitted.
            kv: the block tables, to discount the prompt tokens a prefix-cache hit covers.
        """
        queued = 0
        decoding = 0
        for request in running:
            if is_prefilling(request):
                queued += request.num_prompt_tokens - request.num_computed_tokens
            else:
                decoding += 1
        if not decoding:
            return None
        # Only the part of the queue beyond the limit is urgent: it is computed at once,
        # the rest at the pacing rate. Once that part alone fills a step, the sum can stop.
        if queued >= self.unpaced_tokens:
            return None
        for request in waiting:
            queued += request.num_tokens - kv.num_cached_prefix_tokens(request)
            if queued >= self.unpaced_tokens:
                return None
        paced = self.pacing_tokens
        if self.count_decodes:
            paced = max(self.pacing_tokens - decoding, self.prompt_floor)
        return max(paced, queued - self.queue_limit_tokens)

"""Prefill pacing: spread a short queue's prompts over several steps while others decode.

A step that computes prompt tokens stalls every decoding request for as long as it runs: a
full 8192-token budget is ~200 ms for an 8B model on an H200, twenty decode steps. Taking a
burst of prompts in one such step has two costs:

- every request of the burst waits for the whole step before its first token, and every
  decoding request sees one very long inter-token gap;
- under a closed-loop load the burst never breaks up: requests admitted in one step have
  their outputs produced step by step together, finish together, and their clients send
  the next requests together, so each burst comes back as large as it left.

So while other requests are decoding, the scheduler computes at most ``pacing_tokens``
prompt tokens per step of the queued prefill work up to ``QUEUE_LIMIT_BUDGETS`` step
budgets; only what the queue holds beyond that is computed at once (so a deep queue, an
overload, still gets whole steps). The first requests of a burst get their first token after a
short step, the stall per step stays bounded (the inter-token-latency bound that chunked
prefill exists for: Agrawal et al. 2024, "Taming Throughput-Latency Tradeoff in LLM
Inference with Sarathi-Serve"), and bursts spread out over the steps that follow. With no
request decoding there is no stall to bound, and the budget is used whole.

The price is the other side of the same trade: the prompt work is spread over more steps,
so decoding requests see more, shorter stalls, and their time per output token rises
(e2e latency stays about the same: at a fixed throughput a closed loop's TTFT + (n-1) x TPOT
is fixed, and a policy only moves time between the two). With Llama-3.1-8B on an H200, 64
concurrent clients and vLLM 0.24 measured in the same session (benchmarks/RESULTS.md,
fifth set), 512 tokens gave:

- a 2,000-token shared prefix + 256: median TTFT 108 ms against 345 ms unpaced (vLLM
  123 ms), TPOT 11.25 ms against 9.93 ms (vLLM 11.18 ms), 2% more throughput;
- 1,024 unshared tokens: TTFT 355 ms against 788 ms (vLLM 708 ms), TPOT 12.2 ms against
  10.6 ms (vLLM 10.7 ms), the same throughput.

Steps that mix a prompt chunk with decodes replay CUDA graphs (whole-step or piecewise), so
spreading the prompts costs no launch overhead (before those graphs, pacing cost 5-20% of
throughput).
So a server on CUDA paces at ``SERVING_PACING_TOKENS`` unless told otherwise; offline runs
(throughput, not latency) and CPU servers do not, and ``--prefill-pacing-tokens 0`` keeps
vLLM's full-budget steps.

Why 256 and not 512: a step of 64 decodes is bound by reading the weights (7.0 ms of
kernels for Llama-3.1-8B at 1,280 tokens of context); a 256-token chunk adds 3.6 ms to it,
a 512-token chunk 8.9 ms (``mixed_step_bench.py --kernels``), so small chunks are the cheaper
way to carry the same prompt tokens. Measured with 64 clients on an H200 (RESULTS.md,
seventh set), 256 against 512: 1,024 unshared tokens TTFT 430 against 368 ms, TPOT 11.62
against 12.08 ms; a 2,000-token shared prefix TTFT 65 ms and TPOT 9.45 ms at 47.6 req/s,
against 88-116 ms and 9.4-11.2 ms at 44.6 req/s. 128 tokens was worse on both loads.

Why two budgets before bursting, not one: with one, a closed loop of 64 clients still
queued more than a budget now and then (requests finishing together come back together),
and each such full-budget step stalled every decode for ~190 ms at ~23 us per prompt token,
where paced chunks cost ~18 us per token beside the decodes' weight reads. Those few steps
were a quarter of the GPU time. Measured on the engine core under 64 closed-loop clients
(Llama-3.1-8B, H200, random 1,024/256; ``serving_profile.py --sweep``, RESULTS.md ninth
set): one budget TTFT p50 480 ms, TPOT p50 11.77 ms, 18.55 req/s; two budgets 61 ms,
11.99 ms, 20.54 req/s (the same as 8 budgets). Served to vLLM's client in the same session:
TTFT p50 97 ms, TPOT p50 11.60 ms, 4,907 output tok/s (vLLM 0.24: 637 ms, 10.71 ms, 4,718).

Counting decodes (``--prefill-pacing-mode step``): the pacing tokens bound a paced step's
tokens in all, its decodes first, and prompt tokens fill the rest (at least a quarter of
the pacing tokens). This is Sarathi-Serve's token budget (Agrawal et al. 2024, above), with
the budget at the cheap end of the products' staircase: on an H200, Llama-3.1-8B's 32
layers of products take 5.58 ms at 256 tokens and 6.39 ms at 272 (RESULTS.md, eleventh
set), so 60 decodes beside a 256-token chunk (316 tokens) pay for 64 tokens past the step
where 196 would not. A closed loop then settles where the prompt work its decodes bring
(1,024 prompt tokens per 255 decode steps each, for random 1,024/256) fills what they leave
of the 256: about 51 decoding, 13 waiting. Served to vLLM's client with 64 clients, on two
machines, each beside vLLM 0.24 (RESULTS.md, twenty-first set): TTFT p50 688 and 702 ms,
TPOT p50 10.61 and 10.82 ms, against 140 and 214 ms, 11.82 and 11.90 ms counting prompt
tokens, and vLLM's 668 and 748 ms, 10.92 and 10.63 ms; output throughput 2% below
counting prompt tokens, 0.99-1.00x vLLM's. It is vLLM's operating point without its
full-budget steps (ITL p99 13.5 against 185 ms). Once the decode attention took the tile
whose single wave holds its grid (twenty-second and twenty-third sets), it gave 677 / 10.43
ms beside vLLM's 682 / 10.88 ms on one machine and 672 / 10.34 ms on another: below vLLM on
both medians, which counting prompt tokens never is on TPOT (7-12% above). So servers count
decodes by default; ``--prefill-pacing-mode prompt`` counts prompt tokens, for a 3x lower
TTFT and 2-7% more throughput at that higher TPOT.

Torch-free, like the rest of core/.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from tokenmill.core.kv_cache_manager import KVCacheManager
    from tokenmill.core.request import Request

# The default of a server on CUDA (tokens per step; measured above).
SERVING_PACING_TOKENS = 256
# Step budgets of queued prompt work that are paced; the excess is computed at once.
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

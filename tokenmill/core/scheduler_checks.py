"""The scheduler's start-up checks and its stats snapshot (see core/scheduler.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.core.engine_io import SchedulerStats
from tokenmill.core.prefill_pacing import PrefillPacing
from tokenmill.math_utils import cdiv

if TYPE_CHECKING:
    from tokenmill.config import SchedulerConfig
    from tokenmill.core.encoder_cache import EncoderCacheManager
    from tokenmill.core.kv_cache_manager import KVCacheManager
    from tokenmill.core.request import Request


def check_scheduler_config(c: SchedulerConfig) -> PrefillPacing | None:
    """Check the scheduler's limits; returns its prefill pacing (None: off).

    Raises:
        ValueError: a non-positive budget or sequence cap, chunked prefill off with a token
            budget smaller than ``max_model_len`` (a long prompt could then never be
            scheduled), or prefill pacing that is negative or asked for without chunked
            prefill.
    """
    if c.max_num_batched_tokens <= 0 or c.max_num_seqs <= 0:
        raise ValueError(
            f"max_num_batched_tokens ({c.max_num_batched_tokens}) and max_num_seqs "
            f"({c.max_num_seqs}) must be positive"
        )
    if not c.enable_chunked_prefill and c.max_num_batched_tokens < c.max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({c.max_num_batched_tokens}) is smaller than "
            f"max_model_len ({c.max_model_len}) with chunked prefill disabled, so a "
            "long prompt could never be scheduled; raise max_num_batched_tokens or "
            "enable chunked prefill"
        )
    pacing_tokens = c.prefill_pacing_tokens
    if pacing_tokens < 0 or (pacing_tokens and not c.enable_chunked_prefill):
        raise ValueError(
            f"prefill_pacing_tokens ({pacing_tokens}) must be >= 0, and 0 without chunked prefill"
        )
    pacing = (
        PrefillPacing(
            pacing_tokens,
            c.max_num_batched_tokens,
            count_decodes=c.prefill_pacing_mode == "step",
        )
        if pacing_tokens
        else None
    )
    return pacing


def take_stats(
    kv: KVCacheManager,
    encoder_cache: EncoderCacheManager,
    num_running: int,
    num_waiting: int,
    num_preemptions: int,
    num_constraint_failures: int,
) -> SchedulerStats:
    """A snapshot for metrics; the caches' counters are deltas since the last snapshot
    (reset here); the scheduler resets its own two counts."""
    prefix = kv.make_prefix_cache_stats()
    stats = SchedulerStats(
        num_running_reqs=num_running,
        num_waiting_reqs=num_waiting,
        kv_cache_usage=kv.usage,
        prefix_cache_queries=prefix.queries,
        prefix_cache_hits=prefix.hits,
        num_preemptions=num_preemptions,
        num_constraint_failures=num_constraint_failures,
        num_free_blocks=kv.num_free_blocks,
        num_total_blocks=kv.num_blocks,
        mm_cache_queries=encoder_cache.queries,
        mm_cache_hits=encoder_cache.hits,
    )
    if kv.offload is not None:
        hits = kv.offload.take_hit_tokens()
        stats.kv_offload_stats = {f"{tier}_hit_tokens": n for tier, n in hits.items()}
    encoder_cache.queries = encoder_cache.hits = 0
    return stats


def check_request_fits(
    request: Request, live: bool, max_model_len: int, block_size: int, num_blocks: int
) -> None:
    """Raise if ``request`` could never be scheduled (``live``: its id is in use).

    Raises:
        ValueError: the id is already live, the prompt is empty, longer than
            ``max_model_len``, or needs more blocks than the whole KV cache has
            (the message gives the numbers).
    """
    req_id = request.request_id
    num_prompt = request.num_prompt_tokens
    if live:
        raise ValueError(f"request id {req_id!r} is already in use")
    if num_prompt == 0:
        raise ValueError(f"request {req_id!r} has an empty prompt")
    if num_prompt > max_model_len:
        raise ValueError(
            f"request {req_id!r}: prompt of {num_prompt} tokens is longer than "
            f"max_model_len={max_model_len}"
        )
    num_prompt_blocks = cdiv(num_prompt, block_size)
    if num_prompt_blocks > num_blocks:
        raise ValueError(
            f"request {req_id!r}: prompt of {num_prompt} tokens needs {num_prompt_blocks} "
            f"KV blocks of {block_size} tokens, but the KV cache has only "
            f"{num_blocks} blocks ({num_blocks * block_size} tokens)"
        )


def check_beams_fit(request: Request, width: int, block_size: int, num_blocks: int) -> None:
    """Raise if ``width`` beams of ``request`` could never run at once: beams share the
    prompt's full blocks, but once they differ each holds at least one block of its own (the
    one its next token is written to), so they need at least ``full prompt blocks + width``
    blocks. (Fewer blocks than that would have the beams preempt one another for ever.)

    Raises:
        ValueError: the KV cache has fewer blocks (the message gives the numbers).
    """
    need = request.num_prompt_tokens // block_size + width
    if need > num_blocks:
        raise ValueError(
            f"beam search of width {width} needs at least {need} KV blocks of {block_size} "
            f"tokens (one per beam besides the prompt's shared ones), but the KV cache has "
            f"only {num_blocks}; lower the beam width or give the cache more memory"
        )

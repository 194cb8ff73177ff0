"""When a step's decode requests share a prompt prefix, and whether to read it once.

Prefix caching hands every request that starts with the same prompt prefix (a system prompt,
a few-shot preamble) the same physical KV blocks. A decode step reads each request's whole
context, so 64 requests after a shared 2,000-token prefix read its keys 64 times. Cascade
attention (Juravsky et al., "Hydragen", 2024; FlashInfer's cascade kernels) reads them once
for all those requests and merges the result with each request's own suffix by their
log-sum-exp; the attention backend does the reading (``AttentionMetadata.common_prefix_len``).

This module finds the shared prefix from the step's host block table and decides whether it
is worth it. The saving is in GPU time; the cost is on the host: one more kernel launch per
layer, and a decode-only step gives up its whole-step CUDA graph for the piecewise graphs
(the prefix kernel's grid depends on the prefix), whose eager attention launches take
milliseconds of host time for an 8B model. Few requests, or a short shared prefix, then
lose more on the host than the GPU saves (``benchmarks/device/mixed_step_bench.py``), so a
step uses it only when requests x shared tokens is large; mixed steps, already piecewise,
at a lower bar.
"""

from __future__ import annotations

import numpy as np

# A prefix read once pays off only for enough requests and keys (vLLM uses the same floor
# of 256 tokens for its cascade attention).
CASCADE_MIN_DECODES = 8
CASCADE_MIN_PREFIX_TOKENS = 256
# Shared key reads saved (requests x prefix tokens) a step needs: steps with prompt tokens
# (piecewise graphs either way), and decode-only steps, which give up their whole graph.
CASCADE_MIN_SAVED_TOKENS = 32768
CASCADE_MIN_SAVED_TOKENS_WITHOUT_GRAPH = 65536


def common_prefix_len(
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    num_decodes: int,
    block_size: int,
    replaces_graph: bool,
) -> int:
    """Tokens at the start of every decode request's context held in the same blocks, when
    reading them once is worth it; else 0.

    Args:
        block_table: ``[>= num_decodes, >= max_blocks]`` int32 host block table of the step
            (the decode requests first).
        seq_lens: ``[>= num_decodes]`` context lengths including this step's token.
        num_decodes: the leading requests that compute one token this step.
        block_size: tokens per KV block.
        replaces_graph: the step would otherwise replay a whole-step CUDA graph.

    Returns:
        A multiple of ``block_size``, below every decode request's last position (so every
        prefix key is visible to every decode token and none is written this step), at
        least ``CASCADE_MIN_PREFIX_TOKENS``; or 0.
    """
    if num_decodes < CASCADE_MIN_DECODES:
        return 0
    limit = (int(seq_lens[:num_decodes].min()) - 1) // block_size
    if limit * block_size < CASCADE_MIN_PREFIX_TOKENS:
        return 0
    table = block_table[:num_decodes, :limit]
    # Most batches with no shared prefix differ in their first block: a one-column check.
    if not (table[:, 0] == table[0, 0]).all():
        return 0
    same = (table == table[0]).all(axis=0)
    blocks = limit if same.all() else int(same.argmin())
    prefix = blocks * block_size
    if prefix < CASCADE_MIN_PREFIX_TOKENS:
        return 0
    needed = CASCADE_MIN_SAVED_TOKENS_WITHOUT_GRAPH if replaces_graph else CASCADE_MIN_SAVED_TOKENS
    return prefix if num_decodes * prefix >= needed else 0

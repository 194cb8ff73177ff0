"""N-gram prompt lookup: draft the tokens that followed an earlier occurrence of the request's
last tokens in its own prompt and output (prompt lookup decoding, Saxena 2023; vLLM's
``ngram`` method).

Rule (vLLM's): among suffix n-grams of ``prompt_lookup_min``..``prompt_lookup_max`` tokens,
the longest that occurred before (ending before the last token) wins, at its earliest
occurrence; the drafts are the up to ``k`` tokens after it (fewer when the context ends
first, none past ``max_model_len``).

Vectorised over the batch: for each candidate end position the match length grows one
suffix token at a time with a whole-batch comparison (``prompt_lookup_max`` numpy passes
over a ``[requests, context]`` table), with no per-request Python loop.
"""

from __future__ import annotations

import numpy as np

from tokenmill.spec_decode.proposer import Proposer, VerifiedStep


class NgramProposer(Proposer):
    """Prompt-lookup drafts from the request's own tokens.

    Args:
        num_speculative_tokens: k.
        prompt_lookup_min: the shortest n-gram matched.
        prompt_lookup_max: the longest n-gram matched.
        max_model_len: no draft reaches past this context length.
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        max_model_len: int,
    ) -> None:
        super().__init__(num_speculative_tokens)
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, step: VerifiedStep) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in range(step.num_reqs)]
        which = np.flatnonzero(step.propose)
        if len(which) == 0:
            return drafts
        rows = step.rows[which]
        lengths = step.num_tokens[rows].astype(np.int64)
        starts, counts = find_drafts(
            step.token_ids[rows, : int(lengths.max())], lengths, self.min_n, self.max_n,
            min(self.num_speculative_tokens, self.max_model_len),
        )  # fmt: skip
        counts = np.minimum(counts, np.maximum(0, self.max_model_len - lengths))
        k = self.num_speculative_tokens
        cols = np.minimum(starts[:, None] + np.arange(k), step.token_ids.shape[1] - 1)
        table = step.token_ids[rows[:, None], cols].tolist()  # one gather, one conversion
        for i, row_drafts, count in zip(which.tolist(), table, counts.tolist(), strict=True):
            drafts[i] = row_drafts[:count]
        return drafts


def find_drafts(
    tokens: np.ndarray, lengths: np.ndarray, min_n: int, max_n: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Where each row's drafts start, and how many there are (0: no match).

    Args:
        tokens: ``[B, L]`` token ids; row ``b``'s context is ``tokens[b, :lengths[b]]``.
        lengths: ``[B]`` context lengths (``<= L``).
        min_n, max_n: n-gram sizes (``1 <= min_n <= max_n``).
        k: the most drafts.

    Returns:
        ``([B] start, [B] count)`` int64: drafts are ``tokens[b, start : start + count]``.
    """
    batch, width = tokens.shape
    if width < 2:
        return np.zeros(batch, dtype=np.int64), np.zeros(batch, dtype=np.int64)
    tokens = tokens.astype(np.int64, copy=False)
    ends = np.arange(1, width, dtype=np.int64)  # a match ends before position ``end``
    # A match ends before the last token, so at least one token follows it.
    alive = ends[None, :] <= lengths[:, None] - 1
    match = np.zeros((batch, len(ends)), dtype=np.int64)
    row_idx = np.arange(batch)
    for j in range(max_n):
        pos = ends - 1 - j  # the match's j-th token from its end
        suffix_pos = lengths - 1 - j
        ok = (pos[None, :] >= 0) & (suffix_pos[:, None] >= 0)
        suffix = tokens[row_idx, np.maximum(suffix_pos, 0)]
        alive &= ok & (tokens[:, np.maximum(pos, 0)] == suffix[:, None])
        if not alive.any():
            break
        match += alive
    # Longest match first, then the earliest end.
    score = np.where(match >= min_n, match * (width + 1) - ends[None, :], -1)
    best = score.argmax(axis=1)
    found = score[row_idx, best] >= 0
    start = np.where(found, ends[best], 0)
    count = np.where(found, np.minimum(k, lengths - start), 0)
    return start, count

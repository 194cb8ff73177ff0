"""N-gram prompt lookup against a one-request-at-a-time reference of vLLM's rule."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.spec_decode.ngram import NgramProposer, find_drafts
from tokenmill.spec_decode.proposer import VerifiedStep


def reference(tokens: list[int], min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    """The longest suffix n-gram (min_n..max_n) seen before the last token, at its earliest
    occurrence; the up to k tokens after it."""
    total = len(tokens)
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[total - n :] if n <= total else None
        for start in range(0, total - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def _step(seqs: list[list[int]], width: int, propose: list[bool] | None = None) -> VerifiedStep:
    table = np.full((len(seqs) + 2, width), 9999, dtype=np.int32)  # stale entries past ends
    lengths = np.zeros(len(seqs) + 2, dtype=np.int32)
    rows = np.arange(len(seqs)) + 2  # rows need not start at 0
    for row, seq in zip(rows, seqs, strict=True):
        table[row, : len(seq)] = seq
        lengths[row] = len(seq)
    r = len(seqs)
    zeros = np.zeros(r, dtype=np.int64)
    return VerifiedStep(
        token_ids=table,
        num_tokens=lengths,
        block_table=np.zeros((len(table), 1), dtype=np.int32),
        rows=rows,
        num_computed=zeros,
        num_scheduled=zeros,
        num_rejected=zeros,
        sampled=np.ones(r, dtype=bool),
        propose=np.array(propose if propose is not None else [True] * r),
        input_ids=np.zeros(0, dtype=np.int64),
        query_start_loc=np.zeros(r + 1, dtype=np.int32),
    )


@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 3), (2, 3, 4), (1, 4, 5), (3, 3, 2)])
def test_matches_the_reference_on_random_contexts(min_n, max_n, k):
    rng = np.random.default_rng(min_n * 10 + max_n)
    seqs = [rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist() for _ in range(300)]
    max_model_len = 45
    proposer = NgramProposer(k, min_n, max_n, max_model_len)
    got = proposer.propose(_step(seqs, 48))
    expected = [reference(s, min_n, max_n, k, max_model_len) for s in seqs]
    assert got == expected
    # Batch-independent: each request alone gets the same drafts.
    assert [proposer.propose(_step([s], 48))[0] for s in seqs[:40]] == expected[:40]


def test_longest_match_wins_and_then_the_earliest():
    # "1 2 3" occurs at 0 and at 5; the 2-gram "2 3" also at 10: the 3-gram wins, first copy.
    seq = [1, 2, 3, 7, 8, 1, 2, 3, 9, 9, 2, 3, 5, 1, 2, 3]
    starts, counts = find_drafts(np.array([seq]), np.array([len(seq)]), 2, 3, 2)
    assert (int(starts[0]), int(counts[0])) == (3, 2)


def test_no_drafts_without_a_match_past_the_model_length_or_when_not_asked():
    proposer = NgramProposer(4, 2, 2, max_model_len=10)
    seqs = [[1, 2, 3, 4], [5, 6, 5, 6, 5, 6, 5, 6, 5, 6], [5, 6, 5, 6]]
    drafts = proposer.propose(_step(seqs, 12, propose=[True, True, False]))
    assert drafts == [[], [], []]
    assert proposer.propose(_step([[5, 6, 5, 6]], 12)) == [[5, 6]]

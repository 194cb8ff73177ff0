"""Rejection sampling keeps the target's distribution: chi-square tests over many draws of
synthetic target and draft distributions, the greedy rule, seeds and logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.rejection_sampler import greedy_verify, rejection_sample
from tokenmill.worker.sampling_metadata import (
    SamplingMetadata,
    SamplingRow,
    build_sampling_metadata,
)

V = 6
K = 2
DRAWS = 40_000


def _random_metadata(rows: int, **fields) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.ones(rows), all_greedy=False, all_random=True, **fields
    )


def _expected(logits: torch.Tensor) -> np.ndarray:
    return torch.softmax(logits.double(), dim=-1).numpy()


def _check(tokens: np.ndarray, probs: np.ndarray) -> None:
    """Chi-square goodness of fit of ``tokens`` to ``probs`` (cells of zero probability must
    stay empty)."""
    counts = np.bincount(tokens, minlength=len(probs))
    assert counts[probs == 0].sum() == 0
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    assert chisquare(counts[keep], expected).pvalue > 1e-3


def _conditionals(out) -> list[np.ndarray]:
    """The tokens at each position ``j``, among requests that accepted their first ``j``
    drafts (so that position ``j`` was verified, or drew the bonus token, in this step)."""
    tokens = out.token_ids.numpy()
    num = out.num_tokens.numpy()
    return [tokens[num > j, j] for j in range(K + 1)]


@pytest.mark.parametrize("probabilistic_drafts", [False, True])
def test_each_position_keeps_the_target_distribution(probabilistic_drafts):
    torch.manual_seed(0)
    target = torch.randn(K + 1, V) * 1.5
    # Deterministic drafts: one likely, one arbitrary token. Probabilistic ones: drawn from
    # their proposal distributions, as a sampling draft model would.
    drafts = torch.tensor([int(target[0].argmax()), 1]).repeat(DRAWS)
    draft_probs = None
    if probabilistic_drafts:
        q = torch.softmax(torch.randn(K, V), dim=-1)
        drafts = torch.multinomial(q, DRAWS, replacement=True).T.reshape(-1)
        draft_probs = q.repeat(DRAWS, 1)
    logits = target.repeat(DRAWS, 1)
    out = rejection_sample(
        logits, _random_metadata(len(logits)), drafts, [K] * DRAWS, draft_probs
    )
    assert ((out.num_tokens >= 1) & (out.num_tokens <= K + 1)).all()
    for j, tokens in enumerate(_conditionals(out)):
        assert len(tokens) > 500, f"position {j}: too few samples"
        _check(tokens, _expected(target[j]))


def test_truncation_and_temperature_are_the_samplers():
    torch.manual_seed(1)
    target = torch.randn(K + 1, V)
    drafts = torch.tensor([int(target[0].argsort()[-2]), int(target[1].argmin())])
    logits = target.repeat(DRAWS, 1)
    rows = len(logits)
    meta = _random_metadata(
        rows, top_k=torch.full((rows,), 3, dtype=torch.int64), max_top_k=3
    )
    meta.temperature = torch.full((rows,), 0.7)
    out = rejection_sample(logits, meta, drafts.repeat(DRAWS), [K] * DRAWS)
    first = out.token_ids[:, 0].numpy()
    scaled = target[0] / 0.7
    top3 = scaled.topk(3).indices
    kept = torch.full_like(scaled, float("-inf"))
    kept[top3] = scaled[top3]
    _check(first, _expected(kept))


def test_greedy_accepts_the_argmax_chain_and_stops_at_a_mismatch():
    logits = torch.tensor(
        [[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]]  # argmax 1, 0, 2
    )
    meta = SamplingMetadata(temperature=torch.ones(6), all_greedy=True, all_random=False)
    two = torch.cat([logits, logits])
    # request 0 drafts the chain (all accepted, bonus 2); request 1 misses at position 1
    out = rejection_sample(two, meta, torch.tensor([1, 0, 1, 2]), [2, 2])
    assert out.token_ids.tolist() == [[1, 0, 2], [1, 0, -1]]
    assert out.num_tokens.tolist() == [3, 2]


def test_requests_without_drafts_take_one_token():
    logits = torch.tensor([[0.0, 2.0, 1.0], [4.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    meta = SamplingMetadata(temperature=torch.ones(3), all_greedy=True, all_random=False)
    out = rejection_sample(logits, meta, torch.tensor([0], dtype=torch.int64), [0, 1])
    assert out.token_ids.tolist() == [[1, -1], [0, 2]]


def _rows(params: SamplingParams, output: list[int], drafts: list[int]) -> list[SamplingRow]:
    return [SamplingRow(params, [0], output + drafts[:j]) for j in range(len(drafts) + 1)]


def test_seeded_requests_repeat_whatever_the_batch():
    torch.manual_seed(2)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)
    target = torch.randn(3, 50)
    drafts = [int(target[0].argmax()), 7]

    def run(with_other: bool) -> list[int]:
        rows = _rows(seeded, [5], drafts)
        logits = target
        ids, counts = list(drafts), [2]
        if with_other:
            rows = _rows(other, [], [3]) + rows
            logits = torch.cat([torch.randn(2, 50), target])
            ids, counts = [3, *drafts], [1, 2]
        meta = build_sampling_metadata(rows, 50, torch.device("cpu"))
        out = rejection_sample(logits, meta, torch.tensor(ids), counts)
        row = out.token_ids[-1]
        return row[: int(out.num_tokens[-1])].tolist()

    first = run(False)
    assert all(run(True) == first for _ in range(3))


def test_logprobs_are_the_targets_raw_ones_at_each_emitted_position():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    params = SamplingParams(temperature=0, logprobs=1)
    meta = build_sampling_metadata(_rows(params, [], [1, 0]), 3, torch.device("cpu"))
    out = rejection_sample(logits, meta, torch.tensor([1, 0]), [2])
    assert out.logprobs is not None
    expected = torch.log_softmax(logits, dim=-1)
    chosen = out.logprobs.logprobs[:, 0]
    assert torch.allclose(chosen, expected[[0, 1, 2], [1, 0, 2]])
    assert out.logprobs.ranks.tolist() == [1, 1, 1]


def test_penalties_see_the_drafts_before_each_position():
    # Token 1 is the argmax everywhere, but a presence penalty over the output makes it
    # lose once it has been emitted (as a draft, at position 0).
    logits = torch.tensor([[0.0, 3.0, 2.5]] * 2)
    params = SamplingParams(temperature=0, presence_penalty=1.0)
    meta = build_sampling_metadata(_rows(params, [], [1]), 3, torch.device("cpu"))
    out = rejection_sample(logits, meta, torch.tensor([1]), [1])
    assert out.token_ids.tolist() == [[1, 2]]


def test_the_host_greedy_verdict_is_the_samplers():
    rng = np.random.default_rng(0)
    for _ in range(50):
        counts = rng.integers(0, 5, size=int(rng.integers(1, 6)))
        logits = torch.randn(int(counts.sum() + len(counts)), 4)
        drafts = torch.from_numpy(rng.integers(0, 4, size=int(counts.sum())))
        meta = SamplingMetadata(temperature=torch.ones(len(logits)), all_greedy=True,
                                all_random=False)  # fmt: skip
        out = rejection_sample(logits, meta, drafts, counts.tolist())
        expected = [row[:n] for row, n in zip(out.token_ids.tolist(), out.num_tokens.tolist(),
                                              strict=True)]  # fmt: skip
        host = greedy_verify(logits.argmax(-1).numpy(), drafts.numpy(), counts)
        assert host == expected


def test_seeded_tokens_do_not_depend_on_the_number_of_drafts():
    """A seeded request emits the same token at each position whether a step verified two
    one-hot drafts, one or none (a step's draft count follows the batch), so its output is
    that of decoding without drafts."""
    torch.manual_seed(5)
    seeded = SamplingParams(temperature=1.0, seed=77)
    target = torch.randn(3, 50)
    drafts = [int(target[0].argmax()), int(target[1].argmax())]

    def tokens(num: int) -> list[int]:
        """The tokens emitted at positions 0..num (the drafts' rows, then the bonus row)."""
        meta = build_sampling_metadata(_rows(seeded, [5], drafts[:num]), 50, torch.device("cpu"))
        ids = torch.tensor(drafts[:num], dtype=torch.int64)
        out = rejection_sample(target[: num + 1], meta, ids, [num])
        return out.token_ids[0][: int(out.num_tokens[0])].tolist()

    two = tokens(2)
    assert tokens(0) == two[:1]
    one = tokens(1)
    assert one == two[: len(one)]

"""Verification of draft tokens by rejection sampling, so that the tokens a request gets are
distributed exactly as if the target had sampled them one at a time.

Speculative sampling (Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers
via Speculative Decoding", arXiv:2211.17192; Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling", arXiv:2302.01318). For each request with drafts
``d_0..d_{k-1}`` drawn from proposal distributions ``q_j`` and the target's distributions
``p_j`` at those positions (``p_k`` after the last draft):

- draft ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``, in order, until
  the first rejection;
- at a rejected position ``j`` the token is drawn from the residual ``max(0, p_j - q_j)``
  renormalised; when every draft is accepted, a bonus token is drawn from ``p_k``.

Each emitted token is then distributed as ``p`` given the tokens before it. A proposer that
drafts deterministically (n-gram lookup, a greedy draft model or EAGLE head) has ``q_j``
one-hot at ``d_j``: acceptance with probability ``p_j(d_j)``, and the residual is ``p_j``
without ``d_j``. Greedy requests accept a draft when it is the target's argmax and otherwise
take the argmax, so their tokens are the non-speculative ones.

``p`` is the distribution the plain sampler draws from (``worker/sampler.py``): logits
processors (penalties, bias, bans, allowed tokens) over the tokens before each position,
then temperature, min-p, top-k and top-p. Random draws use the exponential race
(``argmax(p_i / E_i)``, ``E_i ~ Exp(1)``), with a request's seed (``step_seed`` of the
position) where it has one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.worker.sampler import (
    LogprobsTensors,
    Sampler,
    apply_logits_processors,
    gather_logprobs,
    wide_argmax,
)
from tokenmill.worker.sampling_metadata import SamplingMetadata


@dataclass
class RejectionOutput:
    """The verified tokens of ``R`` requests.

    Attributes:
        token_ids: ``[R, k_max + 1]`` int64: each request's accepted drafts, then its own
            token; -1 past the ``num_tokens`` of its row.
        num_tokens: ``[R]`` int64: tokens per request (accepted drafts + 1).
        logprobs: the target's raw logprobs of those tokens, one row per emitted token in
            request order (``num_tokens`` rows per request), or None when no row asked.
    """

    token_ids: torch.Tensor
    num_tokens: torch.Tensor
    logprobs: LogprobsTensors | None = None


def rejection_sample(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    draft_token_ids: torch.Tensor,
    num_drafts: list[int],
    draft_probs: torch.Tensor | None = None,
    sampler: Sampler | None = None,
) -> RejectionOutput:
    """Verify drafts against the target's logits.

    Rows of ``logits`` come request by request: request ``i`` has ``num_drafts[i] + 1``
    rows, the positions of its drafts then the one after them.

    Args:
        logits: ``[N, V]`` target logits, any float dtype; ``N = sum(num_drafts) + R``.
        metadata: the sampling parameters of those ``N`` rows (a request's row ``j`` with
            its drafts before ``j`` counted as output tokens).
        draft_token_ids: ``[sum(num_drafts)]`` int64, the drafts in request order.
        num_drafts: ``R`` draft counts (0 for a request without drafts).
        draft_probs: ``[sum(num_drafts), V]`` float32 proposal distributions; None for
            drafts proposed deterministically (one-hot).
        sampler: where truncation and the seeded generators come from (a new one if None).

    Returns:
        The tokens of each request and, when asked, their logprobs.
    """
    sampler = sampler or Sampler()
    device = logits.device
    counts = torch.tensor(num_drafts, dtype=torch.int64)
    starts = torch.cumsum(counts + 1, 0) - counts - 1  # first row of each request
    is_draft = torch.ones(logits.shape[0], dtype=torch.bool)
    is_draft[starts + counts] = False
    draft_rows = torch.nonzero(is_draft).squeeze(1).to(device)
    bonus_rows = (starts + counts).to(device)
    processed = apply_logits_processors(logits.float(), metadata)
    greedy = None if metadata.all_random else wide_argmax(processed)
    probs = None if metadata.all_greedy else _target_probs(sampler, processed, metadata)
    seeds = metadata.seeds or {}
    uniform, noise = _draws(
        sampler, logits.shape, seeds, probs is not None, draft_probs is not None, device
    )

    accepted, final = _verify(
        probs, greedy, metadata, draft_rows, bonus_rows, draft_token_ids, draft_probs,
        uniform, noise,
    )  # fmt: skip
    token_ids, num_tokens = _assemble(accepted, final, draft_token_ids, num_drafts, device)
    logprobs = None
    if metadata.max_num_logprobs is not None:
        logprobs = _emitted_logprobs(logits, token_ids, num_tokens, starts, metadata)
    return RejectionOutput(token_ids, num_tokens, logprobs)


def _target_probs(
    sampler: Sampler, processed: torch.Tensor, metadata: SamplingMetadata
) -> torch.Tensor:
    """``[N, V]`` float32: the distribution the plain sampler draws from (temperature,
    min-p, top-k, top-p over the processed logits)."""
    scaled = sampler._scaled_truncated(processed.clone(), metadata, in_place=True)
    return torch.softmax(scaled, dim=-1)


def _draws(
    sampler: Sampler,
    shape: torch.Size,
    seeds: dict[int, int],
    random: bool,
    acceptance_tests: bool,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``[N]`` uniforms in [0, 1) (the acceptance tests of drafts with proposal
    distributions; None for one-hot drafts, which take none) and ``[N, V]`` Exp(1) noise
    (the race that draws tokens). A seeded row's noise is the plain sampler's for that
    position (``Sampler._exponential_noise``); its uniform comes from a stream of its own (a
    derived seed), so that drawing it leaves the noise as it is."""
    if not random:
        return None, None
    rows, vocab = shape
    noise = sampler._exponential_noise(torch.empty(rows, vocab, device=device), seeds)
    if not acceptance_tests:
        return None, noise
    uniform = torch.rand(rows, device=device)
    if seeds:
        generator = sampler._generator(device)
        for row, seed in seeds.items():
            generator.manual_seed(seed ^ _UNIFORM_SEED_MASK)
            uniform[row : row + 1].uniform_(generator=generator)
    return uniform, noise


# Mixed into a row's seed for its acceptance uniform (any constant: a stream apart from
# the noise's).
_UNIFORM_SEED_MASK = 0x5DEECE66D


def _verify(
    probs: torch.Tensor | None,
    greedy: torch.Tensor | None,
    metadata: SamplingMetadata,
    draft_rows: torch.Tensor,
    bonus_rows: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per draft, whether it is accepted (``[D]`` bool); per row, the token emitted if the
    row is where the request's tokens end (``[N]`` int64: a residual draw at a draft row,
    a draw from ``p`` at a bonus row)."""
    draft_ids = draft_token_ids.to(draft_rows.device)
    final = torch.empty(len(draft_rows) + len(bonus_rows), dtype=torch.int64,
                        device=draft_rows.device)  # fmt: skip
    accepted = torch.zeros(len(draft_rows), dtype=torch.bool, device=draft_rows.device)
    if probs is not None and draft_probs is None:
        assert noise is not None
        # A one-hot proposal (n-gram, greedy drafter): take the token the plain sampler
        # draws at each row with that row's noise, t = argmax(p / E), and accept the draft
        # iff it is t. P(accept) = p(d), and t given t != d is distributed as the residual
        # p without d: the standard rule's distribution, and each position's token is a
        # function of its own noise, so a seeded request's output does not depend on how
        # many drafts a step verified (or on the batch that decided it).
        sample = (probs / noise).argmax(dim=-1)
        accepted = sample[draft_rows] == draft_ids
        final = sample
    elif probs is not None:
        assert uniform is not None and noise is not None
        p_draft = probs[draft_rows, draft_ids]
        q_draft = draft_probs[torch.arange(len(draft_ids), device=draft_ids.device), draft_ids]
        # u < p / q, written without the division (q > 0 for a proposed token).
        accepted = uniform[draft_rows] * q_draft < p_draft
        residual = (probs[draft_rows] - draft_probs).clamp_min_(0.0)
        # A residual of zero mass (p == q, so the draft was accepted anyway) falls back to p.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, probs[draft_rows], residual)
        final[draft_rows] = (residual / noise[draft_rows]).argmax(dim=-1)
        final[bonus_rows] = (probs[bonus_rows] / noise[bonus_rows]).argmax(dim=-1)
    if greedy is not None:
        mask = (
            metadata.greedy_mask
            if metadata.greedy_mask is not None
            else torch.ones(len(final), dtype=torch.bool, device=final.device)
        )
        accepted = torch.where(mask[draft_rows], draft_ids == greedy[draft_rows], accepted)
        final = torch.where(mask, greedy, final)
    return accepted, final


def _assemble(
    accepted: torch.Tensor,
    final: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: list[int],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, k_max + 1]`` tokens (-1 padded) and ``[R]`` counts: each request's drafts up to
    its first rejection, then the token emitted at that row."""
    num_reqs, k_max = len(num_drafts), max(num_drafts, default=0)
    counts = torch.tensor(num_drafts, dtype=torch.int64, device=device)
    col = torch.arange(k_max, device=device)
    valid = col[None, :] < counts[:, None]  # [R, k_max]
    grid = torch.zeros(num_reqs, k_max, dtype=torch.bool, device=device)
    grid[valid] = accepted
    drafts = torch.full((num_reqs, k_max), -1, dtype=torch.int64, device=device)
    drafts[valid] = draft_token_ids.to(device)
    # Leading accepted drafts: a cumulative product stops at the first rejection.
    num_accepted = torch.cumprod(grid.long(), dim=1).sum(dim=1)
    starts = torch.cumsum(counts + 1, 0) - counts - 1
    last = final[starts + num_accepted]
    token_ids = torch.full((num_reqs, k_max + 1), -1, dtype=torch.int64, device=device)
    token_ids[:, :k_max] = torch.where(col[None, :] < num_accepted[:, None], drafts, -1)
    token_ids.scatter_(1, num_accepted[:, None], last[:, None])
    return token_ids, num_accepted + 1


def _emitted_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    starts: torch.Tensor,
    metadata: SamplingMetadata,
) -> LogprobsTensors:
    """The target's raw logprobs (before any processing, as the plain sampler returns them)
    of each emitted token, at the row that emitted it."""
    assert metadata.max_num_logprobs is not None
    counts = num_tokens.cpu()
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), counts.tolist(),
                                                             strict=True)])  # fmt: skip
    keep = torch.arange(token_ids.shape[1])[None, :] < counts[:, None]
    chosen = token_ids[keep.to(token_ids.device)]
    raw = torch.log_softmax(logits[rows.to(logits.device)].float(), dim=-1)
    return gather_logprobs(raw, chosen, metadata.max_num_logprobs)


def greedy_verify(
    target_ids: np.ndarray, draft_token_ids: np.ndarray, num_drafts: np.ndarray
) -> list[list[int]]:
    """``rejection_sample`` for requests that all decode greedily with no logits processor,
    on the host: a draft is accepted while it is the target's argmax.

    Args:
        target_ids: ``[N]`` the target's argmax at each verified position (rows as for
            ``rejection_sample``).
        draft_token_ids: ``[sum(num_drafts)]`` the drafts, in request order.
        num_drafts: ``[R]`` drafts per request.

    Returns:
        Per request, its accepted drafts and then the target's own token.
    """
    counts = num_drafts.astype(np.int64)
    starts = np.cumsum(counts + 1) - counts - 1
    k_max = int(counts.max(initial=0))
    col = np.arange(k_max)
    valid = col[None, :] < counts[:, None]
    rows = np.minimum(starts[:, None] + col[None, :], len(target_ids) - 1)
    drafts = np.full((len(counts), k_max), -1, dtype=np.int64)
    drafts[valid] = draft_token_ids
    match = valid & (drafts == target_ids[rows])
    num_accepted = np.cumprod(match, axis=1).sum(axis=1) if k_max else np.zeros_like(counts)
    last = target_ids[starts + num_accepted]
    return [
        [*row[:n], int(t)]
        for row, n, t in zip(drafts.tolist(), num_accepted.tolist(), last.tolist(), strict=True)
    ]

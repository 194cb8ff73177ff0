"""Beam search: which continuations of a request's beams survive each step.

The selection follows Hugging Face transformers' ``GenerationMixin._beam_search``
(deterministic beam search, ``do_sample=False``), so that the beams and their scores equal
``generate(num_beams=k, do_sample=False, length_penalty=..., early_stopping=...)``:

1. Each live beam ``b`` with cumulative log-probability ``s_b`` offers its top
   ``num_candidates`` next tokens, scored ``s_b + log p(token)``; the best
   ``num_candidates = max(2, 1 + num_eos_tokens) * k`` over all beams are kept, so that at
   least ``k`` of them do not end in an EOS token.
2. A candidate *finishes* if its token is an EOS token or it reaches the length limit. Of
   the finished candidates, only those among the best ``k`` of step 1 become finished
   hypotheses, scored ``s / n ** length_penalty`` with ``n`` the generated tokens
   (EOS included); the best ``k`` hypotheses so far are kept.
3. The best ``k`` unfinished candidates are the next step's beams.
4. The search ends when every candidate finished (the length limit), when ``early_stopping``
   is True and ``k`` hypotheses are finished, or when no running beam can still beat the
   worst of ``k`` finished hypotheses: its score over the current length (``False``), or
   over the longest possible length when ``length_penalty > 0`` (``"never"``).

Torch-free: it reasons about token ids and log-probabilities only; the KV cache side (beams
sharing blocks, copy-on-write) is ``KVCacheManager.fork`` and ``core/beam_group.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FinishedBeam:
    """A finished hypothesis.

    Attributes:
        token_ids: its generated tokens (EOS included when it ended on one).
        cum_logprob: the sum of its tokens' log-probabilities (natural log).
        score: ``cum_logprob / len(token_ids) ** length_penalty``.
        finish_reason: "stop" (an EOS token) or "length" (the length limit).
    """

    token_ids: tuple[int, ...]
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass(frozen=True)
class NextBeam:
    """A beam of the next step: ``parent``'s tokens followed by ``token_id``.

    Attributes:
        parent: index of the beam it extends, in the list given to ``BeamSearch.step``.
        token_id: the token it appends.
        cum_logprob: its cumulative log-probability.
    """

    parent: int
    token_id: int
    cum_logprob: float


class BeamSearch:
    """The state of one request's beam search, advanced one token at a time.

    Args:
        beam_width: ``k``, the beams kept (>= 1).
        max_tokens: the most tokens a hypothesis may generate (>= 1).
        eos_token_ids: tokens that finish a hypothesis (empty: only the length limit).
        length_penalty: exponent of the length normalisation of finished scores.
        early_stopping: True, False or "never", as transformers' ``early_stopping``.

    Raises:
        ValueError: a width or length below 1, or an unknown ``early_stopping``.
    """

    def __init__(
        self,
        beam_width: int,
        max_tokens: int,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
    ) -> None:
        if beam_width < 1 or max_tokens < 1:
            raise ValueError(
                f"beam_width ({beam_width}) and max_tokens ({max_tokens}) must be >= 1"
            )
        if early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {early_stopping!r}"
            )
        self.beam_width = beam_width
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * beam_width
        # The best finished hypotheses, best first (at most beam_width).
        self.finished: list[FinishedBeam] = []
        # False once no running beam can beat the finished ones (transformers' heuristic).
        self.improvement_possible = True
        self.done = False

    def step(
        self,
        beams: list[tuple[list[int], float]],
        candidates: list[list[tuple[int, float]]],
    ) -> list[NextBeam]:
        """Advance the search by one token.

        Args:
            beams: the live beams, best first: (generated token ids, cumulative logprob);
                all have generated the same number of tokens.
            candidates: per beam, its ``num_candidates`` most likely next tokens as
                (token id, log-probability), in any order.

        Returns:
            The next step's beams, best first (empty once ``done``).

        Raises:
            ValueError: ``beams`` and ``candidates`` differ in length, or no beam is given.
        """
        if len(beams) != len(candidates) or not beams:
            raise ValueError(f"{len(beams)} beams but {len(candidates)} candidate lists")
        num_generated = len(beams[0][0]) + 1  # after this step's token
        at_limit = num_generated >= self.max_tokens
        pool = [
            (cum + lp, b, token)
            for b, ((_, cum), cands) in enumerate(zip(beams, candidates, strict=True))
            for token, lp in cands
        ]
        # Highest score first; ties by beam then token, as a flat top-k over beams x vocab.
        pool.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = pool[: self.num_candidates]
        ends = [at_limit or token in self.eos_token_ids for _, _, token in top]
        self._add_finished(beams, top[: self.beam_width], ends[: self.beam_width], num_generated)
        running = [
            NextBeam(b, token, score)
            for (score, b, token), end in zip(top, ends, strict=True)
            if not end
        ][: self.beam_width]
        self._update_done(running, num_generated, all(ends))
        return [] if self.done else running

    def _add_finished(
        self,
        beams: list[tuple[list[int], float]],
        top: list[tuple[float, int, int]],
        ends: list[bool],
        num_generated: int,
    ) -> None:
        """Step 2: the finishing candidates among the best ``k`` become hypotheses, unless
        improvement was already ruled out or (early_stopping True) ``k`` are finished."""
        if not self.improvement_possible:
            return
        if self.early_stopping is True and len(self.finished) == self.beam_width:
            return
        norm = num_generated**self.length_penalty
        for (score, b, token), end in zip(top, ends, strict=True):
            if not end:
                continue
            reason = "stop" if token in self.eos_token_ids else "length"
            tokens = (*beams[b][0], token)
            self.finished.append(FinishedBeam(tokens, score, score / norm, reason))
        # Stable: an earlier hypothesis wins a tie, as the merge of transformers' top-k keeps
        # the earlier entries first.
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.beam_width :]

    def _update_done(self, running: list[NextBeam], num_generated: int, all_end: bool) -> None:
        """Step 4 (transformers' ``_check_early_stop_heuristic`` and stopping rule)."""
        full = len(self.finished) == self.beam_width
        if full and self.improvement_possible and running:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                length = self.max_tokens
            else:
                length = num_generated
            best_possible = running[0].cum_logprob / length**self.length_penalty
            self.improvement_possible = best_possible > self.finished[-1].score
        self.done = (
            not self.improvement_possible
            or (full and self.early_stopping is True)
            or all_end
            or not running
        )

    def results(self, running: list[tuple[list[int], float]] | None = None) -> list[FinishedBeam]:
        """The best ``beam_width`` hypotheses, best first.

        Args:
            running: beams still running (a search cut short, e.g. aborted), scored as
                hypotheses ending at the length limit; None when the search is done.
        """
        hyps = list(self.finished)
        for tokens, cum in running or ():
            n = max(1, len(tokens))
            hyps.append(FinishedBeam(tuple(tokens), cum, cum / n**self.length_penalty, "length"))
        hyps.sort(key=lambda h: -h.score)
        return hyps[: self.beam_width]

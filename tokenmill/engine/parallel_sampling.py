"""Parallel sampling: ``n > 1`` and ``best_of > n`` as independent child requests.

The engine core only runs ``n == 1`` requests. A request with ``best_of`` sequences becomes
``best_of`` children with ids ``f"{index}_{request_id}"``; they share the prompt (and so its
prefix-cache blocks) and differ only in their random draws. ``ParentRequest`` gathers the
children's CompletionOutputs back into one RequestOutput per step.
"""

from __future__ import annotations

from tokenmill.outputs import CompletionOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(index: int, request_id: str) -> str:
    """The engine-side id of child ``index`` of a parallel-sampling request."""
    return f"{index}_{request_id}"


def needs_fan_out(params: SamplingParams) -> bool:
    """Whether the request runs as several child requests in the core."""
    return params.best_of is not None and params.best_of > 1


def make_child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of child ``index``.

    Each child samples one sequence (``n = best_of = 1``). A seeded request gives child i
    the seed ``seed + i``: reproducible, but the children do not all draw the same tokens.
    When ``best_of > n`` the children must report the sampled token's logprob (the ranking
    key), so ``logprobs`` is raised to at least 0. Only child 0 computes prompt logprobs:
    they depend on the prompt alone.
    """
    child = params.clone()
    child.n = 1
    child.best_of = 1
    if params.seed is not None:
        child.seed = params.seed + index
    if params.best_of is not None and params.best_of > params.n and child.logprobs is None:
        child.logprobs = 0
    if index > 0:
        child.prompt_logprobs = None
    return child


class ParentRequest:
    """Aggregates the children of one parallel-sampling request into RequestOutputs.

    Children report their CompletionOutputs with ``add_child_output`` during a step; the
    output processor then calls ``pop_outputs`` once per step, which returns what the
    user's RequestOutput carries:

    * ``best_of > n``: nothing until every child has finished, then the ``n`` children with
      the highest cumulative logprob, re-indexed ``0..n-1``; logprobs are hidden if the user
      did not ask for them (the children computed them for the ranking).
    * CUMULATIVE: all ``n`` sequences every step one of them progressed (a child that has
      not produced anything yet is an empty sequence).
    * DELTA: only the children that progressed this step.
    * FINAL_ONLY: all ``n`` once every child has finished.

    Attributes:
        request_id: the user-facing id.
        params: the user's sampling parameters.
        child_ids: engine-side ids, index order.
    """

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.best_of = params.best_of if params.best_of is not None else params.n
        self.child_ids = [child_request_id(i, request_id) for i in range(self.best_of)]
        self._latest: list[CompletionOutput | None] = [None] * self.best_of
        self._pending: dict[int, CompletionOutput] = {}
        self._finished: set[int] = set()

    @property
    def selects_best(self) -> bool:
        """True when more sequences are generated than returned (``best_of > n``)."""
        return self.best_of > self.n

    @property
    def child_output_kind(self) -> RequestOutputKind:
        """What the children's CompletionOutputs carry (best_of ranking needs whole ones)."""
        if self.selects_best:
            return RequestOutputKind.FINAL_ONLY
        return self.params.output_kind

    @property
    def finished(self) -> bool:
        return len(self._finished) == self.best_of

    def live_child_ids(self) -> list[str]:
        """Ids of the children that have not finished."""
        return [cid for i, cid in enumerate(self.child_ids) if i not in self._finished]

    def add_child_output(self, output: CompletionOutput) -> None:
        """Record a child's output of this step (``output.index`` is the child index)."""
        self._pending[output.index] = output
        self._latest[output.index] = output
        if output.finished():
            self._finished.add(output.index)

    def pop_outputs(self) -> list[CompletionOutput] | None:
        """The sequences the user's RequestOutput carries this step, or None for no output."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, {}
        kind = self.params.output_kind
        if self.selects_best:
            return self._best_outputs() if self.finished else None
        if kind == RequestOutputKind.DELTA:
            return [pending[i] for i in sorted(pending)]
        if kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        return [
            out or CompletionOutput(index=i, text="", token_ids=[])
            for i, out in enumerate(self._latest)
        ]

    def _best_outputs(self) -> list[CompletionOutput]:
        done = [out for out in self._latest if out is not None]

        def score(out: CompletionOutput) -> float:
            lp = out.cumulative_logprob
            return float("-inf") if lp is None else lp

        # NOTE: sorted() is stable, so equal scores keep child order (deterministic).
        best = sorted(done, key=score, reverse=True)[: self.n]
        user_logprobs = self.params.logprobs is not None
        for new_index, out in enumerate(best):
            out.index = new_index
            if not user_logprobs:
                out.logprobs = None
                out.cumulative_logprob = None
        return best

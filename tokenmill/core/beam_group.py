"""Beam-search requests inside the scheduler: each beam is a ``Request`` of its own.

A beam-search request starts as one request (beam 0) that computes the prompt. Every step,
each live beam samples nothing the user sees: the worker returns its most likely next
tokens with their log-probabilities, and once every beam of the request has offered them,
``BeamSearch.step`` picks the next beams. A beam with several continuations is forked: the
copies share the blocks of the common prefix by reference count and only the last,
partly filled block, in which they diverge, is copied (copy-on-write at block granularity,
Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", §4.4); the worker copies that block before the next forward pass. A beam
without a continuation is freed. The beam that keeps a parent's request gets its new token
sent to the worker (``CachedRequestData.new_token_ids``), which overwrites the token it
sampled.

Torch-free: token ids, log-probabilities and block ids only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from tokenmill.core.beam_search import BeamSearch, FinishedBeam, NextBeam
from tokenmill.core.engine_io import EngineCoreOutput, FinishReason, LogprobsLists
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.request_queue import RequestQueue

if TYPE_CHECKING:
    from tokenmill.core.step_plan import StepPlan
    from tokenmill.sampling_params import BeamSearchParams


class BeamHost(Protocol):
    """What beam search needs of the scheduler that owns it."""

    requests: dict[str, Request]
    running: list[Request]
    waiting: RequestQueue
    kv_cache_manager: KVCacheManager
    max_context_len: int

    def free_request(self, request: Request) -> None: ...


class BeamGroup:
    """One beam-search request: its live beams (best first) and its search state.

    Args:
        group_id: the request id the user knows (beam ids are ``f"{group_id}/beam{i}"``).
        search: the selection state.
        first: beam 0, the request that computes the prompt.
    """

    def __init__(self, group_id: str, search: BeamSearch, first: Request) -> None:
        self.group_id = group_id
        self.search = search
        self.beams: list[Request] = [first]
        self.cum_logprobs: dict[str, float] = {first.request_id: 0.0}
        # beam id -> its candidates of this step: (token id, logprob).
        self.candidates: dict[str, list[tuple[int, float]]] = {}
        self.num_cached_tokens = 0
        self._num_ids = 1

    @property
    def beam_width(self) -> int:
        return self.search.beam_width

    def next_beam_id(self) -> str:
        beam_id = f"{self.group_id}/beam{self._num_ids}"
        self._num_ids += 1
        return beam_id

    def record(self, beam: Request, logprobs: LogprobsLists) -> bool:
        """Store the candidates ``beam`` offers (the top tokens after its last position).

        Returns:
            True once every live beam has offered its candidates for this step.
        """
        ids, lps = logprobs.token_ids[-1], logprobs.logprobs[-1]
        # Entry 0 is the sampled token; the top-k follow (LogprobsLists' layout).
        self.candidates[beam.request_id] = list(zip(ids[1:], lps[1:], strict=True))
        return len(self.candidates) == len(self.beams)

    def advance(self) -> list[NextBeam]:
        """Run ``BeamSearch.step`` over the recorded candidates (clears them)."""
        beams = [(b.output_token_ids, self.cum_logprobs[b.request_id]) for b in self.beams]
        candidates = [self.candidates[b.request_id] for b in self.beams]
        self.candidates.clear()
        return self.search.step(beams, candidates)

    def results(self) -> list[FinishedBeam]:
        """The best hypotheses; live beams count as cut at the length limit if the search
        did not end on its own."""
        if self.search.done:
            return self.search.results()
        running = [(b.output_token_ids, self.cum_logprobs[b.request_id]) for b in self.beams]
        return self.search.results(running)


class BeamScheduling:
    """The scheduler's beam-search requests: creating them, feeding their steps' candidates
    to their searches, forking and freeing beams, and what the next step must tell the worker.

    Args:
        scheduler: the owning scheduler (its requests, queues and KV cache manager).
    """

    def __init__(self, scheduler: BeamHost) -> None:
        self.scheduler = scheduler
        self.groups: dict[str, BeamGroup] = {}
        # Running beams whose next input token was chosen here, not sampled by the worker.
        self._new_tokens: dict[str, int] = {}
        # (source, destination) block copies the worker makes before the next forward pass.
        self.block_copies: list[tuple[int, int]] = []
        # Preempted beams whose candidates are recorded: they wait for their group's step,
        # in no queue (running them again would only recompute the same candidates).
        self.parked: dict[str, Request] = {}

    # ---- requests ------------------------------------------------------------------------

    def add(self, group_id: str, first: Request, params: BeamSearchParams) -> None:
        """Register a beam-search request whose beam 0 is ``first`` (not yet queued)."""
        max_tokens = min(
            params.max_tokens, self.scheduler.max_context_len - first.num_prompt_tokens
        )
        eos = () if params.ignore_eos else tuple(first.sampling_params.eos_token_ids)
        search = BeamSearch(
            params.beam_width, max_tokens, eos, params.length_penalty, params.early_stopping
        )
        first.beam_group = BeamGroup(group_id, search, first)
        self.groups[group_id] = first.beam_group

    def expand_ids(self, request_ids: Iterable[str]) -> list[str]:
        """Request ids with each beam-search request's id replaced by its live beams' ids
        (the group is forgotten: it is being aborted)."""
        expanded: list[str] = []
        for req_id in request_ids:
            group = self.groups.pop(req_id, None)
            if group is None:
                expanded.append(req_id)
                continue
            for beam in group.beams:
                self._new_tokens.pop(beam.request_id, None)
                self.parked.pop(beam.request_id, None)
                expanded.append(beam.request_id)
        return expanded

    def num_seqs_needed(self, request: Request) -> int:
        """Sequences admitting ``request`` adds to the running ones and their reservations:
        a whole beam width for a beam-search request none of whose beams runs yet."""
        group = request.beam_group
        if group is None:
            return 1
        return 0 if self._is_running(group) else group.beam_width

    def num_reserved_seqs(self) -> int:
        """Sequences the running beam-search requests may still fork into."""
        return sum(
            g.beam_width - sum(b.status == RequestStatus.RUNNING for b in g.beams)
            for g in self.groups.values()
            if self._is_running(g)
        )

    @staticmethod
    def _is_running(group: BeamGroup) -> bool:
        return any(b.status == RequestStatus.RUNNING for b in group.beams)

    # ---- the step ------------------------------------------------------------------------

    def on_step(
        self, beam: Request, step_tokens: list[int], logprobs: LogprobsLists | None
    ) -> EngineCoreOutput | None:
        """Take one beam's step result; advance its search once every beam has one.

        Returns:
            The request's output when its search has ended, else None.
        """
        group = beam.beam_group
        if not step_tokens or logprobs is None or group.group_id not in self.groups:
            return None  # mid-prefill: nothing sampled yet
        if beam.num_cached_tokens > 0 and not group.num_cached_tokens:
            group.num_cached_tokens = beam.num_cached_tokens
        if not group.record(beam, logprobs):
            return None
        next_beams = group.advance()
        if group.search.done:
            return self._finish(group)
        self._apply(group, next_beams)
        return None

    def _apply(self, group: BeamGroup, next_beams: list[NextBeam]) -> None:
        """Make ``next_beams`` the group's beams: free the parents without a continuation,
        fork the others for all but their best continuation, then extend each with that
        one (forks first: a fork copies its parent's tokens)."""
        parents = group.beams
        first: dict[int, int] = {}  # parent -> index of its best continuation
        for i, nb in enumerate(next_beams):
            first.setdefault(nb.parent, i)
        for p, parent in enumerate(parents):
            if p not in first:
                self._drop(group, parent)
        beams: list[Request | None] = [None] * len(next_beams)
        for i, nb in enumerate(next_beams):
            if first[nb.parent] != i:
                beams[i] = self._fork(group, parents[nb.parent], nb)
        for p, i in first.items():
            self._extend(group, parents[p], next_beams[i])
            beams[i] = parents[p]
        group.beams = [b for b in beams if b is not None]

    def _extend(self, group: BeamGroup, beam: Request, nb: NextBeam) -> None:
        beam.append_output_token_ids([nb.token_id])
        group.cum_logprobs[beam.request_id] = nb.cum_logprob
        if beam.status == RequestStatus.RUNNING:
            self._new_tokens[beam.request_id] = nb.token_id
        elif self.parked.pop(beam.request_id, None) is not None:
            self.scheduler.waiting.prepend_request(beam)

    def _fork(self, group: BeamGroup, parent: Request, nb: NextBeam) -> Request:
        """A new beam: ``parent``'s tokens plus ``nb.token_id``, sharing its KV blocks."""
        s = self.scheduler
        child = parent.fork(group.next_beam_id())
        child.append_output_token_ids([nb.token_id])
        group.cum_logprobs[child.request_id] = nb.cum_logprob
        s.requests[child.request_id] = child
        copies = None
        if parent.status == RequestStatus.RUNNING:
            copies = s.kv_cache_manager.fork(parent, child)
        if copies is None:
            # The parent holds no blocks (preempted), or no block is free for the copy of
            # the block the two diverge in: the new beam recomputes, hitting the prefix
            # cache for the shared full blocks.
            child.status = RequestStatus.PREEMPTED
            child.num_computed_tokens = 0
            s.waiting.prepend_request(child)
        else:
            self.block_copies.extend(copies)
            child.status = RequestStatus.RUNNING
            child.unseen_by_worker = True
            s.running.append(child)
        return child

    def _drop(self, group: BeamGroup, beam: Request) -> None:
        """Free a beam that has no continuation."""
        s = self.scheduler
        self._new_tokens.pop(beam.request_id, None)
        group.cum_logprobs.pop(beam.request_id, None)
        if beam.status == RequestStatus.RUNNING:
            s.running.remove(beam)
        elif self.parked.pop(beam.request_id, None) is None:
            s.waiting.remove_requests([beam])
        beam.status = RequestStatus.FINISHED_ABORTED
        s.free_request(beam)

    def _finish(self, group: BeamGroup) -> EngineCoreOutput:
        """End the request: free its beams; its output carries the best hypotheses."""
        results = group.results()
        for beam in list(group.beams):
            self._drop(group, beam)
        del self.groups[group.group_id]
        stopped = bool(results) and results[0].finish_reason == "stop"
        reason = FinishReason.STOP if stopped else FinishReason.LENGTH
        return EngineCoreOutput(
            request_id=group.group_id,
            new_token_ids=[],
            finish_reason=reason,
            num_cached_tokens=group.num_cached_tokens,
            beams=results,
        )

    # ---- what the next step tells the worker ----------------------------------------------

    def take_new_tokens(self, plan: StepPlan) -> dict[str, list[int]]:
        """The chosen tokens of the beams the worker holds that run in ``plan``; a beam the
        worker gets in full (new, or resumed after preemption) needs none."""
        if not self._new_tokens:
            return {}
        for request in plan.new_reqs:
            self._new_tokens.pop(request.request_id, None)
        return {
            r.request_id: [self._new_tokens.pop(r.request_id)]
            for r in plan.running_reqs
            if r.request_id in self._new_tokens
        }

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self.block_copies = self.block_copies, []
        return copies

    def on_preempted(self, request: Request) -> bool:
        """Note a preemption (a beam is sent to the worker in full when it runs again).

        Returns:
            True if the request is a beam whose candidates are recorded: it is parked until
            its group's step instead of being queued again.
        """
        self._new_tokens.pop(request.request_id, None)
        request.unseen_by_worker = False
        group = request.beam_group
        if group is None or request.request_id not in group.candidates:
            return False
        self.parked[request.request_id] = request
        return True

    def idle_beams(self) -> list[Request]:
        """Running beams that wait for their siblings' candidates (they hold blocks but
        have nothing to compute); preempting them breaks a step where nothing could run."""
        return [
            r
            for g in self.groups.values()
            for r in g.beams
            if r.status == RequestStatus.RUNNING and r.request_id in g.candidates
        ]

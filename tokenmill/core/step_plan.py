"""The plan of one scheduling step: which requests run, with how many tokens each, and the
budgets still left (tokens, prompt tokens under prefill pacing) as ``Scheduler.schedule``
fills it in. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.encoder_cache import EncoderStep
from tokenmill.core.prefill_pacing import is_prefilling
from tokenmill.core.request import Request


@dataclass
class StepPlan:
    """What one ``schedule()`` call has decided so far."""

    token_budget: int
    # Prompt tokens this step may still compute, a limit on top of the token budget
    # (None: no such limit); see tokenmill.core.prefill_pacing.
    prefill_budget: int | None = None
    # request id -> tokens this step; insertion order is the batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Running requests scheduled again, with the block ids they gained this step.
    running_reqs: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests the worker has not seen (first time, or resumed after preemption).
    new_reqs: list[Request] = field(default_factory=list)
    preempted_ids: set[str] = field(default_factory=set)
    # The images this step encodes and reads (core/encoder_cache.py).
    encoder: EncoderStep = field(default_factory=lambda: EncoderStep(0))

    def add_running(self, request: Request, num_tokens: int, new_block_ids: list[int]) -> None:
        self.running_reqs.append(request)
        self.new_block_ids[request.request_id] = new_block_ids
        self._add(request, num_tokens)

    def add_new(self, request: Request, num_tokens: int) -> None:
        self.new_reqs.append(request)
        self._add(request, num_tokens)

    def budget_for(self, request: Request) -> int:
        """Tokens ``request`` may get this step: prompt tokens also count against the
        prefill allowance."""
        if self.prefill_budget is not None and is_prefilling(request):
            return min(self.token_budget, self.prefill_budget)
        return self.token_budget

    def unschedule(self, request: Request) -> None:
        """Undo a running request's part of this step (it is being preempted)."""
        num_tokens = self.num_scheduled_tokens.pop(request.request_id)
        self.token_budget += num_tokens
        if self.prefill_budget is not None and is_prefilling(request):
            self.prefill_budget += num_tokens
        if request in self.new_reqs:  # a beam forked while running, first sent this step
            self.new_reqs.remove(request)
            return
        self.running_reqs.remove(request)
        del self.new_block_ids[request.request_id]

    def _add(self, request: Request, num_tokens: int) -> None:
        assert num_tokens > 0 and request.request_id not in self.num_scheduled_tokens
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens
        if self.prefill_budget is not None and is_prefilling(request):
            self.prefill_budget -= num_tokens

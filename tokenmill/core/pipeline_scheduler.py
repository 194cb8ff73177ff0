"""The scheduler under pipeline parallelism: several micro-batches in flight at once.

With ``P`` stages the engine keeps up to ``P`` steps in flight, so that each stage works on
one while the next stage works on the one before (GPipe's micro-batches, Huang et al. 2019,
arXiv:1811.06965, as vLLM's batch queue runs them). Steps stay disjoint without any rule of
their own: a request whose step in flight samples its next token has nothing left to
compute until that token is back. A request still prefilling may have its next prompt chunk
in the following micro-batch: each stage runs micro-batches in order, so the chunk before
has written its KV on that stage first.

Two rules are added:

- a step takes at most ``ceil(ready / free slots)`` requests, where ``ready`` counts the
  running requests with tokens to compute and the waiting ones that may be admitted, and
  the free slots are the stages without a micro-batch: the requests spread over the
  micro-batches instead of all landing in the first one;
- a preempted request whose last step is still in flight is not admitted again before that
  step returns, so its stale token cannot be taken for a new one.

Each step also carries the running requests' new tokens (``SchedulerOutput.new_token_ids``)
for the stages that do not sample. Torch-free.
"""

from __future__ import annotations

from tokenmill.core.engine_io import EngineCoreOutputs
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.core.step_plan import StepPlan
from tokenmill.math_utils import cdiv


class PipelineScheduler(Scheduler):
    """A Scheduler whose steps are micro-batches of a pipeline (see the module docstring).

    Same arguments as ``Scheduler``; ``schedule(num_free_slots)`` plans the next
    micro-batch.
    """

    def _init_queues(self) -> None:
        super()._init_queues()
        # request id -> steps in flight that schedule it
        self.in_flight: dict[str, int] = {}
        self._max_reqs = 0  # of the step being planned

    def schedule(self, num_free_slots: int = 1) -> SchedulerOutput:  # type: ignore[override]
        """Plan one micro-batch while ``P - num_free_slots`` others are in flight.

        Returns:
            The step's SchedulerOutput (possibly empty: nothing is ready).
        """
        ready = sum(1 for r in self.running if r.num_computed_tokens < r.num_tokens)
        ready += min(len(self.waiting), max(0, self.max_num_seqs - len(self.running)))
        self._max_reqs = max(1, cdiv(ready, max(1, num_free_slots)))
        return super().schedule()

    def _step_is_full(self, plan: StepPlan) -> bool:
        return len(plan.num_scheduled_tokens) >= self._max_reqs

    def _may_admit(self, request: Request) -> bool:
        return request.request_id not in self.in_flight

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        computed_before = {r.request_id: r.num_computed_tokens for r in plan.running_reqs}
        output = super()._make_output(plan)
        for req_id in output.num_scheduled_tokens:
            self.in_flight[req_id] = self.in_flight.get(req_id, 0) + 1
        for request in plan.running_reqs:
            req_id = request.request_id
            start = max(computed_before[req_id], request.num_prompt_tokens)
            end = computed_before[req_id] + output.num_scheduled_tokens[req_id]
            if end > start:
                output.new_token_ids[req_id] = request.all_token_ids[start:end]
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        for req_id in scheduler_output.num_scheduled_tokens:
            left = self.in_flight.pop(req_id, 1) - 1
            if left:
                self.in_flight[req_id] = left
        return super().update_from_output(scheduler_output, model_runner_output)

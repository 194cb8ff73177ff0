"""Scheduler: the iteration-level (continuous-batching) scheduler of the engine core.

One rule, no phases: each step hands out ``{request_id: num_tokens}`` so that every
request's ``num_computed_tokens`` catches up with its ``num_tokens`` (prompt + output),
within one token budget (``max_num_batched_tokens``) and a cap on running requests
(``max_num_seqs``). A prompt longer than the budget is computed in chunks (chunked
prefill), prefix-cache hits simply start a request with some tokens computed, and a
request preempted by recompute starts over at zero. Iteration-level scheduling is Orca's
(Yu et al. 2022, "Orca: A Distributed Serving System for Transformer-Based Generative
Models"); the token-budget form is vLLM V1's.

Torch-free: it reasons about token counts and block ids only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokenmill.core.admission import AdmissionHeadroom
from tokenmill.core.beam_group import BeamScheduling
from tokenmill.core.encoder_cache import EncoderCacheManager
from tokenmill.core.engine_io import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_offload import KVOffloadManager
from tokenmill.core.lora_slots import LoRASlots, count_adapters
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.request_queue import create_request_queue
from tokenmill.core.scheduler_checks import (
    check_beams_fit,
    check_request_fits,
    check_scheduler_config,
    take_stats,
)
from tokenmill.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.core.speculation import Speculation
from tokenmill.core.step_outputs import request_step_output
from tokenmill.core.step_plan import StepPlan
from tokenmill.math_utils import cdiv

if TYPE_CHECKING:
    # Annotations only: core/ stays importable without the model-side packages.
    from tokenmill.config import CacheConfig, SchedulerConfig, SpeculativeConfig
    from tokenmill.sampling_params import BeamSearchParams

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes.

    Args:
        scheduler_config: token budget, sequence cap, chunked prefill, policy.
        cache_config: block size and prefix caching.
        num_blocks: KV blocks available (as sized by the worker).
        log_stats: count prefix-cache hits and attach ``SchedulerStats`` to each output.
        offload_slots: blocks of the host and disk offload tiers ((0, 0): none).
        speculative_config: speculative decoding (``core/speculation.py``), or None.
        max_loras: LoRA adapter slots: the most distinct adapters among the running
            requests (0: LoRA off).

    Attributes:
        requests: every live (waiting or running) request, by id.
        waiting: requests to admit, in policy order (preempted ones included).
        running: admitted requests, in admission order (the batch order).
        kv_cache_manager: the block tables (the engine reads usage, tests integrity).
        max_context_len: the most tokens a request may reach: ``max_model_len``, or the
            whole KV cache if that is smaller.

    Raises:
        ValueError: a non-positive budget or sequence cap, an unknown policy, chunked
            prefill off with a token budget smaller than ``max_model_len`` (a long
            prompt could then never be scheduled), or prefill pacing that is negative or
            asked for without chunked prefill.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        log_stats: bool = True,
        offload_slots: tuple[int, int] = (0, 0),
        speculative_config: SpeculativeConfig | None = None,
        max_loras: int = 0,
    ) -> None:
        self.max_loras = max_loras
        self._init_config(scheduler_config, cache_config, log_stats)
        self._init_queues()
        self.speculation = Speculation.create(speculative_config)
        self.num_lookahead_tokens = self.speculation.num_lookahead_tokens if self.speculation else 0
        self._init_kv_cache(cache_config, num_blocks, offload_slots)

    def _init_config(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, log_stats: bool
    ) -> None:
        self.scheduler_config = scheduler_config
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.policy = scheduler_config.scheduling_policy
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.async_scheduling = scheduler_config.async_scheduling
        self.pacing = check_scheduler_config(scheduler_config)
        self.block_size = cache_config.block_size
        self.log_stats = log_stats

    def _init_queues(self) -> None:
        # Every live (waiting or running) request, by id.
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        # In admission order: fcfs preempts from the tail.
        self.running: list[Request] = []
        # Finished, aborted: sent in the next SchedulerOutput so the worker drops them.
        self.finished_req_ids: set[str] = set()
        # request id -> first-schedule time not yet reported in an EngineCoreOutputs.
        self._first_scheduled: dict[str, float] = {}
        self._num_preemptions = 0
        self._num_constraint_failures = 0
        self.beams = BeamScheduling(self)

    def _init_kv_cache(
        self, cache_config: CacheConfig, num_blocks: int, offload_slots: tuple[int, int]
    ) -> None:
        self.num_blocks = num_blocks
        # NOTE: a request can never hold more tokens than the whole cache. Capping it there
        # (finish reason "length") keeps a lone request that outgrows the cache from being
        # preempted and re-queued forever. The engine normally sizes the cache to hold at
        # least one max_model_len request, so this cap is then max_model_len.
        self.max_context_len = min(self.max_model_len, num_blocks * self.block_size)
        if self.max_context_len < self.max_model_len:
            logger.warning(
                "The KV cache holds %d tokens (%d blocks of %d), fewer than max_model_len=%d: "
                "requests end at %d tokens.",
                self.max_context_len,
                num_blocks,
                self.block_size,
                self.max_model_len,
                self.max_context_len,
            )
        self.headroom = (
            AdmissionHeadroom(self.block_size, self.max_context_len)
            if self.scheduler_config.admission_headroom
            else None
        )
        # Images: encoder outputs of up to one step's token budget are cached, and a step
        # encodes up to that many placeholder tokens.
        budget = self.max_num_batched_tokens
        self.encoder_cache = EncoderCacheManager(
            capacity=budget, encoder_budget=budget,
            whole_images=self.scheduler_config.disable_chunked_mm_input,
        )  # fmt: skip
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=cache_config.block_size,
            max_model_len=self.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            log_stats=self.log_stats,
            offload=KVOffloadManager(*offload_slots) if offload_slots[0] else None,
            drop_last_hit_block=self.speculation is not None and self.speculation.shifted_kv,
        )

    # ----------------------------------------------------------------- requests in/out

    def add_request(self, request: Request, beam_search: BeamSearchParams | None = None) -> None:
        """Queue a request to be scheduled.

        Args:
            request: the request.
            beam_search: makes it a beam-search request: the request becomes its beam 0
                (id ``f"{request_id}/beam0"``); see ``core/beam_group.py``.

        Raises:
            ValueError: as ``check_request``; beams that cannot fit the KV cache
                (``check_beams_fit``).
        """
        self.check_request(request)
        if beam_search is not None:
            check_beams_fit(request, beam_search.beam_width, self.block_size, self.num_blocks)
            group_id = request.request_id
            request.request_id = f"{group_id}/beam0"
            self.beams.add(group_id, request, beam_search)
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def check_request(self, request: Request) -> None:
        """Raise if ``request`` could never be scheduled.

        Raises:
            ValueError: the id is already live, the prompt is empty, longer than
                ``max_model_len``, or needs more blocks than the whole KV cache has
                (the message gives the numbers).
        """
        req_id = request.request_id
        live = req_id in self.requests or req_id in self.beams.groups
        check_request_fits(request, live, self.max_model_len, self.block_size, self.num_blocks)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """End requests from outside the scheduler (aborts, stop strings).

        Their blocks are freed at once and their ids go into the next SchedulerOutput's
        ``finished_req_ids``. Unknown (or already finished) ids are ignored.

        Raises:
            ValueError: ``finished_status`` is not a finished status.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        request_ids = self.beams.expand_ids(request_ids)
        running_ids: set[str] = set()
        waiting: list[Request] = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                running_ids.add(req_id)
            else:
                waiting.append(request)
            request.status = finished_status
            self.free_request(request)
        if running_ids:
            self.running = [r for r in self.running if r.request_id not in running_ids]
        if waiting:
            self.waiting.remove_requests(waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.beams.parked)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """True if finished ids are waiting to be sent to the worker."""
        return bool(self.finished_req_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; only possible (True) when no block is in use."""
        return self.kv_cache_manager.reset_prefix_cache()

    def preempt_all(self) -> None:
        """Preempt every running request, keeping their order (the engine is about to lose
        its KV cache: sleep, new weights); they are computed again when they next run."""
        plan = StepPlan(token_budget=0)
        for request in reversed(self.running):
            self._preempt(request, plan)
        self.finished_req_ids |= plan.preempted_ids
        self.beams.block_copies.clear()

    # ---------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first (in order), then waiting ones.

        Running requests that cannot get blocks preempt others (recompute). Waiting
        requests are admitted only in a step without preemption. With prefill pacing, a
        short queue's prompt tokens are also limited per step (core/prefill_pacing.py).
        After the plan is built, each scheduled request's ``num_computed_tokens`` is
        advanced by its tokens.

        Returns:
            The step's SchedulerOutput (possibly empty, carrying only finished ids).
        """
        self.kv_cache_manager.begin_step()
        plan = StepPlan(
            encoder=self.encoder_cache.begin_step(),
            token_budget=self.max_num_batched_tokens,
            prefill_budget=(
                None
                if self.pacing is None
                else self.pacing.allowance(self.running, self.waiting, self.kv_cache_manager)
            ),
        )
        self._schedule_running(plan)
        if not plan.preempted_ids:
            self._schedule_waiting(plan)
        if not plan.num_scheduled_tokens and self.waiting and self.beams.groups:
            # Beams waiting for their siblings hold the blocks the siblings need.
            for beam in self.beams.idle_beams():
                self._preempt(beam, plan)
            self._schedule_waiting(plan)
        return self._make_output(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        for request in list(self.running):
            if plan.token_budget <= 0 or self._step_is_full(plan):
                break
            if request.request_id in plan.preempted_ids:
                continue
            if request.num_output_placeholders and self._has_all_tokens_pending(request):
                continue
            num_computed = request.num_computed_tokens
            num_new = self._num_tokens_to_schedule(
                request, num_computed, plan.budget_for(request)
            )
            encoder = self.encoder_cache
            num_new, to_encode = encoder.clip(
                request, num_computed, num_new, plan.encoder, plan.token_budget
            )
            if num_new == 0:
                continue
            new_block_ids = self._allocate_or_preempt(request, num_new, plan)
            if new_block_ids is None:
                continue
            if request.unseen_by_worker:  # a beam forked since the last step
                request.unseen_by_worker = False
                plan.add_new(request, num_new)
            else:
                plan.add_running(request, num_new, new_block_ids)
            encoder.commit(request, num_computed, num_new, to_encode, plan.encoder)

    def _has_all_tokens_pending(self, request: Request) -> bool:
        """Async scheduling: the steps in flight already produce the request's last token
        (max_tokens or the context length), so scheduling it again would be wasted work."""
        num_tokens = request.num_tokens + request.num_output_placeholders
        if request.max_tokens is not None:
            if request.num_output_tokens + request.num_output_placeholders >= request.max_tokens:
                return True
        return num_tokens >= self.max_context_len

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, plan: StepPlan
    ) -> list[int] | None:
        """Allocate blocks for a running request, preempting others until it fits.

        Returns:
            The new block ids, or None if ``request`` itself had to be preempted.
        """
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens
            )
            if new_block_ids is not None:
                return new_block_ids
            victim = self._select_victim()
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _select_victim(self) -> Request:
        """fcfs: the most recently admitted running request. priority: the running request
        with the largest ``(priority, arrival_time)`` (the most recently admitted on ties).
        """
        if self.policy == "priority":
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Preempt by recompute: drop all of the request's KV and queue it again."""
        self.running.remove(request)
        if request.request_id in plan.num_scheduled_tokens:
            plan.unschedule(request)
            self.encoder_cache.uncommit(request, plan.encoder)
        # free() reads num_computed_tokens: reset it only afterwards.
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        # A token still being sampled for it is discarded (update_from_output skips
        # requests that are not running); recompute produces it again.
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        if self.headroom is not None:
            self.headroom.on_preempted()
        if not self.beams.on_preempted(request):
            self.waiting.prepend_request(request)
        plan.preempted_ids.add(request.request_id)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        kv = self.kv_cache_manager
        reserved: int | None = None  # headroom for the running requests, once computed
        lora_slots = LoRASlots(self.running, self.max_loras) if self.max_loras else None
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek_request()
            if self._step_is_full(plan) or not self._may_admit(request):
                break
            if self.beams.groups and (
                len(self.running) + self.beams.num_reserved_seqs()
                + self.beams.num_seqs_needed(request) > self.max_num_seqs
            ):  # fmt: skip
                break  # the running beam searches may still fork into the free slots
            if lora_slots is not None and not lora_slots.admits(request):
                lora_slots.skip(self.waiting.pop_request())
                continue
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            budget = plan.budget_for(request)
            num_new = self._num_tokens_to_schedule(request, num_hit_tokens, budget)
            encoder = self.encoder_cache
            num_new, to_encode = encoder.clip(
                request, num_hit_tokens, num_new, plan.encoder, plan.token_budget
            )
            if num_new == 0:
                # The prompt does not fit (chunked prefill off), or the step's prefill
                # allowance is spent: it waits.
                break
            if self.headroom is not None and self.running:
                need = cdiv(num_hit_tokens + num_new, self.block_size) - len(hit_blocks)
                free_after = kv.num_free_blocks - need
                if free_after < self.headroom.quick_bound_blocks(len(self.running)):
                    if reserved is None:
                        reserved = self.headroom.reserved_blocks(
                            self.running, plan.num_scheduled_tokens
                        )
                    if free_after < reserved:
                        break  # admitting it would likely force a preemption later
            lookahead = self.num_lookahead_tokens
            if kv.allocate_slots(request, num_new, num_hit_tokens, hit_blocks, lookahead) is None:
                break
            self.waiting.pop_request()
            self._admit(request, num_hit_tokens)
            plan.add_new(request, num_new)
            encoder.commit(request, num_hit_tokens, num_new, to_encode, plan.encoder)
            if lora_slots is not None:
                lora_slots.take(request)
            if reserved is not None:
                assert self.headroom is not None
                reserved += self.headroom.growth_blocks(request, num_new)
        if lora_slots is not None:
            for request in reversed(lora_slots.skipped):
                self.waiting.prepend_request(request)

    def _step_is_full(self, plan: StepPlan) -> bool:
        """Whether the step takes no more requests (beyond the token budget and
        ``max_num_seqs``); a hook for pipeline micro-batches."""
        return False

    def _may_admit(self, request: Request) -> bool:
        """Whether a waiting request may be admitted now; a hook for pipeline micro-batches
        (a preempted request whose last step is still in flight waits for it)."""
        return True

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
            group = request.beam_group
            output_id = request.request_id if group is None else group.group_id
            self._first_scheduled[output_id] = request.first_scheduled_time

    def _num_tokens_to_schedule(self, request: Request, num_computed: int, budget: int) -> int:
        """Tokens to compute for ``request`` this step, from ``num_computed`` on (0: none).

        Under async scheduling a token still being sampled counts as known: the worker takes
        it from the device when the step runs. Draft tokens (``spec_token_ids``) count as
        tokens to compute.
        """
        num_new = request.num_tokens + request.num_output_placeholders - num_computed
        num_new += len(request.spec_token_ids)
        if self.enable_chunked_prefill:
            if self.long_prefill_token_threshold > 0:
                num_new = min(num_new, self.long_prefill_token_threshold)
            num_new = min(num_new, budget)
        elif num_new > budget:
            return 0
        return max(0, min(num_new, self.max_model_len - num_computed))

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        kv = self.kv_cache_manager
        new_reqs = [
            NewRequestData.of(r, kv.get_block_ids(r.request_id)) for r in plan.new_reqs
        ]
        cached_reqs = CachedRequestData(
            req_ids=[r.request_id for r in plan.running_reqs],
            new_block_ids=[plan.new_block_ids[r.request_id] for r in plan.running_reqs],
            num_computed_tokens=[r.num_computed_tokens for r in plan.running_reqs],
            new_token_ids=self.beams.take_new_tokens(plan),
        )
        finished_req_ids = self.finished_req_ids | plan.preempted_ids
        self.finished_req_ids = set()
        spec_tokens = self.speculation.take_scheduled(plan) if self.speculation else {}
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=dict(plan.num_scheduled_tokens),
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            reads_step_kv=kv.reads_step_kv,
            scheduled_encoder_inputs=plan.encoder.inputs,
            free_encoder_ids=self.encoder_cache.take_freed(),
            block_copies=self.beams.take_block_copies(),
            kv_transfers=kv.offload.take_transfers() if kv.offload is not None else None,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_tokens
            if (
                self.async_scheduling
                and request.num_computed_tokens
                >= request.num_tokens + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1  # this step samples its next token
        return output

    # ------------------------------------------------------------- update from output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply a step's sampled tokens: append them, check stop conditions, free the
        finished requests.

        Args:
            scheduler_output: the plan the step ran.
            model_runner_output: its sampled tokens (and logprobs), per request.

        Returns:
            One EngineCoreOutput per request that got tokens, prompt logprobs or finished,
            plus stats (if ``log_stats``) and first-schedule times.
        """
        runner = model_runner_output
        sampled = dict(zip(runner.req_ids, runner.sampled_token_ids, strict=True))
        drafts = dict(zip(runner.req_ids, runner.spec_token_ids or (), strict=False))
        outputs: list[EngineCoreOutput] = []
        finished_ids: set[str] = set()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted since it was scheduled
            if req_id in runner.failed_requests:
                # its adapter no longer loads: the request ends, the server answers 400
                outputs.append(EngineCoreOutput.refused(req_id, runner.failed_requests[req_id]))
                request.status = RequestStatus.FINISHED_ABORTED
                finished_ids.add(req_id)
                self.free_request(request)
                continue
            step_tokens = sampled.get(req_id, [])
            verified = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if verified and self.speculation is not None:
                self.speculation.on_verified(request, len(verified), len(step_tokens))
            if request.num_output_placeholders:
                request.num_output_placeholders = max(
                    0, request.num_output_placeholders - len(step_tokens)
                )
            if request.beam_group is not None:
                beam_output = self.beams.on_step(request, step_tokens, runner.logprobs.get(req_id))
                if beam_output is not None:
                    outputs.append(beam_output)
                continue
            output, constraint_failed = request_step_output(
                request, step_tokens, runner, self.max_context_len
            )
            self._num_constraint_failures += constraint_failed
            finished = request.is_finished()
            if self.speculation is not None and not finished:
                self.speculation.set_drafts(request, drafts.get(req_id, []), self.max_context_len)
            if output is not None:
                outputs.append(output)
            if finished:
                finished_ids.add(req_id)
                if self.headroom is not None:
                    self.headroom.on_finished(request)
                self.free_request(request)
        if finished_ids:
            self.running = [r for r in self.running if r.request_id not in finished_ids]
        first_scheduled, self._first_scheduled = self._first_scheduled, {}
        return EngineCoreOutputs(
            outputs=outputs,
            scheduler_stats=self.make_stats() if self.log_stats else None,
            timestamp=time.time(),
            first_scheduled=first_scheduled,
        )

    def free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------------ stats

    def make_stats(self) -> SchedulerStats:
        """A snapshot for metrics; counters are deltas since the last snapshot."""
        stats = take_stats(
            self.kv_cache_manager, self.encoder_cache, len(self.running), len(self.waiting),
            self._num_preemptions, self._num_constraint_failures,
        )  # fmt: skip
        if self.speculation:
            stats.spec_decoding_stats = self.speculation.make_stats()
        if self.max_loras:
            stats.running_lora_adapters = count_adapters(self.running)
            stats.waiting_lora_adapters = count_adapters(self.waiting)
        self._num_preemptions = self._num_constraint_failures = 0
        return stats

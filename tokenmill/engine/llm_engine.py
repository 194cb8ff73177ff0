"""LLMEngine: the synchronous front of the engine (offline ``LLM``, tests).

Input processing -> EngineCore (in-process) -> output processing, one ``step()`` at a time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.engine_io import SchedulerStats, SpecDecodingStats
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.input_processor import InputProcessor, ProcessedRequest
from tokenmill.engine.output_processor import IterationStats, OutputProcessor
from tokenmill.engine_args import EngineArgs, UsageContext
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineCounters:
    """Running totals of the scheduler's per-step counters (since the engine started)."""

    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    num_constraint_failures: int = 0  # requests ended for their structured-output constraint
    # speculative decoding: drafts, draft tokens and accepted tokens (all zero without it)
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)

    def add(self, stats: SchedulerStats) -> None:
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        self.num_preemptions += stats.num_preemptions
        self.num_constraint_failures += stats.num_constraint_failures
        if stats.spec_decoding_stats is not None:
            self.spec_decoding.add(stats.spec_decoding_stats)


class LLMEngine:
    """Runs requests to completion in the caller's thread.

    Args:
        config: the resolved engine configuration.
        log_stats: keep per-step statistics (throughput for progress bars).
    """

    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        self.config = config
        mc = config.model_config
        self.tokenizer = get_tokenizer(mc.model, mc.tokenizer if mc.tokenizer != mc.model else None)
        self.engine_core = EngineCore(config, log_stats=log_stats)
        # After the core: it may have shrunk max_model_len to the KV cache (-1).
        self.input_processor = InputProcessor(mc, self.tokenizer, mc.max_logprobs)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=log_stats)
        self.last_iteration_stats: IterationStats | None = None
        self.last_scheduler_stats: SchedulerStats | None = None
        self.counters = EngineCounters()

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, usage_context: UsageContext = "llm"
    ) -> LLMEngine:
        return cls(engine_args.create_engine_config(usage_context))

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Validate, tokenize and queue a request.

        Raises:
            InvalidRequestError, SamplingParamsError: the request cannot be served.
            ValueError: its LoRA adapter cannot be served.
        """
        # Offline, a request longer than the context simply stops there (as vLLM's LLM).
        processed = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority, validate_max_tokens=False,
            lora_request=lora_request,
        )  # fmt: skip
        if lora_request is not None:
            self.engine_core.add_lora(lora_request)  # refused before anything is queued
        self.output_processor.add_request(processed, processed.params)
        for req in processed.engine_requests:
            self.engine_core.add_request(req)
        return processed

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        engine_ids = self.output_processor.abort_requests(ids)
        self.engine_core.abort_requests(engine_ids)

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the outputs it produced."""
        outputs = self.engine_core.step()
        result = self.output_processor.process_outputs(
            outputs.outputs, outputs.timestamp or time.time(), outputs.first_scheduled
        )
        if result.reqs_to_abort:
            self.engine_core.abort_requests(result.reqs_to_abort)
        self.last_iteration_stats = result.iteration_stats
        if outputs.scheduler_stats is not None:
            self.last_scheduler_stats = outputs.scheduler_stats
            self.counters.add(outputs.scheduler_stats)
        return result.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()

"""LLMEngine: the synchronous front of the engine (offline ``LLM``, tests).

Input processing -> EngineCore (in-process) -> output processing, one ``step()`` at a time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.engine_io import EngineCoreOutputs, SchedulerStats, SpecDecodingStats
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.input_processor import (
    InputProcessor,
    ProcessedRequest,
    whole_image_budget,
)
from tokenmill.engine.output_processor import IterationStats, OutputProcessor
from tokenmill.engine_args import EngineArgs, UsageContext
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams
from tokenmill.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineCounters:
    """Running totals of the scheduler's per-step counters (since the engine started)."""

    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    num_constraint_failures: int = 0  # requests ended for their structured-output constraint
    mm_cache_queries: int = 0  # images looked up in the encoder cache
    mm_cache_hits: int = 0  # of those, found
    # KV offload tiers: SchedulerStats.kv_offload_stats, summed
    kv_offload: dict[str, float] = field(default_factory=dict)
    # speculative decoding: drafts, draft tokens and accepted tokens (all zero without it)
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)

    def add(self, stats: SchedulerStats) -> None:
        self.mm_cache_queries += stats.mm_cache_queries
        self.mm_cache_hits += stats.mm_cache_hits
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        self.num_preemptions += stats.num_preemptions
        self.num_constraint_failures += stats.num_constraint_failures
        for key, value in stats.kv_offload_stats.items():
            self.kv_offload[key] = self.kv_offload.get(key, 0.0) + value
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
        self.input_processor = InputProcessor(
            mc, self.tokenizer, mc.max_logprobs, config.scheduler_config.max_num_seqs,
            config.parallel_config.pipeline_parallel_size,
            speculative=config.speculative_config is not None,
            max_image_tokens=whole_image_budget(config.scheduler_config),
        )
        self.output_processor = OutputProcessor(
            self.tokenizer, log_stats=log_stats,
            stream_interval=config.scheduler_config.stream_interval,
        )  # fmt: skip
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
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Validate, tokenize and queue a request (a beam search with BeamSearchParams).

        Raises:
            InvalidRequestError, SamplingParamsError: the request cannot be served.
            RuntimeError: the engine is asleep (``sleep``): nothing would run it.
            ValueError: its LoRA adapter cannot be served.
        """
        if self.engine_core.is_sleeping:
            raise RuntimeError("the engine is asleep: call wake_up() before generating")
        # Offline, a request longer than the context simply stops there (as vLLM's LLM).
        processed = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority, validate_max_tokens=False,
            lora_request=lora_request,
        )  # fmt: skip
        if lora_request is not None:
            self.engine_core.add_lora(lora_request)  # refused before anything is queued
        self.output_processor.add_request(processed, processed.params)
        try:
            for req in processed.engine_requests:
                self.engine_core.add_request(req)
        except Exception:
            # Nothing of it may stay registered or queued: the caller's loop would wait
            # for outputs that never come.
            self.abort_request(processed.request_id)
            raise
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

    def sleep(self, level: int = 1) -> None:
        """Free the weights and the KV cache (``EngineCore.sleep``)."""
        self._process(self.engine_core.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine_core.wake_up(tags)

    def update_weights(self, path: str) -> None:
        """Load new weights in place (``EngineCore.update_weights``)."""
        self._process(self.engine_core.update_weights(path))

    def _process(self, outputs: EngineCoreOutputs | None) -> None:
        """Take the outputs of a step that was in flight when the KV cache was dropped."""
        if outputs is not None and outputs.outputs:
            self.output_processor.process_outputs(outputs.outputs, outputs.timestamp or None)

    def shutdown(self) -> None:
        self.engine_core.shutdown()

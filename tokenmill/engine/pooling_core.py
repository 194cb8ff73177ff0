"""PoolingEngineCore: the engine loop of an embedding model, behind the same interface as
``EngineCore`` (requests in, per-step outputs out, in-process or in ``EngineCoreProc``).

An encoder keeps no KV cache and computes a whole input in one forward pass, so its
scheduler is a queue: each step takes the waiting inputs in arrival order while their
padded batch fits the token budget (``max_num_batched_tokens`` padded tokens, at most
``max_num_seqs`` inputs; an input longer than the budget runs alone), pools them and
finishes them. A batch whose forward pass fails ends its requests with the error as their
stop reason, and the engine keeps serving the others.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.engine_io import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)

logger = logging.getLogger(__name__)

# The stop reason of a pooling request whose forward pass failed: the rest is the error.
POOLING_FAILURE_PREFIX = "embedding failed: "


def next_batch(lengths: Sequence[int], max_tokens: int, max_seqs: int) -> int:
    """How many of the leading inputs (token counts ``lengths``, in arrival order) form the
    next padded batch: at most ``max_seqs`` inputs and ``max_tokens`` padded tokens (their
    count times the longest), or the first input alone when it is longer than that."""
    longest = count = 0
    for length in lengths:
        longest = max(longest, length)
        if count and ((count + 1) * longest > max_tokens or count >= max_seqs):
            break
        count += 1
    return count


def _default_runner(config: EngineConfig) -> Any:
    from tokenmill.worker.pooling_runner import PoolingModelRunner

    return PoolingModelRunner(config)


class PoolingEngineCore:
    """Owns the waiting inputs of an embedding model and its runner; ``step()`` pools one
    padded batch.

    Args:
        config: the resolved configuration of an embedding model.
        runner_factory: builds the runner, an object with ``pool(token_ids) -> [N, H]``
            float32 (default: a ``PoolingModelRunner`` on the configured device).
    """

    # No scheduler statistics: an encoder has no KV cache or running requests to report.
    log_stats = False
    # No sleep mode (--enable-sleep-mode is for generative models).
    is_sleeping = False

    def __init__(
        self, config: EngineConfig, runner_factory: Callable[[EngineConfig], Any] | None = None
    ) -> None:
        self.config = config
        self.runner = (runner_factory or _default_runner)(config)
        self.waiting: OrderedDict[str, list[int]] = OrderedDict()
        sc = config.scheduler_config
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.max_num_seqs = sc.max_num_seqs

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue an input (validated by the front end); its sampling parameters are unused."""
        self.waiting[request.request_id] = request.prompt_token_ids

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.waiting.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def step(self) -> EngineCoreOutputs:
        """Pool the next batch of waiting inputs; one finished output per input, its
        pooled (not yet normalized) vector in ``pooled``."""
        ids = list(self.waiting)
        count = next_batch(
            [len(self.waiting[i]) for i in ids], self.max_num_batched_tokens, self.max_num_seqs
        )
        batch = ids[:count]
        token_ids = [self.waiting.pop(i) for i in batch]
        if not batch:
            return EngineCoreOutputs(timestamp=time.time())
        try:
            pooled = self.runner.pool(token_ids).tolist()
        except Exception as e:  # a failed batch fails its requests, not the engine
            logger.exception("embedding forward pass failed")
            reason = f"{POOLING_FAILURE_PREFIX}{type(e).__name__}: {e}"
            outputs = [EngineCoreOutput(i, [], finish_reason=FinishReason.ABORT,
                                        stop_reason=reason) for i in batch]  # fmt: skip
        else:
            outputs = [
                EngineCoreOutput(i, [], finish_reason=FinishReason.STOP, pooled=row)
                for i, row in zip(batch, pooled, strict=True)
            ]
        return EngineCoreOutputs(outputs=outputs, timestamp=time.time())

    def reset_prefix_cache(self) -> bool:
        return True  # nothing is cached

    def check_health(self) -> None:
        """Nothing to check: the model runs in this process."""

    def check_integrity(self) -> None:
        """Nothing to check: an encoder holds no KV cache."""

    def shutdown(self) -> None:
        """Nothing to stop: the model is freed with the core."""

"""Speculative decoding's metrics, as vLLM names them: Prometheus counters and a periodic log
line (``tokenmill.metrics`` holds both stat loggers; these are their spec-decode parts).

- ``tokenmill:spec_decode_num_drafts_total``: drafts verified (one per request and step);
- ``tokenmill:spec_decode_num_draft_tokens_total``: draft tokens verified;
- ``tokenmill:spec_decode_num_accepted_tokens_total``: draft tokens accepted;
- ``tokenmill:spec_decode_num_accepted_tokens_per_pos_total{position}``: drafts accepted at
  each position ``0..k-1``.

The mean acceptance length (tokens per verified draft, the target's own included) is
``1 + rate(accepted) / rate(drafts)``; the acceptance rate ``rate(accepted) /
rate(draft_tokens)``; position ``i``'s ``rate(per_pos{position=i}) / rate(drafts)``.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter

from tokenmill.core.engine_io import SpecDecodingStats

logger = logging.getLogger("tokenmill.metrics")


class SpecDecodingProm:
    """The spec-decode counters of one model in ``registry``.

    Args:
        num_speculative_tokens: k (one per-position series each).
        prefix: the metric name prefix (``tokenmill:``).
        labels: the engine's labels (``model_name``).
        registry: where the counters live.
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        prefix: str,
        labels: dict[str, str],
        registry: CollectorRegistry,
    ) -> None:
        names = list(labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(prefix + name, doc, names, registry=registry).labels(**labels)

        self.drafts = counter("spec_decode_num_drafts", "Speculative drafts verified.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted by the target."
        )
        per_pos = Counter(
            prefix + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position.",
            [*names, "position"],
            registry=registry,
        )
        self.per_position = [
            per_pos.labels(**labels, position=str(i)) for i in range(num_speculative_tokens)
        ]

    def observe(self, stats: SpecDecodingStats) -> None:
        self.drafts.inc(stats.num_drafts)
        self.draft_tokens.inc(stats.num_draft_tokens)
        self.accepted_tokens.inc(stats.num_accepted_tokens)
        for counter, accepted in zip(
            self.per_position, stats.num_accepted_tokens_per_pos, strict=False
        ):
            counter.inc(accepted)


class SpecDecodingLogging:
    """Sums the counters between two log lines and logs vLLM's ``SpecDecoding metrics``
    line (nothing when no draft was verified in the interval)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.stats = SpecDecodingStats()
        self.last_log_time = time.monotonic()

    def observe(self, stats: SpecDecodingStats) -> None:
        self.stats.add(stats)

    def log(self) -> None:
        stats = self.stats
        if not stats.num_drafts:
            self.reset()
            return
        elapsed = max(time.monotonic() - self.last_log_time, 1e-6)
        rates = ", ".join(
            f"{n / stats.num_drafts:.3f}" for n in stats.num_accepted_tokens_per_pos
        )
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f "
            "tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d "
            "tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            stats.mean_acceptance_length,
            stats.num_accepted_tokens / elapsed,
            stats.num_draft_tokens / elapsed,
            stats.num_accepted_tokens,
            stats.num_draft_tokens,
            rates,
            100.0 * stats.num_accepted_tokens / max(stats.num_draft_tokens, 1),
        )
        self.reset()

"""What the benchmarks report of speculative decoding: the acceptance over a run.

Offline (``bench throughput``, ``bench latency``) from the engine's counters; against a
server (``bench serve``) from its ``/metrics`` before and after the run, under tokenmill's
or vLLM's names (``tokenmill:spec_decode_*`` / ``vllm:spec_decode_*``), so the same line
reads both engines. Nothing is reported without speculative decoding.
"""

from __future__ import annotations

import copy
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.core.engine_io import SpecDecodingStats

_COUNTERS = {
    "spec_decode_num_drafts": "num_drafts",
    "spec_decode_num_draft_tokens": "num_draft_tokens",
    "spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


def snapshot(stats: SpecDecodingStats) -> SpecDecodingStats:
    """A copy of running totals, to subtract from later ones."""
    return copy.deepcopy(stats)


def acceptance(before: SpecDecodingStats | None, after: SpecDecodingStats | None) -> dict[str, Any]:
    """The run's acceptance from counter totals before and after it (empty without drafts).

    Returns:
        ``spec_decode_acceptance_length`` (tokens per verified draft, the target's own
        included), ``spec_decode_acceptance_rate`` (accepted / draft tokens),
        ``spec_decode_per_position_acceptance_rate`` (per draft position),
        ``spec_decode_num_drafts``, ``spec_decode_num_draft_tokens`` and
        ``spec_decode_num_accepted_tokens``.
    """
    if after is None:
        return {}
    before = before or SpecDecodingStats()
    drafts = after.num_drafts - before.num_drafts
    if drafts <= 0:
        return {}
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    old = before.num_accepted_tokens_per_pos
    per_pos = [
        (n - (old[i] if i < len(old) else 0)) / drafts
        for i, n in enumerate(after.num_accepted_tokens_per_pos)
    ]
    return {
        "spec_decode_acceptance_length": 1.0 + accepted / drafts,
        "spec_decode_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "spec_decode_per_position_acceptance_rate": per_pos,
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": draft_tokens,
        "spec_decode_num_accepted_tokens": accepted,
    }


def format_acceptance(result: dict[str, Any]) -> str:
    """The summary lines of ``acceptance``'s figures ("" when there are none)."""
    if "spec_decode_acceptance_length" not in result:
        return ""
    rates = ", ".join(f"{r:.3f}" for r in result["spec_decode_per_position_acceptance_rate"])
    return (
        f"Mean acceptance length: {result['spec_decode_acceptance_length']:.2f}\n"
        f"Draft acceptance rate: {100 * result['spec_decode_acceptance_rate']:.1f}% "
        f"({result['spec_decode_num_accepted_tokens']} of "
        f"{result['spec_decode_num_draft_tokens']} draft tokens, "
        f"{result['spec_decode_num_drafts']} drafts)\n"
        f"Per-position acceptance rate: {rates}"
    )


def scrape(base_url: str, headers: dict[str, str] | None = None) -> SpecDecodingStats | None:
    """The server's spec-decode counter totals from its ``/metrics`` (summed over label
    sets), or None when it exports none or does not answer."""
    request = urllib.request.Request(f"{base_url}/metrics", headers=headers or {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as response:
            text = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return parse_metrics(text)


def parse_metrics(text: str) -> SpecDecodingStats | None:
    """Spec-decode counter totals in a Prometheus text exposition, or None when it has none.
    tokenmill's names are read where present, else vLLM's (a tokenmill server with
    ``--metrics-compat vllm`` exports both)."""
    by_prefix: dict[str, SpecDecodingStats] = {}
    per_pos: dict[str, dict[int, float]] = {}
    for family in text_string_to_metric_families(text):
        prefix, _, name = family.name.rpartition(":")
        if name not in _COUNTERS and name != _PER_POSITION:
            continue
        stats = by_prefix.setdefault(prefix, SpecDecodingStats())
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # e.g. vLLM's *_created series
            if name in _COUNTERS:
                field = _COUNTERS[name]
                setattr(stats, field, getattr(stats, field) + int(sample.value))
            elif "position" in sample.labels:
                position = int(sample.labels["position"])
                counts = per_pos.setdefault(prefix, {})
                counts[position] = counts.get(position, 0) + sample.value
    prefix = "tokenmill" if "tokenmill" in by_prefix else next(iter(by_prefix), None)
    if prefix is None:
        return None
    stats = by_prefix[prefix]
    counts = per_pos.get(prefix, {})
    stats.num_accepted_tokens_per_pos = [int(counts.get(i, 0)) for i in range(len(counts))]
    stats.num_spec_tokens = len(counts)
    return stats

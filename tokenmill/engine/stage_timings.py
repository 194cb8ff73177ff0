"""StageTimings: where a request's time goes in the front end (debug aid).

With ``TOKENMILL_LOG_STEP_STATS=1`` the server records, per request, how long each
front-end stage took (tokenizing, waiting for the first output, starting the stream) and how
late engine outputs reach the front end; the lag probe logs the means every few seconds.
Off, ``record`` is never called and nothing is kept.
"""

from __future__ import annotations

from collections import defaultdict


class StageTimings:
    """Sums and counts of stage durations (seconds) since the last ``take``."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)
        self._maxes: dict[str, float] = defaultdict(float)

    def record(self, stage: str, seconds: float) -> None:
        self._sums[stage] += seconds
        self._counts[stage] += 1
        self._maxes[stage] = max(self._maxes[stage], seconds)

    def take(self) -> str:
        """``stage: mean/max ms (n)`` for every stage seen, then forget them."""
        parts = [
            f"{stage} {1e3 * self._sums[stage] / n:.1f}/{1e3 * self._maxes[stage]:.1f} ms ({n})"
            for stage, n in self._counts.items()
        ]
        self._sums.clear()
        self._counts.clear()
        self._maxes.clear()
        return "; ".join(parts) or "no requests"


FRONT_END_TIMINGS = StageTimings()

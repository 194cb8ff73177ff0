"""Keep the start-up heap out of the garbage collector's full collections.

A process that has loaded a model or a 128k-token tokenizer holds hundreds of thousands of
long-lived Python objects (modules, vocabularies, configs). CPython's full (generation 2)
collections walk all of them: ~100-150 ms per collection for the server's front end alone,
taken on the event loop or in the middle of an engine step whenever enough new objects have
survived. ``gc.freeze()`` moves everything alive after start-up into a permanent generation
that collections skip; objects created while serving are collected as usual.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> None:
    """Collect once, then freeze every surviving object (call when start-up is done).

    Args:
        what: the process's role, for the log line ("engine core", "API server").
    """
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info(
        "%s: %d start-up objects frozen out of garbage collection (%.0f ms)",
        what,
        gc.get_freeze_count(),
        1e3 * (time.perf_counter() - start),
    )

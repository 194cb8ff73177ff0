"""Compiling start-up's Triton kernels in parallel, before the passes that launch them.

Triton compiles a kernel variant at its first launch, and start-up reaches every variant
the engine serves with (the profiling pass, the attention and sampler warm-ups, the warm-up
passes of each CUDA graph size): with an empty Triton cache (a fresh machine, a new
tokenmill or Triton version) those compiles run one after another, each while the GPU
waits, and were most of a cold start (engine core ready in 47.3 s cold against 10.1 s with
the cache warm, Llama-3.1-8B on an H200, RESULTS.md sixteenth set).

So start-up runs its passes twice. The first time, inside ``compile_only``, a Triton launch
from the start-up thread only submits its compile to a thread pool (Triton's
``AsyncCompileMode``; lowering and ``ptxas`` release the GIL) and launches nothing; torch
operations run as usual, on whatever the skipped kernels left in their outputs, which the
pass then discards. On leaving the block every compile has finished and sits in the
kernels' in-memory caches, so the real passes launch without compiling. A variant that only
the real passes reach is compiled then, as before: the first pass saves time and never
changes what runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from tokenmill import envs

logger = logging.getLogger(__name__)


@contextmanager
def compile_only(device: torch.device) -> Iterator[bool]:
    """Inside the block, Triton launches made by this thread compile on a pool of
    ``envs.compile_threads()`` threads and do not run; leaving it waits for every compile.

    Yields True when launches are deferred; False (the block should then do nothing) off
    CUDA, with fewer than two threads, or with a Triton that has no asynchronous compile
    mode. Launches from other threads run as usual.

    Raises:
        Whatever a compile raised (the first in submission order), on leaving the block.
    """
    threads = envs.compile_threads()
    if device.type != "cuda" or threads < 2:
        yield False
        return
    try:
        from triton.runtime._async_compile import AsyncCompileMode
        from triton.runtime.jit import JITFunction
    except ImportError:  # Triton < 3.4
        yield False
        return
    owner = threading.get_ident()
    launch = JITFunction.run

    def compile_instead(self, *args, **kwargs):
        if threading.get_ident() == owner:
            kwargs["warmup"] = True  # bind, specialize and compile; launch nothing
        return launch(self, *args, **kwargs)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool:
        JITFunction.run = compile_instead
        try:
            with AsyncCompileMode(pool) as mode:
                yield True
                waited = time.perf_counter()
            logger.info(
                "Compiled %d Triton kernel variants on %d threads in %.1f s (%.1f s after the "
                "passes that found them)",
                len(mode.future_kernels), threads, time.perf_counter() - start,
                time.perf_counter() - waited,
            )  # fmt: skip
        finally:
            JITFunction.run = launch


def compile_first(device: torch.device, passes: Callable[[], object]) -> None:
    """Run ``passes`` once inside ``compile_only`` (nothing happens where launches cannot be
    deferred), so that running them again launches already-compiled kernels.

    What the deferred run raises is logged, not raised: the real run that follows reaches
    the same code and raises it there, where it belongs.
    """
    try:
        with compile_only(device) as deferred:
            if deferred:
                passes()
    except Exception as e:  # noqa: BLE001 - see above
        logger.warning("Compiling start-up kernels ahead failed (%s: %s); each kernel "
                       "compiles at its first launch instead", type(e).__name__, e)  # fmt: skip

"""Compiling start-up's Triton kernels in parallel, before the passes that launch them.

Triton compiles a kernel variant at its first launch, and start-up reaches every variant
the engine serves with (the profiling pass, the attention and sampler warm-ups, the warm-up
passes of each CUDA graph size): with an empty Triton cache (a fresh machine, a new
tokenmill or Triton version) those compiles run one after another, each while the GPU
waits, and are most of a cold start.

So start-up runs its passes twice. The first time, inside ``compile_only``, a Triton launch
from the start-up thread only submits its compile to a thread pool (Triton's
``AsyncCompileMode``; lowering and ``ptxas`` release the GIL) and launches nothing; torch
operations run as usual, on whatever the skipped kernels left in their outputs, which the
pass then discards. On leaving the block every compile has finished and sits in the
kernels' in-memory caches, so the real passes launch without compiling. A variant that only
the real passes reach, or whose compile failed, is compiled then, as before. The kernels
that run are the same; what the first pass changes is when lazily created buffers (cuBLAS
workspaces, the skinny GEMM's split-K counters) appear: before the profiling pass, so the
KV-cache sizing counts them as memory in use rather than as part of the activation peak.

With Triton's cache already warm the first pass compiles nothing and costs its host time
(one forward pass per captured size, launches only bound and specialised).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from tokenmill import envs

logger = logging.getLogger(__name__)


# One deferral at a time per process: the patch of ``JITFunction.run`` is process-wide, and
# two overlapping blocks restoring it out of order would leave launches deferred for good.
_DEFERRING = threading.Lock()


class _RecordingPool(ThreadPoolExecutor):
    """A thread pool that keeps the futures of what it was given (the compiles)."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads, thread_name_prefix="triton-compile")
        self.futures: list[Future] = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = super().submit(fn, *args, **kwargs)
        self.futures.append(future)
        return future


@contextmanager
def compile_only(device: torch.device) -> Iterator[bool]:
    """Inside the block, Triton launches made by this thread compile on a pool of
    ``envs.compile_threads()`` threads and do not run; leaving it waits for every compile.

    Yields True when launches are deferred; False (the block should then do nothing) off
    CUDA, with fewer than two threads, with a Triton that has no asynchronous compile mode,
    or while another thread defers. Launches from other threads run as usual. A compile
    that failed leaves nothing cached, so the kernel's next launch compiles it again.

    Raises:
        The first error a compile raised, on leaving the block (after every compile ended).
    """
    threads = envs.compile_threads()
    if device.type != "cuda" or threads < 2:
        yield False
        return
    try:
        from triton.runtime import _async_compile
        from triton.runtime.jit import JITFunction
    except ImportError:  # Triton < 3.4
        yield False
        return
    if not _DEFERRING.acquire(blocking=False):
        yield False
        return
    owner = threading.get_ident()
    launch = JITFunction.run
    launched: dict[int, JITFunction] = {}

    def compile_instead(self, *args, **kwargs):
        if threading.get_ident() == owner:
            kwargs["warmup"] = True  # bind, specialize and compile; launch nothing
            launched[id(self)] = self
        return launch(self, *args, **kwargs)

    start = time.perf_counter()
    pool = _RecordingPool(threads)
    JITFunction.run = compile_instead
    try:
        mode = _async_compile.AsyncCompileMode(pool)
        mode.ignore_errors = True  # failures are handled below (Triton >= 3.7 reads this)
        with mode:
            yield True
            waited = time.perf_counter()
            # Every compile ends before the mode finalizes them; none raises out of it.
            errors = [e for e in map(Future.exception, pool.futures) if e is not None]
            if errors:
                # The mode would re-raise the first failure from its exit (Triton < 3.7)
                # and stop finalizing there: finalize the rest ourselves, then drop it.
                _finish(mode)
        logger.info(
            "Compiled %d Triton kernel variants on %d threads in %.1f s (%.1f s after the "
            "passes that found them)",
            len(pool.futures) - len(errors), threads, time.perf_counter() - start,
            time.perf_counter() - waited,
        )  # fmt: skip
        if errors:
            raise errors[0]
    finally:
        JITFunction.run = launch
        _reset_active_mode(_async_compile)
        _drop_failed(launched.values())
        pool.shutdown(wait=True)
        _DEFERRING.release()


def _finish(mode) -> None:
    """Finalize every compile that succeeded and leave the mode nothing to do on exit."""
    for kernel in list(getattr(mode, "future_kernels", {}).values()):
        try:
            kernel.result()
        except Exception:  # noqa: BLE001 - dropped by _drop_failed
            pass
    for name in ("raw_futures", "future_kernels"):
        container = getattr(mode, name, None)
        if container is not None:
            container.clear()


def _reset_active_mode(async_compile) -> None:
    """No asynchronous compile mode stays active, whichever way the block ended (an exit
    that raised leaves Triton's own reset undone)."""
    active = async_compile.active_mode
    if hasattr(active, "set"):  # a ContextVar (Triton >= 3.5)
        active.set(None)
    else:
        async_compile.active_mode = None


def _drop_failed(functions) -> None:
    """Remove the placeholders of failed compiles from the kernels' caches, so that a later
    launch compiles again instead of re-raising a stored failure."""
    from triton.runtime._async_compile import FutureKernel

    for fn in functions:
        for caches in fn.device_caches.values():
            kernel_cache = caches[0]
            for key, kernel in list(kernel_cache.items()):
                if isinstance(kernel, FutureKernel) and kernel.kernel is None:
                    del kernel_cache[key]


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
    except Exception:  # noqa: BLE001 - see above
        logger.warning("Compiling start-up kernels ahead failed; what failed compiles at its "
                       "first launch instead", exc_info=True)  # fmt: skip

"""Start-up's parallel Triton compile on CUDA: inside ``compile_only`` a launch from the
start-up thread compiles and runs nothing, a launch from another thread runs, and after the
block the compiled kernel launches without compiling again. The engine's start-up with and
without it is compared in test_engine_gpu.py."""

from __future__ import annotations

import threading

import pytest
import torch

from tokenmill.math_utils import cdiv

pytestmark = pytest.mark.gpu


def _fill_kernel():
    # Defined at call time: a Triton kernel defined at collection would stop the CPU tests'
    # interpreter mode (see test_skinny_gemm_gpu.py).
    import triton
    import triton.language as tl

    @triton.jit
    def fill(out_ptr, value, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, value, mask=offs < n)

    return fill


def test_launches_compile_without_running_then_run(monkeypatch):
    from tokenmill.worker.parallel_compile import compile_only

    monkeypatch.setenv("TOKENMILL_COMPILE_THREADS", "4")
    fill = _fill_kernel()
    out = torch.zeros(1000, device="cuda")
    other = torch.zeros(1000, device="cuda")
    with compile_only(out.device) as deferred:
        assert deferred
        for block in (64, 128, 256):  # three variants, compiled concurrently
            fill[(cdiv(1000, block),)](out, 1.0, 1000, BLOCK=block)
        # Another thread's launch is not the start-up pass's: it runs.
        worker = threading.Thread(target=lambda: fill[(8,)](other, 2.0, 1000, BLOCK=128))
        worker.start()
        worker.join()
        torch.cuda.synchronize()
        assert torch.count_nonzero(out) == 0
    assert torch.all(other == 2.0)
    compiled = sum(len(c[0]) for c in fill.device_caches.values())
    assert compiled == 3
    for block in (64, 128, 256):
        out.zero_()
        fill[(cdiv(1000, block),)](out, float(block), 1000, BLOCK=block)
        torch.cuda.synchronize()
        assert torch.all(out == float(block))
    assert sum(len(c[0]) for c in fill.device_caches.values()) == 3  # nothing recompiled

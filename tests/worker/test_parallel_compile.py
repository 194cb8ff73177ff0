"""``parallel_compile`` where launches cannot be deferred (the CPU, one thread) and its
failure handling; the deferral itself is tested on CUDA (tests/gpu)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from tokenmill.worker import parallel_compile


def test_off_cuda_nothing_is_deferred():
    with parallel_compile.compile_only(torch.device("cpu")) as deferred:
        assert not deferred


def test_one_thread_defers_nothing(monkeypatch):
    monkeypatch.setenv("TOKENMILL_COMPILE_THREADS", "1")
    with parallel_compile.compile_only(torch.device("cuda")) as deferred:
        assert not deferred


def test_compile_first_skips_the_passes_when_nothing_is_deferred():
    ran = []
    parallel_compile.compile_first(torch.device("cpu"), lambda: ran.append(1))
    assert ran == []


def test_compile_first_logs_what_the_deferred_passes_raise(monkeypatch, caplog):
    @contextmanager
    def deferring(device):
        yield True

    monkeypatch.setattr(parallel_compile, "compile_only", deferring)

    def passes():
        raise IndexError("garbage in a skipped kernel's output")

    parallel_compile.compile_first(torch.device("cuda"), passes)  # does not raise
    assert "IndexError: garbage" in caplog.text


@pytest.mark.parametrize(("value", "expected"), [("0", 0), ("1", 1), ("12", 12)])
def test_thread_count_from_the_environment(monkeypatch, value, expected):
    from tokenmill import envs

    monkeypatch.setenv("TOKENMILL_COMPILE_THREADS", value)
    assert envs.compile_threads() == expected


SCENARIO = r'''
import collections, threading, torch
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import _async_compile, driver
from triton.runtime.jit import JITFunction

from tokenmill.worker import parallel_compile as pc


class FakeDriver:  # enough of a CUDA driver for binding and specialisation
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


driver.set_active(FakeDriver())


def fill(x_ptr, n, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(x_ptr + o, 1.0, mask=o < n)


kernel = JITFunction(fill)
compiled = []


def fake_compile(src, target=None, options=None, _env_vars=None):
    if 64 in src.constants.values():
        raise RuntimeError("simulated compile failure")
    compiled.append(sorted(src.constants.values()))
    return "a compiled kernel"


make_binder = kernel.create_binder


def binder():
    caches = make_binder()
    kernel.compile = fake_compile
    return caches


kernel.device_caches = collections.defaultdict(binder)
x = torch.empty(4)
launch = JITFunction.run


def passes():
    kernel[(1,)](x, 4, B=32)
    kernel[(1,)](x, 4, B=64)  # fails to compile
    kernel[(1,)](x, 4, B=32)  # the same variant again: one compile


pc.compile_first(torch.device("cuda"), passes)
cache = kernel.device_caches[0][0]
assert sorted(type(v).__name__ for v in cache.values()) == ["str"], cache
assert JITFunction.run is launch
active = _async_compile.active_mode
assert (active.get() if hasattr(active, "get") else active) is None
# A variant first reached later (while serving) compiles at its launch, as without deferral,
# and so does the failed one, again.
kernel.warmup(x, 4, B=128, grid=(1,))
assert compiled[-1] == [128]
try:
    kernel.warmup(x, 4, B=64, grid=(1,))
    raise AssertionError("the failed variant did not compile again")
except RuntimeError as e:
    assert "simulated" in str(e)

# While one thread defers, another gets no deferral (the patch is process-wide).
inside, done = threading.Event(), threading.Event()
seen = []


def first():
    with pc.compile_only(torch.device("cuda")) as deferred:
        seen.append(deferred)
        inside.set()
        done.wait()


t = threading.Thread(target=first)
t.start()
inside.wait()
with pc.compile_only(torch.device("cuda")) as deferred:
    seen.append(deferred)
done.set()
t.join()
assert seen == [True, False], seen
assert JITFunction.run is launch
print("OK")
'''


def test_deferral_survives_a_failed_compile_and_never_nests(tmp_path):
    """Through Triton's real launch path (a stand-in driver and compiler): a failed compile
    is logged, leaves no placeholder and no active compile mode behind, so later variants and
    the failed one compile at their launch; a second thread gets no deferral meanwhile."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.runtime._async_compile")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TOKENMILL_COMPILE_THREADS="4", TRITON_CACHE_DIR=str(tmp_path))
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
    assert "simulated compile failure" in result.stderr  # logged with its traceback

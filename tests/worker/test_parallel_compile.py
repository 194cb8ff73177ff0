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

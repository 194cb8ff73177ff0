"""tokenmill.envs: the CPU worker's thread count follows the cores it may use."""

from __future__ import annotations

import os

import pytest

from tokenmill import envs


@pytest.fixture
def cores(monkeypatch):
    """Set how many CPUs the process may run on; no thread variables set."""
    monkeypatch.delenv("TOKENMILL_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def set_cores(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)

    return set_cores


@pytest.mark.parametrize(("num_cores", "threads"), [(1, 1), (2, 2), (16, 16)])
def test_default_is_one_thread_per_usable_core(cores, num_cores, threads):
    cores(num_cores)
    assert envs.cpu_threads() == threads


def test_explicit_value_wins(cores, monkeypatch):
    cores(16)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("TOKENMILL_CPU_THREADS", "4")
    assert envs.cpu_threads() == 4
    monkeypatch.setenv("TOKENMILL_CPU_THREADS", "0")  # torch's own default
    assert envs.cpu_threads() == 0


def test_omp_num_threads_is_honoured(cores, monkeypatch):
    cores(16)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert envs.cpu_threads() == 0  # leave torch's default, which reads OMP_NUM_THREADS

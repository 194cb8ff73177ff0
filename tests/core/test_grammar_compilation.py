"""Grammar compilation in worker processes: arrival order, shared compiles, the cache,
failures, the time limit that kills the compile, the queue that refuses when full, aborts."""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from tests.core.grammar_fakes import FakeBackend, start_fake_worker
from tests.core.test_scheduler import make_request
from tokenmill.core.grammar_compilation import (
    CompileBusy,
    CompileTimeout,
    GrammarCompilation,
)
from tokenmill.sampling_params import StructuredOutputsParams


def constrained(req_id: str, pattern: str):
    return make_request(req_id, 4, structured_outputs=StructuredOutputsParams(regex=pattern))


def pool(**kwargs) -> tuple[GrammarCompilation, FakeBackend]:
    backend = FakeBackend()
    return GrammarCompilation(lambda: backend, start_fake_worker, **kwargs), backend


def drain(compilation: GrammarCompilation, count: int, timeout_s: float = 30.0):
    """take_ready until ``count`` requests came back; (ready ids, {failed id: error})."""
    ready, failed = [], {}
    deadline = time.monotonic() + timeout_s
    while len(ready) + len(failed) < count:
        if time.monotonic() > deadline:
            pytest.fail(f"only {len(ready) + len(failed)} of {count} compilations ended")
        compilation.wait_any(0.05)
        done, errors = compilation.take_ready()
        ready += [r.request_id for r in done]
        failed.update({r.request_id: e for r, e in errors})
    return ready, failed


def test_ready_requests_come_out_in_arrival_order_sharing_compiles_and_the_cache():
    compilation, backend = pool(max_workers=2)
    try:
        for req_id, pattern in (("a", "sleep:0.3"), ("b", "x"), ("c", "sleep:0.3"), ("d", "y")):
            compilation.submit(constrained(req_id, pattern))
        assert len(compilation) == 4 and "b" in compilation
        ready, failed = drain(compilation, 4)
        assert sorted(ready) == ["a", "b", "c", "d"] and failed == {}
        # "a" and "c" shared one compile; a later request with the same constraint is ready
        # from the cache without a worker.
        assert len(backend.cache) == 3
        request = constrained("e", "x")
        compilation.submit(request)
        ready, _ = compilation.take_ready()
        assert ready == [request] and request.grammar == "grammar of x"
    finally:
        compilation.shutdown()


def test_a_failed_compilation_is_reported_and_an_abort_drops_its_request():
    compilation, _ = pool(max_workers=1)
    try:
        compilation.submit(constrained("bad", "bad"))
        compilation.submit(constrained("gone", "w"))
        compilation.discard(["gone", "unknown"])
        ready, failed = drain(compilation, 1)
        assert ready == [] and list(failed) == ["bad"]
        assert "does not compile" in str(failed["bad"]) and len(compilation) == 0
    finally:
        compilation.shutdown()


def test_a_backend_that_cannot_be_built_fails_every_request():
    def broken():
        raise RuntimeError("no tokenizer")

    compilation = GrammarCompilation(broken, start_fake_worker, max_workers=1)
    try:
        compilation.submit(constrained("r", "x"))
        _, failed = drain(compilation, 1)
        assert isinstance(failed["r"], RuntimeError)
    finally:
        compilation.shutdown()


def test_costly_compiles_sent_together_end_by_the_limit_and_their_work_stops():
    """Four compiles that would each burn 60 s of CPU, one worker: all four requests fail
    by the time limit (the running one as too slow, the queued ones as busy), the worker
    that ran past the limit is killed, and nothing keeps burning CPU afterwards."""
    compilation, _ = pool(max_workers=1, max_compile_s=0.5)
    try:
        for i in range(4):
            compilation.submit(constrained(f"costly{i}", f"spin:6{i}"))
        ready, failed = drain(compilation, 4)
        assert ready == []
        kinds = sorted(type(e).__name__ for e in failed.values())
        assert kinds == ["CompileBusy", "CompileBusy", "CompileBusy", "CompileTimeout"]
        assert str(failed["costly0"]).startswith(
            "structured_outputs: the constraint took more than 0.5 s"
        )
        assert "(busy)" in str(failed["costly1"]) and "retry later" in str(failed["costly1"])
        assert compilation._workers == []  # killed, and not replaced while nothing waits
        assert len(compilation) == 0
    finally:
        compilation.shutdown()


def test_a_full_queue_refuses_at_once_and_an_abort_stops_a_running_compile():
    compilation, _ = pool(max_workers=1, max_queued=2)
    try:
        compilation.submit(constrained("running", "sleep:60"))
        drain_until(lambda: compilation._busy, compilation)
        [worker] = compilation._workers
        pid = worker.pid
        compilation.submit(constrained("q1", "sleep:63"))
        compilation.submit(constrained("q2", "sleep:61"))
        compilation.submit(constrained("refused", "sleep:62"))
        _, failed = compilation.take_ready()
        [(request, error)] = failed
        assert request.request_id == "refused" and isinstance(error, CompileBusy)
        assert "too many other constraints" in str(error)
        compilation.discard(["running", "q1", "q2"])
        deadline = time.monotonic() + 10  # the pump kills the worker; the process is reaped
        while compilation._workers or (psutil.pid_exists(pid) and not _zombie(pid)):
            assert time.monotonic() < deadline, "the aborted compile's worker still runs"
            time.sleep(0.01)
    finally:
        compilation.shutdown()


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def drain_until(condition, compilation: GrammarCompilation, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        compilation.wait_any(0.05)
        compilation.take_ready()


def test_the_time_limit_does_not_count_the_backend_build():
    built = threading.Event()
    backend = FakeBackend()

    def slow_build():
        assert built.wait(30)
        return backend

    compilation = GrammarCompilation(slow_build, start_fake_worker, max_compile_s=0.3)
    try:
        compilation.submit(constrained("early", "x"))
        time.sleep(0.5)  # past the limit while the backend is still being built
        assert compilation.take_ready() == ([], [])
        built.set()
        ready, failed = drain(compilation, 1)
        assert ready == ["early"] and failed == {}
    finally:
        built.set()
        compilation.shutdown()


def test_compile_timeout_reads_as_a_client_error():
    assert str(CompileTimeout(5)).startswith("structured_outputs: the constraint took more")


def test_exit_waits_for_a_backend_still_being_built(tmp_path):
    """A process that ends while the grammar backend is built in the background waits for
    the build: the grammar library's C++ state torn down under a running build aborted the
    process (exit status 134) at random."""
    import subprocess
    import sys

    done = tmp_path / "built"
    script = (
        "import time\n"
        "from tokenmill.core.grammar_compilation import _in_background\n"
        f"_in_background(lambda: (time.sleep(1.0), open({str(done)!r}, 'w').close()))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert result.returncode == 0 and done.exists()

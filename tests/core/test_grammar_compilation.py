"""Grammar compilation beside the engine loop: arrival order, failures, aborts."""

from __future__ import annotations

import threading
import time

import pytest

from tests.core.test_scheduler import make_request
from tokenmill.core.grammar_compilation import CompileTimeout, GrammarCompilation
from tokenmill.sampling_params import StructuredOutputsParams


class FakeCompiler:
    """Compiles a regex constraint into its pattern once its gate opens; "(" fails."""

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}

    def compile(self, constraint: StructuredOutputsParams) -> str:
        gate = self.gates.setdefault(constraint.regex, threading.Event())
        assert gate.wait(10)
        if constraint.regex == "(":
            raise ValueError("unbalanced parenthesis")
        return constraint.regex

    def open(self, pattern: str) -> None:
        self.gates.setdefault(pattern, threading.Event()).set()


def constrained(req_id: str, pattern: str):
    return make_request(req_id, 4, structured_outputs=StructuredOutputsParams(regex=pattern))


def test_ready_requests_come_out_in_arrival_order_with_their_grammars():
    compiler = FakeCompiler()
    compilation = GrammarCompilation(lambda: compiler, max_workers=3)
    try:
        for req_id, pattern in (("a", "x"), ("b", "y"), ("c", "z")):
            compilation.submit(constrained(req_id, pattern))
        assert len(compilation) == 3 and "b" in compilation
        compiler.open("z")
        compiler.open("x")
        compilation.wait_any(5)
        _wait_until_done(compilation, 2)
        ready, failed = compilation.take_ready()
        assert [(r.request_id, r.grammar) for r in ready] == [("a", "x"), ("c", "z")]
        assert failed == [] and len(compilation) == 1 and "b" in compilation
    finally:
        for pattern in "xyz":
            compiler.open(pattern)
        compilation.shutdown()


def test_a_failed_compilation_is_reported_with_its_error_and_aborts_are_dropped():
    compiler = FakeCompiler()
    compilation = GrammarCompilation(lambda: compiler, max_workers=2)
    try:
        compilation.submit(constrained("bad", "("))
        compilation.submit(constrained("gone", "w"))
        compilation.discard(["gone", "unknown"])
        assert len(compilation) == 1
        compiler.open("(")
        compiler.open("w")
        _wait_until_done(compilation, 1)
        ready, failed = compilation.take_ready()
        assert ready == []
        [(request, error)] = failed
        assert request.request_id == "bad" and "unbalanced" in str(error)
        assert len(compilation) == 0
    finally:
        compilation.shutdown()


def test_a_compiler_that_cannot_be_built_fails_every_request():
    def broken():
        raise RuntimeError("no tokenizer")

    compilation = GrammarCompilation(broken, max_workers=1)
    try:
        compilation.submit(constrained("r", "x"))
        _wait_until_done(compilation, 1)
        _, [(_, error)] = compilation.take_ready()
        assert isinstance(error, RuntimeError)
    finally:
        compilation.shutdown()


def _wait_until_done(compilation: GrammarCompilation, count: int) -> None:
    futures = [f for _, f in compilation._pending.values()]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sum(f.done() for f in futures) >= count:
            return
        time.sleep(0.005)
    pytest.fail(f"{count} compilations did not finish")


def test_an_aborted_request_whose_compile_has_not_started_is_never_compiled():
    compiler = FakeCompiler()
    compilation = GrammarCompilation(lambda: compiler, max_workers=1)
    try:
        compilation.submit(constrained("busy", "x"))  # holds the one thread
        compilation.submit(constrained("gone", "never"))
        compilation.discard(["gone"])
        compiler.open("x")
        _wait_until_done(compilation, 1)
        time.sleep(0.05)  # the thread has taken the next job by now
        assert "never" not in compiler.gates  # its compile did not start
        ready, _ = compilation.take_ready()
        assert [r.request_id for r in ready] == ["busy"]
    finally:
        compilation.shutdown()


def test_compile_threads_never_hold_up_the_process_exit():
    compiler = FakeCompiler()
    compilation = GrammarCompilation(lambda: compiler, max_workers=2)
    compilation.submit(constrained("stuck", "held"))  # its gate never opens in time
    workers = list(compilation._workers)
    compilation.shutdown()
    assert len(compilation) == 0 and workers and all(w.thread.daemon for w in workers)
    compiler.open("held")


def _wait_until(condition, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("the condition did not hold in time")
        time.sleep(0.005)


def test_a_compile_past_its_time_limit_fails_and_its_thread_is_replaced():
    compiler = FakeCompiler()
    compilation = GrammarCompilation(lambda: compiler, max_workers=1, max_compile_s=0.05)
    try:
        compilation.submit(constrained("slow", "held"))  # its gate opens only at the end
        _wait_until(lambda: compilation._workers and compilation._workers[0].job is not None)
        compilation.submit(constrained("next", "x"))
        compiler.open("x")
        time.sleep(0.1)
        ready, failed = compilation.take_ready()  # "slow" is overdue: a new thread starts
        [(request, error)] = failed
        assert request.request_id == "slow" and isinstance(error, CompileTimeout)
        assert str(error).startswith("structured_outputs: the constraint took more than")
        # The replacement compiles the next request while the overdue one is still stuck.
        if not ready:
            _wait_until_done(compilation, 1)
            ready, failed = compilation.take_ready()
            assert failed == []
        assert [r.request_id for r in ready] == ["next"]
    finally:
        compiler.open("held")
        compilation.shutdown()


def test_overdue_threads_are_replaced_only_up_to_the_thread_count():
    compiler = FakeCompiler()
    compilation = GrammarCompilation(lambda: compiler, max_workers=1, max_compile_s=0.02)
    try:
        for i in range(2):  # each holds its thread past the limit
            compilation.submit(constrained(f"slow{i}", f"held{i}"))
            _wait_until(lambda: compilation._workers and compilation._workers[0].job is not None)
            time.sleep(0.05)
            _, failed = compilation.take_ready()
            assert [r.request_id for r, _ in failed] == [f"slow{i}"]
        # One thread's worth overdue beside it at most: no new thread until one ends.
        assert compilation._workers == [] and len(compilation._overdue) == 2
        compilation.submit(constrained("after", "y"))
        compiler.open("y")
        time.sleep(0.05)
        assert compilation.take_ready() == ([], []) and compilation._workers == []
        compiler.open("held0")
        _wait_until(lambda: not compilation._overdue[0].thread.is_alive())
        ready, _ = compilation.take_ready()  # starts a thread again
        if not ready:
            _wait_until_done(compilation, 1)
            ready, _ = compilation.take_ready()
        assert [r.request_id for r in ready] == ["after"]
    finally:
        for i in range(2):
            compiler.open(f"held{i}")
        compilation.shutdown()


def test_the_time_limit_does_not_count_the_compiler_build():
    built = threading.Event()
    compiler = FakeCompiler()

    def slow_build():
        assert built.wait(10)
        return compiler

    compilation = GrammarCompilation(slow_build, max_workers=1, max_compile_s=0.02)
    try:
        compilation.submit(constrained("early", "x"))
        time.sleep(0.1)  # past the limit while the compiler is still being built
        assert compilation.take_ready() == ([], [])
        built.set()
        compiler.open("x")
        _wait_until_done(compilation, 1)
        ready, failed = compilation.take_ready()
        assert [r.request_id for r in ready] == ["early"] and failed == []
    finally:
        built.set()
        compilation.shutdown()

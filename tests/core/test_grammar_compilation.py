"""Grammar compilation beside the engine loop: arrival order, failures, aborts."""

from __future__ import annotations

import threading
import time

import pytest

from tests.core.test_scheduler import make_request
from tokenmill.core.grammar_compilation import GrammarCompilation
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
    assert len(compilation) == 0 and workers and all(w.daemon for w in workers)
    compiler.open("held")

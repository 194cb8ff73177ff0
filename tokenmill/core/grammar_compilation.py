"""Grammar compilation beside the engine loop.

Compiling a structured-output constraint into a grammar matcher takes from under a
millisecond (a cached schema) to hundreds of milliseconds (a large JSON schema or grammar:
xgrammar builds a token mask cache over the whole vocabulary). Done on the engine loop, every
running request would wait for it: one new schema would stall every stream. So a request with
a constraint is compiled on a worker thread and held back from the scheduler until its
grammar is ready; the others are scheduled meanwhile (vLLM holds such requests in its
``WAITING_FOR_FSM`` state the same way). Requests whose grammars become ready are admitted in
the order they arrived.

A compile has a time limit (``MAX_COMPILE_S``). xgrammar's compile of an ambiguous pattern
grows steeply with its repetitions and cannot be interrupted, so past the limit the request
fails and its thread is replaced: the other constraints are not held up behind it. The old
thread ends when its compile does, its result unused.

Torch-free, like the rest of core/.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from tokenmill.core.engine_io import CONSTRAINT_FAILURE_PREFIX
from tokenmill.core.request import Request

logger = logging.getLogger(__name__)

# The longest a constraint may take to compile (s). Measured with xgrammar 0.2.9 on a 2-core
# CPU: ordinary schemas, regexes and grammars take under 0.1 s, but ".?" repeated 32 times
# took 4.6 s, 48 times 19 s, and ".*" repeated 1,000 times 75 s.
MAX_COMPILE_S = 5.0


class _Worker:
    """A compile thread; ``job`` is the future it is compiling and when it started."""

    def __init__(self) -> None:
        self.job: tuple[Future, float] | None = None
        self.retired = False
        self.thread: threading.Thread | None = None


class GrammarCompilation:
    """Requests whose grammars are being compiled, and the compiler they use.

    Args:
        build_compiler: builds the ``GrammarCompiler`` (loads the tokenizer and its
            vocabulary table, ~1 s); run once, on a thread of its own, at construction.
        max_workers: compile threads (default: half the CPUs, 1 to 4).
        max_compile_s: the time limit of one compile, in seconds.

    The threads are daemons: xgrammar's compile cannot be interrupted, and an engine that
    stops (or a request aborted mid-compile) must not wait for one. A request aborted
    before its compile starts is never compiled. Threads past their time limit still run
    until their compile ends; at most ``max_workers`` of them are replaced at a time, so that
    a client sending costly constraints cannot make the threads multiply.
    """

    def __init__(
        self,
        build_compiler: Callable[[], Any],
        max_workers: int | None = None,
        max_compile_s: float = MAX_COMPILE_S,
    ) -> None:
        self._compiler = _in_background(build_compiler)
        if max_workers is None:
            max_workers = min(4, max(1, (os.cpu_count() or 2) // 2))
        self._jobs: queue.SimpleQueue[tuple[Future, Any] | None] = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._overdue: list[_Worker] = []  # retired, still compiling
        self._max_workers = max_workers
        self._max_compile_s = max_compile_s
        # Insertion order is arrival order: ready requests are admitted in it.
        self._pending: dict[str, tuple[Request, Future]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def submit(self, request: Request) -> None:
        """Start compiling ``request``'s constraint (``sampling_params.structured_outputs``)."""
        self._top_up()
        future: Future = Future()
        self._jobs.put((future, request.sampling_params.structured_outputs))
        self._pending[request.request_id] = (request, future)

    def _top_up(self) -> None:
        """Start threads up to ``max_workers``, unless as many overdue ones still run."""
        self._overdue = [w for w in self._overdue if w.thread is not None and w.thread.is_alive()]
        while (
            len(self._workers) < self._max_workers
            and len(self._workers) + len(self._overdue) < 2 * self._max_workers
        ):
            worker = _Worker()
            worker.thread = threading.Thread(
                target=self._work, args=(worker,), name="tokenmill-grammar", daemon=True
            )
            worker.thread.start()
            self._workers.append(worker)

    def _work(self, worker: _Worker) -> None:
        while not worker.retired and (job := self._jobs.get()) is not None:
            future, constraint = job
            if not future.set_running_or_notify_cancel():
                continue  # aborted before its turn
            try:
                # Built once at start-up (seconds for a large vocabulary): not compile time.
                compiler = self._compiler.result()
            except BaseException as e:
                future.set_exception(e)
                continue
            worker.job = (future, time.monotonic())
            try:
                future.set_result(compiler.compile(constraint))
            except BaseException as e:  # the request fails, not the thread
                future.set_exception(e)
            worker.job = None

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, Exception]]]:
        """Requests whose compilation ended, in arrival order: those with their grammar set,
        and those whose constraint failed to compile (or ran past its time limit), with the
        error."""
        ready: list[Request] = []
        failed: list[tuple[Request, Exception]] = []
        overdue = self._retire_overdue()
        if self._pending and len(self._workers) < self._max_workers:
            self._top_up()  # an overdue thread may have ended since
        for req_id, (request, future) in list(self._pending.items()):
            if future in overdue:
                del self._pending[req_id]
                failed.append((request, CompileTimeout(self._max_compile_s)))
                continue
            if not future.done():
                continue
            del self._pending[req_id]
            error = future.exception()
            if error is None:
                request.grammar = future.result()
                ready.append(request)
            else:
                failed.append((request, error))
        return ready, failed

    def _retire_overdue(self) -> set[Future]:
        """The futures compiling past their time limit; their threads are retired: each ends
        with that compile, and ``_top_up`` replaces it."""
        now = time.monotonic()
        overdue: set[Future] = set()
        for worker in list(self._workers):
            job = worker.job
            if job is not None and now - job[1] > self._max_compile_s:
                worker.retired = True
                self._workers.remove(worker)
                self._overdue.append(worker)
                overdue.add(job[0])
        return overdue

    def wait_any(self, timeout_s: float) -> None:
        """Block until one compilation ends or ``timeout_s`` seconds pass."""
        if self._pending:
            wait([f for _, f in self._pending.values()], timeout_s, FIRST_COMPLETED)

    def discard(self, request_ids: Iterable[str]) -> None:
        """Forget requests (aborted while compiling): a compile not yet started is skipped,
        one under way finishes unused."""
        for req_id in request_ids:
            pending = self._pending.pop(req_id, None)
            if pending is not None:
                pending[1].cancel()

    def shutdown(self) -> None:
        """Drop every pending request and stop the threads once their compile ends."""
        for _, future in self._pending.values():
            future.cancel()
        self._pending.clear()
        for worker in self._workers:
            worker.retired = True
            self._jobs.put(None)
        self._workers = []


class CompileTimeout(Exception):
    """A constraint took longer than its time limit to compile."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(
            f"{CONSTRAINT_FAILURE_PREFIX} the constraint took more than {limit_s:g} s to "
            "compile (an ambiguous pattern, such as many optional or repeated parts in a row, "
            "makes compiling slow)."
        )


def _in_background(build: Callable[[], Any]) -> Future:
    """``build()`` run on a daemon thread; its result (or exception) in the future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(build())
        except BaseException as e:  # reported to whoever asks for the result
            future.set_exception(e)

    threading.Thread(target=run, name="tokenmill-grammar-compiler", daemon=True).start()
    return future

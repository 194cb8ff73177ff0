"""Grammar compilation beside the engine loop, bounded in time and in concurrency.

Compiling a structured-output constraint takes from under a millisecond (a cached schema) to
hundreds of milliseconds (a large JSON schema or grammar: xgrammar builds a token mask cache
over the whole vocabulary), and minutes for an ambiguous pattern (``".?"`` repeated 48 times:
~20 s). Done on the engine loop, every running request would wait for it. So a request with a
constraint is held back from the scheduler while worker processes compile it; the others are
scheduled meanwhile (vLLM holds such requests in its ``WAITING_FOR_FSM`` state the same way).
Requests whose grammars are ready are admitted in the order they arrived.

The bounds, whatever arrives at once:

- At most ``max_workers`` compiles run at a time, one per worker process (one thread each,
  at a lower CPU priority than the engine loop). Requests with the same constraint share one
  compile, and a constraint compiled before comes from the engine's cache at once.
- A request's constraint must compile within ``max_compile_s`` of its arrival (the clock
  starts once the first worker is up, so start-up is not counted). Past it, a compile under
  way is stopped by killing its worker (a fresh one takes its place) and the request fails
  with ``CompileTimeout`` (a 400); a request still queued fails with ``CompileBusy`` (a 429).
- At most ``max_queued`` distinct constraints wait for a worker; past that a new one fails
  at once with ``CompileBusy``.
- A request aborted while its constraint compiles stops that compile (its worker is killed)
  unless another request shares it.

One thread of the engine process (``tokenmill-grammar-compile``, for the engine's life) hands
constraints to idle workers, reads their answers and enforces the limits as they fall due, so
a compile's progress does not wait for the engine's steps (seconds each under load); the
engine takes the finished requests at its next step.

Torch-free, like the rest of core/.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from tokenmill.core import grammar_masks
from tokenmill.core.engine_io import CONSTRAINT_BUSY_PREFIX, CONSTRAINT_FAILURE_PREFIX
from tokenmill.core.grammar_workers import WorkerProcess
from tokenmill.core.request import Request

logger = logging.getLogger(__name__)

# The longest a constraint may take from its arrival to its compiled grammar (s). Measured
# with xgrammar 0.2.9 on a 2-core CPU: ordinary schemas, regexes and grammars take under
# 0.1 s, but ".?" repeated 32 times took 4.6 s, 48 times 19 s, and ".*" repeated 1,000 times
# 75 s.
MAX_COMPILE_S = 5.0
# Distinct constraints that may wait for a compile worker.
MAX_QUEUED = 64
# How long a process's exit waits for a grammar backend still being built (seconds).
BACKEND_EXIT_WAIT_S = 60.0
# Compile workers run at this nice value: the engine loop comes first.
WORKER_NICE = 10


def default_num_workers() -> int:
    """Half the CPUs, 1 to 4."""
    return min(4, max(1, (os.cpu_count() or 2) // 2))


@dataclass(eq=False)
class _Job:
    """One constraint to compile and the requests waiting for it (in arrival order)."""

    key: Any
    requests: list[Request]
    arrival: float  # time.monotonic() of its first request
    worker: WorkerProcess | None = None
    abandoned: bool = False  # every request aborted while it ran: the pump stops it


class GrammarCompilation:
    """Requests whose grammars are being compiled, and the worker processes that compile them.

    Args:
        build_backend: builds the ``GrammarBackend`` (loads the tokenizer and its vocabulary
            table, ~1 s); run once, on a thread of its own, at construction. The backend
            gives compile keys, cached grammars, and the grammar of a compile result (one
            that waits for the end of a reasoning section when the request's
            ``reasoning_end_token_ids`` say so: it compiles on arrival all the same).
        start_worker: starts a compile worker with the backend's ``worker_args``.
        max_workers: compiles at once (default: half the CPUs, 1 to 4).
        max_compile_s: the time limit of a request's compile, from its arrival, in seconds.
        max_queued: distinct constraints that may wait for a worker.
    """

    def __init__(
        self,
        build_backend: Callable[[], Any],
        start_worker: Callable[[tuple], WorkerProcess],
        max_workers: int | None = None,
        max_compile_s: float = MAX_COMPILE_S,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        self._backend = _in_background(build_backend)
        self._start_worker = start_worker
        self._max_workers = max_workers or default_num_workers()
        self._max_compile_s = max_compile_s
        self._max_queued = max_queued
        self._workers: list[WorkerProcess] = []
        self._busy: dict[WorkerProcess, _Job] = {}
        self._ready_at: float | None = None  # when the first worker came up
        self._unkeyed: list[tuple[Request, float]] = []  # arrived before the backend was built
        self._queued: dict[Any, _Job] = {}  # key -> job, in arrival order
        self._running: dict[Any, _Job] = {}
        self._pending: dict[str, _Job | None] = {}  # request id -> its job (None: unkeyed)
        self._done: list[Request] = []
        self._failed: list[tuple[Request, Exception]] = []
        self._next_job_id = 0
        self._closed = False
        # Everything above is shared by the engine's thread and the pump, under this.
        self._cond = threading.Condition()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._pump = threading.Thread(
            target=self._run_pump, name="tokenmill-grammar-compile", daemon=True
        )
        self._pump.start()

    def __len__(self) -> int:
        """Requests not yet handed back by ``take_ready``."""
        with self._cond:
            return len(self._pending) + len(self._done) + len(self._failed)

    @property
    def backend(self) -> Any:
        """The built backend (waits for it).

        Raises:
            Exception: the backend could not be built.
        """
        return self._backend.result()

    def __contains__(self, request_id: str) -> bool:
        with self._cond:
            return request_id in self._pending

    # ---- requests ----------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Start compiling ``request``'s constraint (``sampling_params.structured_outputs``);
        a full queue fails it at once (reported by ``take_ready``)."""
        with self._cond:
            if len(self._queued) + len(self._unkeyed) >= self._max_queued:
                error = CompileBusy(self._max_compile_s, queue_full=True)
                self._failed.append((request, error))
                return
            self._pending[request.request_id] = None
            self._unkeyed.append((request, time.monotonic()))
            self._key_arrivals()
        self._wake()

    def _key_arrivals(self) -> None:
        """Once the backend is built: each arrival joins the compile of its constraint, a new
        one, or is ready at once from the cache."""
        if not self._unkeyed or not self._backend.done():
            return
        try:
            backend = self._backend.result()
        except BaseException as e:  # no compiler: every constraint fails
            for request, _ in self._unkeyed:
                self._fail(request, e)
            self._unkeyed = []
            return
        arrivals, self._unkeyed = self._unkeyed, []
        for request, arrival in arrivals:
            key = backend.key(request.sampling_params.structured_outputs)
            job = self._running.get(key) or self._queued.get(key)
            if job is None:
                grammar = backend.cached(key, _reasoning_end(request))
                if grammar is not None:
                    del self._pending[request.request_id]
                    request.grammar = grammar
                    self._done.append(request)
                    continue
                job = self._queued[key] = _Job(key, [], arrival)
            job.requests.append(request)
            self._pending[request.request_id] = job

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, Exception]]]:
        """Requests whose compilation ended: those with their grammar set, in arrival order,
        and those that failed (their constraint does not compile, is too costly, took past
        the time limit, or found the queue full), with the error."""
        with self._cond:
            self._key_arrivals()
            done, self._done = self._done, []
            failed, self._failed = self._failed, []
        done.sort(key=lambda r: r.arrival_time)
        return done, failed

    def wait_any(self, timeout_s: float) -> None:
        """Block until a request's compilation ends or ``timeout_s`` passes."""
        with self._cond:
            if self._pending and not (self._done or self._failed):
                self._cond.wait(timeout_s)

    def discard(self, request_ids: Iterable[str]) -> None:
        """Forget requests (aborted while compiling). A compile no other request waits for
        is dropped from the queue, or stopped (its worker killed) if under way."""
        with self._cond:
            for req_id in request_ids:
                if req_id not in self._pending:
                    continue
                job = self._pending.pop(req_id)
                if job is None:
                    self._unkeyed = [(r, t) for r, t in self._unkeyed if r.request_id != req_id]
                    continue
                job.requests = [r for r in job.requests if r.request_id != req_id]
                if job.requests:
                    continue
                if self._queued.get(job.key) is job:
                    del self._queued[job.key]
                else:
                    job.abandoned = True  # the pump kills its worker
        self._wake()

    def shutdown(self) -> None:
        """Drop every pending request, kill the workers and stop the pump."""
        with self._cond:
            self._closed = True
            for worker in self._workers:
                worker.kill()
            self._workers, self._busy = [], {}
            self._pending.clear()
            self._unkeyed, self._queued, self._running = [], {}, {}
        self._wake()
        self._pump.join(5)

    # ---- the pump ----------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    def _run_pump(self) -> None:
        """Hand out constraints, read answers and enforce the limits until ``shutdown``."""
        while True:
            with self._cond:
                if self._closed:
                    self._wake_r.close()
                    self._wake_w.close()
                    return
                self._key_arrivals()
                self._collect()
                self._expire()
                self._dispatch()
                if self._done or self._failed:
                    self._cond.notify_all()
                conns = [w.conn for w in self._workers if w in self._busy or not w.ready]
                timeout = self._next_timeout()
            try:
                ready = wait([self._wake_r, *conns], timeout)
            except (OSError, ValueError):  # a worker's pipe closed meanwhile: look again
                continue
            if self._wake_r in ready:
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass

    def _next_timeout(self) -> float | None:
        """Seconds until the next limit falls due (None: nothing to time)."""
        if self._unkeyed and not self._backend.done():
            return 0.05  # the backend is still being built
        jobs = [*self._running.values(), *self._queued.values()]
        if not jobs or self._ready_at is None:
            return None if not jobs else 0.05
        due = min(max(j.arrival, self._ready_at) for j in jobs) + self._max_compile_s
        return max(0.0, due - time.monotonic()) + 0.001

    # ---- workers -----------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Start workers while constraints wait (up to ``max_workers``), and give each idle
        one the oldest waiting constraint."""
        if not self._queued or not self._backend.done() or self._backend.exception():
            return
        while len(self._workers) < min(self._max_workers, len(self._queued) + len(self._busy)):
            self._workers.append(self._start_worker(self._backend.result().worker_args))
        for worker in self._workers:
            if not self._queued:
                return
            if worker.ready and worker not in self._busy:
                key = next(iter(self._queued))
                job = self._queued.pop(key)
                self._next_job_id += 1
                if not worker.send(("compile", self._next_job_id, *key)):
                    self._queued[key] = job  # the worker is gone: _collect replaces it
                    continue
                job.worker = worker
                self._busy[worker] = job
                self._running[key] = job

    def _collect(self) -> None:
        """Read the workers' answers."""
        for worker in list(self._workers):
            while not worker.killed and worker.poll():
                message = worker.recv()
                if message is None:  # the worker died (crashed, or was killed by the OS)
                    job = self._busy.get(worker)
                    self._retire(worker)
                    if job is not None:
                        self._fail_job(job, RuntimeError("the grammar compile worker died"))
                    break
                if message[0] == "ready":
                    if self._ready_at is None:
                        self._ready_at = time.monotonic()
                    continue
                job = self._busy.pop(worker, None)
                if job is not None:
                    del self._running[job.key]
                    self._finish(job, message)

    def _finish(self, job: _Job, message: tuple) -> None:
        """A compile's answer: every request of ``job`` gets the grammar, or the error."""
        if message[0] == "error":
            self._fail_job(job, CompileError(message[2]))
            return
        _, _, text, first_mask, cpu_s = message
        max_cpu_s = grammar_masks.MAX_MASK_S
        if cpu_s > max_cpu_s:
            reason = grammar_masks.too_costly(
                f"{1e3 * cpu_s:,.0f} ms of CPU time", f"at most {1e3 * max_cpu_s:,.0f} ms; "
            )
            self._fail_job(job, CompileError(f"{CONSTRAINT_FAILURE_PREFIX} {reason}"))
            return
        backend = self._backend.result()
        backend.store(job.key, text, first_mask)
        for request in job.requests:
            self._pending.pop(request.request_id, None)
            request.grammar = backend.cached(job.key, _reasoning_end(request))
            self._done.append(request)

    def _expire(self) -> None:
        """Fail the requests past their time limit; kill the workers compiling for them, and
        those compiling for no request any more."""
        for job in list(self._running.values()):
            if job.abandoned and job.worker is not None:
                self._retire(job.worker)
        if self._ready_at is None:
            return
        now = time.monotonic()
        for job in list(self._running.values()):
            if now - max(job.arrival, self._ready_at) > self._max_compile_s:
                assert job.worker is not None
                self._retire(job.worker)
                self._fail_job(job, CompileTimeout(self._max_compile_s))
        for job in list(self._queued.values()):
            if now - max(job.arrival, self._ready_at) > self._max_compile_s:
                del self._queued[job.key]
                self._fail_job(job, CompileBusy(self._max_compile_s))

    def _retire(self, worker: WorkerProcess) -> None:
        """Kill ``worker`` (its compile stops at once); ``_dispatch`` starts another."""
        worker.kill()
        self._workers.remove(worker)
        job = self._busy.pop(worker, None)
        if job is not None:
            self._running.pop(job.key, None)

    def _fail_job(self, job: _Job, error: Exception) -> None:
        self._running.pop(job.key, None)
        for request in job.requests:
            self._fail(request, error)

    def _fail(self, request: Request, error: BaseException) -> None:
        if request.request_id in self._pending:
            del self._pending[request.request_id]
            error = error if isinstance(error, Exception) else RuntimeError(str(error))
            self._failed.append((request, error))


class CompileError(Exception):
    """A constraint failed to compile (the message is the client's error)."""


class CompileTimeout(Exception):
    """A constraint did not compile within its time limit."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(
            f"{CONSTRAINT_FAILURE_PREFIX} the constraint took more than {limit_s:g} s to "
            "compile (an ambiguous pattern, such as many optional or repeated parts in a row, "
            "makes compiling slow)."
        )


class CompileBusy(Exception):
    """The compile workers are busy with other constraints: retry later (a 429)."""

    def __init__(self, limit_s: float, queue_full: bool = False) -> None:
        why = (
            "too many other constraints are waiting to compile"
            if queue_full
            else f"the grammar compilers stayed busy with other constraints for {limit_s:g} s"
        )
        super().__init__(f"{CONSTRAINT_BUSY_PREFIX} {why}; retry later.")


def _reasoning_end(request: Request) -> list[int] | None:
    """The token ids after which ``request``'s constraint applies (None: from the start)."""
    return request.sampling_params.structured_outputs.reasoning_end_token_ids


def _in_background(build: Callable[[], Any]) -> Future:
    """``build()`` run on a daemon thread; its result (or exception) in the future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(build())
        except BaseException as e:  # reported to whoever asks for the result
            future.set_exception(e)

    thread = threading.Thread(target=run, name="tokenmill-grammar-backend", daemon=True)
    thread.start()
    # A process that exits while the build runs tears the grammar library's C++ state down
    # under it (std::terminate, exit status 134): exit waits for the build, a bounded time.
    atexit.register(thread.join, BACKEND_EXIT_WAIT_S)
    return future

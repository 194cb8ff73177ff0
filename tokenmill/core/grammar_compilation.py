"""Grammar compilation beside the engine loop.

Compiling a structured-output constraint into a grammar matcher takes from under a
millisecond (a cached schema) to hundreds of milliseconds (a large JSON schema or grammar:
xgrammar builds a token mask cache over the whole vocabulary). Done on the engine loop, every
running request would wait for it: one new schema would stall every stream. So a request with
a constraint is compiled on a worker thread and held back from the scheduler until its
grammar is ready; the others are scheduled meanwhile (vLLM holds such requests in its
``WAITING_FOR_FSM`` state the same way). Requests whose grammars become ready are admitted in
the order they arrived.

Torch-free, like the rest of core/.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from tokenmill.request import Request

logger = logging.getLogger(__name__)


class GrammarCompilation:
    """Requests whose grammars are being compiled, and the compiler they use.

    Args:
        build_compiler: builds the ``GrammarCompiler`` (loads the tokenizer and its
            vocabulary table, ~1 s); run once, on a thread of its own, at construction.
        max_workers: compile threads (default: half the CPUs, 1 to 4).

    The threads are daemons: xgrammar's compile cannot be interrupted, and an engine that
    stops (or a request aborted mid-compile) must not wait for one. A request aborted
    before its compile starts is never compiled.
    """

    def __init__(self, build_compiler: Callable[[], Any], max_workers: int | None = None) -> None:
        self._compiler = _in_background(build_compiler)
        if max_workers is None:
            max_workers = min(4, max(1, (os.cpu_count() or 2) // 2))
        self._jobs: queue.SimpleQueue[tuple[Future, Any] | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._max_workers = max_workers
        # Insertion order is arrival order: ready requests are admitted in it.
        self._pending: dict[str, tuple[Request, Future]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def submit(self, request: Request) -> None:
        """Start compiling ``request``'s constraint (``sampling_params.structured_outputs``)."""
        if not self._workers:
            for i in range(self._max_workers):
                worker = threading.Thread(
                    target=self._work, name=f"tokenmill-grammar-{i}", daemon=True
                )
                worker.start()
                self._workers.append(worker)
        future: Future = Future()
        self._jobs.put((future, request.sampling_params.structured_outputs))
        self._pending[request.request_id] = (request, future)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, constraint = job
            if not future.set_running_or_notify_cancel():
                continue  # aborted before its turn
            try:
                future.set_result(self._compiler.result().compile(constraint))
            except BaseException as e:  # the request fails, not the thread
                future.set_exception(e)

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, Exception]]]:
        """Requests whose compilation ended, in arrival order: those with their grammar set,
        and those whose constraint failed to compile, with the error."""
        ready: list[Request] = []
        failed: list[tuple[Request, Exception]] = []
        for req_id, (request, future) in list(self._pending.items()):
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
        for _ in self._workers:
            self._jobs.put(None)
        self._workers = []


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

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
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from tokenmill.request import Request

logger = logging.getLogger(__name__)


class GrammarCompilation:
    """Requests whose grammars are being compiled, and the compiler they use.

    Args:
        build_compiler: builds the ``GrammarCompiler`` (loads the tokenizer and its
            vocabulary table, ~1 s); run once, on a thread of its own, at construction.
        max_workers: compile threads (default: half the CPUs, 1 to 4).
    """

    def __init__(self, build_compiler: Callable[[], Any], max_workers: int | None = None) -> None:
        self._compiler = _in_background(build_compiler)
        if max_workers is None:
            max_workers = min(4, max(1, (os.cpu_count() or 2) // 2))
        self._pool: ThreadPoolExecutor | None = None
        self._max_workers = max_workers
        # Insertion order is arrival order: ready requests are admitted in it.
        self._pending: dict[str, tuple[Request, Future]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def submit(self, request: Request) -> None:
        """Start compiling ``request``'s constraint (``sampling_params.structured_outputs``)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_workers, "tokenmill-grammar")
        constraint = request.sampling_params.structured_outputs
        future = self._pool.submit(lambda: self._compiler.result().compile(constraint))
        self._pending[request.request_id] = (request, future)

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
        """Forget requests (aborted while compiling); their compilations finish unused."""
        for req_id in request_ids:
            self._pending.pop(req_id, None)

    def shutdown(self) -> None:
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


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

"""Token masks of structured-output requests, filled beside the engine loop within a bound.

Before a step samples a request with a constraint, its grammar's next-token mask is filled
(``RequestGrammar.token_bitmask``). That usually takes well under a millisecond, but an
ambiguous pattern can make a mask take seconds, and not necessarily from the start: the
regex ``z{30}`` followed by 270 copies of ``((a|b)*(c|d)*)*`` compiles and fills its first
mask in 0.1 s, then takes 22.9 s a mask once its z's are written (xgrammar 0.2.9, SmolLM2's
49,152 tokens, on CPU). Filled on the engine loop, every such mask stalls every stream.

So the masks are filled on worker threads (xgrammar releases the GIL while it fills one, so
they also fill in parallel), and the loop waits at most ``MAX_MASK_WALL_S`` for any one of
them. A request whose mask takes longer, or more than ``MAX_MASK_S`` of its thread's CPU
time, is given up: it finishes aborted, with the reason, and the others get their masks. A
fill cannot be interrupted: the thread of one given up finishes it unused and then exits,
and a new thread takes its place, unless ``max_retired`` such threads still run. Then the
live threads are not replaced until one of those ends, so that costly constraints sent
together cannot take more than ``max_workers + max_retired`` cores; the masks wait instead.
A constraint's first mask goes through a filler of its own as it compiles
(``GrammarCompiler.compile``), so a costly one is refused before it reaches the loop.

Torch-free, like the rest of core/.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# The longest the loop waits for one mask (wall seconds). Ordinary masks take under 1 ms;
# this leaves room for a busy machine, whose threads may wait for a core.
MAX_MASK_WALL_S = 0.25


def max_mask_cpu_s() -> float:
    """The most CPU time one mask may take (s): ``structured_output.MAX_MASK_S``, read at
    each fill, so that a change to it (tests lower it) applies at once."""
    from tokenmill import structured_output

    return structured_output.MAX_MASK_S


@dataclass(eq=False)
class _Batch:
    """One ``fill`` call: the fills neither done nor given up (changes under ``_cond``)."""

    pending: int


@dataclass(eq=False)
class _Fill:
    """One request's mask in one ``fill`` call; its fields change under ``_cond``."""

    req_id: str
    grammar: Any
    batch: _Batch
    started: float | None = None  # time.perf_counter() when a worker took it
    worker: _Worker | None = None
    mask: Any = None
    cpu_s: float = 0.0
    error: BaseException | None = None
    done: bool = False
    given_up: bool = False


@dataclass(eq=False)
class _Worker:
    retired: bool = False  # its fill was given up: it exits once that fill returns


class GrammarMaskFiller:
    """Fills the token masks of a step's constrained requests on worker threads.

    Args:
        max_workers: fill threads (default: half the CPUs, 1 to 4). Threads start with the
            first ``fill``; they are daemons, so a stuck fill never holds up an exit.
        max_wall_s: the longest ``fill`` waits for one mask (s).
        max_retired: threads still finishing a fill given up, beyond which the threads
            whose fills are given up are not replaced (default: ``max_workers``).

    Several threads may call ``fill`` at once.
    """

    def __init__(
        self,
        max_workers: int | None = None,
        max_wall_s: float = MAX_MASK_WALL_S,
        max_retired: int | None = None,
    ) -> None:
        if max_workers is None:
            max_workers = min(4, max(1, (os.cpu_count() or 2) // 2))
        self._max_workers = max_workers
        self._max_wall_s = max_wall_s
        self._max_retired = max_workers if max_retired is None else max_retired
        self._jobs: queue.SimpleQueue[_Fill | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._workers: list[_Worker] = []
        self._retired_running = 0
        self._closed = False

    def fill(self, grammars: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """The next-token masks of ``grammars`` (request id -> ``RequestGrammar``).

        Returns:
            ``(masks, given_up)``: the mask of each request whose fill ended within the
            bounds, and for each other request the reason it was given up (its fill took
            over ``max_wall_s`` of wall time or ``max_mask_cpu_s()`` of CPU time, or
            raised). A grammar given up must not be used again: a thread may still be
            filling its mask.

        Raises:
            RuntimeError: called after ``shutdown``.
        """
        if not grammars:
            return {}, {}
        batch = _Batch(len(grammars))
        fills = [_Fill(req_id, grammar, batch) for req_id, grammar in grammars.items()]
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar mask filler is shut down")
            self._start_workers()
            for f in fills:  # under the lock: ahead of any shutdown's stop marks
                self._jobs.put(f)
            # Woken when the last fill ends, else every quarter of the bound to give up the
            # fills past it (so each is given up within 1.25 times the bound of its start).
            while batch.pending:
                now = time.perf_counter()
                for f in fills:
                    if f.started is not None and not (f.done or f.given_up):
                        if now - f.started >= self._max_wall_s:
                            self._give_up(f)
                if batch.pending:
                    self._cond.wait(self._max_wall_s / 4)
        return self._results(fills)

    def _results(self, fills: list[_Fill]) -> tuple[dict[str, Any], dict[str, str]]:
        masks: dict[str, Any] = {}
        given_up: dict[str, str] = {}
        max_cpu = max_mask_cpu_s()
        for f in fills:
            if f.given_up:
                given_up[f.req_id] = _too_costly(f"over {1e3 * self._max_wall_s:,.0f} ms")
            elif f.error is not None:
                given_up[f.req_id] = f"the token mask failed: {f.error}"
            elif f.cpu_s > max_cpu:
                given_up[f.req_id] = _too_costly(
                    f"{1e3 * f.cpu_s:,.0f} ms of CPU time", f"at most {1e3 * max_cpu:,.0f} ms; "
                )
            else:
                masks[f.req_id] = f.mask
        for req_id, reason in given_up.items():
            logger.warning("request %s: %s", req_id, reason)
        return masks, given_up

    def _give_up(self, f: _Fill) -> None:
        """Called under ``_cond``: abandon ``f``'s fill and replace its thread."""
        f.given_up = True
        f.batch.pending -= 1
        assert f.worker is not None
        f.worker.retired = True
        self._workers.remove(f.worker)
        self._retired_running += 1
        self._start_workers()

    def _start_workers(self) -> None:
        """Called under ``_cond``: bring the live threads up to ``max_workers``, as far as
        the threads still finishing given-up fills leave room."""
        cap = self._max_workers + self._max_retired
        while (
            len(self._workers) < self._max_workers
            and len(self._workers) + self._retired_running < cap
        ):
            worker = _Worker()
            self._workers.append(worker)
            threading.Thread(
                target=self._work, args=(worker,), name="tokenmill-grammar-mask", daemon=True
            ).start()

    def _work(self, worker: _Worker) -> None:
        while not worker.retired and (f := self._jobs.get()) is not None:
            with self._cond:
                f.started, f.worker = time.perf_counter(), worker
            start = time.thread_time()
            try:
                mask, error = f.grammar.token_bitmask(), None
            except BaseException as e:  # the request fails, not the thread
                mask, error = None, e
            cpu_s = time.thread_time() - start
            with self._cond:
                if not f.given_up:
                    f.mask, f.error, f.cpu_s, f.done = mask, error, cpu_s, True
                    f.batch.pending -= 1
                    if not f.batch.pending:
                        self._cond.notify_all()
                elif worker.retired:
                    # Its place may have been left empty while it ran: fill it now.
                    self._retired_running -= 1
                    self._start_workers()

    def shutdown(self) -> None:
        """Stop the threads once their current fill ends; a ``fill`` under way still gets
        its masks. A thread that replaces one given up takes that one's stop mark, and one
        started when a given-up fill ends takes one of those left for it."""
        with self._cond:
            self._closed = True
            for _ in range(len(self._workers) + self._retired_running):
                self._jobs.put(None)  # behind every fill already queued


def _too_costly(took: str, bound: str = "") -> str:
    """The reason a request is given up: its mask ``took`` that long, past ``bound``."""
    return (
        f"the constraint is too costly to follow: a token mask took {took} ({bound}an "
        "ambiguous pattern, such as nested repetitions, makes masks slow)."
    )

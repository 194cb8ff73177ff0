"""Token masks of structured-output requests, filled in worker processes within a bound.

Before a step samples a request with a constraint, its grammar's next-token mask is filled.
That usually takes well under a millisecond, but an ambiguous pattern can make a mask take
seconds, and not necessarily from the start: the regex ``z{30}`` followed by 270 copies of
``((a|b)*(c|d)*)*`` compiles and fills its first mask in 0.1 s, then takes 22.9 s a mask once
its z's are written (xgrammar 0.2.9, SmolLM2's 49,152 tokens, on CPU). Filled on the engine
loop, every such mask would stall every stream; filled on a thread, a mask given up would
still burn a core until it ends.

So masks are filled by mask worker processes (``core/grammar_workers.py``). Each request
with a grammar has a home worker holding a copy of its matcher; each step the worker is told
the tokens accepted since its last fill and fills the mask. The loop waits at most
``max_wall_s`` for any one mask (from the moment its worker starts on it: a worker's start
and the rebuilding of a matcher, bounded by the grammar's size, do not count). A mask past that,
or past ``MAX_MASK_S`` of its worker's CPU time, gives its request up: it finishes aborted
with the reason. A worker past the wall bound is killed, so the fill stops at once; a fresh
worker takes its place, and the other requests it held move to a live worker, which rebuilds
their matchers from the compiled grammar and the tokens accepted so far.

Torch-free, like the rest of core/.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from tokenmill.core.grammar_workers import WorkerProcess

logger = logging.getLogger(__name__)

# The longest the loop waits for one mask (wall seconds). Ordinary masks take under 1 ms;
# this leaves room for a busy machine, whose workers may wait for a core.
MAX_MASK_WALL_S = 0.25
# The most CPU time one token mask may take (s). Every step that samples a request fills its
# mask, and the step waits for it, so an ambiguous pattern stalls every stream:
# ``((a|b)*(c|d)*)*`` repeated 270 times (4,050 characters, compiled in 40 ms) took 19.7 s per
# mask on CPU, 60 times 0.34 s; ordinary schemas, regexes and grammars take under 1 ms
# (SmolLM2's 49,152 tokens). The compile worker fills the first mask, and a constraint past
# this is refused there; a later mask past it aborts the request.
MAX_MASK_S = 0.05
# The longest a mask worker may take to come up or to rebuild the matchers it is given (s)
# before the requests it owes masks are given up.
WORKER_START_S = 30.0


@dataclass(eq=False)
class _MaskWorker:
    """A mask worker: the requests it holds matchers for, and the masks it owes this step
    (in the order it fills them) with when it started on the first of them."""

    process: WorkerProcess
    homes: set[str] = field(default_factory=set)
    owed: deque[str] = field(default_factory=deque)
    registering: int = 0  # matchers it is rebuilding (their time is not a mask's)
    clock: float | None = None  # when it started on owed[0] (None: not started yet)
    since: float = field(default_factory=time.monotonic)  # when the clock last stopped

    def restart_clock(self) -> None:
        """Time the next mask owed from now, once the worker is up and has its matchers."""
        now = time.monotonic()
        timed = self.owed and self.process.ready and not self.registering
        self.clock = now if timed else None
        self.since = now


class GrammarMaskFiller:
    """Fills the token masks of a step's constrained requests in worker processes.

    Args:
        start_worker: starts a mask worker (``grammar_runtime.serve_grammars``).
        max_workers: mask workers (default: half the CPUs, 1 to 4).
        max_wall_s: the longest ``fill`` waits for one mask (s).

    Grammars are ``RequestGrammar``-like: ``take_first_mask()`` (a mask known without a
    worker: the compile's first mask, or every token while an ``AfterReasoningGrammar``
    waits for the end of the reasoning; else None), ``accepted`` (the tokens the grammar
    accepted so far) and ``text`` (the compiled grammar, serialized). A request is given a
    home worker only when its first mask needs one. Only the engine loop calls ``fill``.
    """

    def __init__(
        self,
        start_worker: Callable[[], WorkerProcess],
        max_workers: int = 1,
        max_wall_s: float = MAX_MASK_WALL_S,
    ) -> None:
        self._start_worker = start_worker
        self._max_workers = max_workers
        self._max_wall_s = max_wall_s
        self._workers: list[_MaskWorker] = []
        # request id -> its home worker and the number of its tokens that worker has seen
        self._home: dict[str, tuple[_MaskWorker, int]] = {}

    def prepare(self) -> None:
        """Start the workers (a fork each, ~0.1 s), ahead of the first mask they fill."""
        while len(self._workers) < self._max_workers:
            self._workers.append(_MaskWorker(self._start_worker()))

    def fill(self, grammars: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """The next-token masks of ``grammars`` (request id -> grammar).

        Returns:
            ``(masks, given_up)``: the ``[ceil(V / 32)]`` int32 mask of each request whose
            fill ended within the bounds, and for each other request the reason it was given
            up (its fill took over ``max_wall_s`` of wall time or ``MAX_MASK_S`` of CPU
            time, or failed). A request given up must not be filled again.
        """
        masks: dict[str, Any] = {}
        given_up: dict[str, str] = {}
        todo: dict[_MaskWorker, list[str]] = {}
        for req_id, grammar in grammars.items():
            first = grammar.take_first_mask()
            if first is not None:  # the compile's, or all ones before a reasoning's end
                masks[req_id] = first
                continue
            worker = self._home_of(req_id, grammar)
            todo.setdefault(worker, []).append(req_id)
        for worker, req_ids in todo.items():
            self._send_fill(worker, req_ids, grammars)
        self._collect(grammars, masks, given_up)
        for req_id, reason in given_up.items():
            logger.warning("request %s: %s", req_id, reason)
            self._drop(req_id)
        return masks, given_up

    def forget(self, live: Container[str]) -> None:
        """Drop the matchers of the requests not in ``live`` (finished or aborted)."""
        for req_id in [r for r in self._home if r not in live]:
            self._drop(req_id)

    def shutdown(self) -> None:
        """Kill the workers."""
        for worker in self._workers:
            worker.process.kill()
        self._workers, self._home = [], {}

    # ---- internals ---------------------------------------------------------------------

    def _home_of(self, req_id: str, grammar: Any) -> _MaskWorker:
        """``req_id``'s worker; a request without one is given the least loaded, with its
        compiled grammar."""
        home = self._home.get(req_id)
        if home is not None:
            return home[0]
        self.prepare()
        worker = min(self._workers, key=lambda w: len(w.homes))
        worker.process.send(("register", req_id, grammar.text))
        worker.registering += 1
        worker.homes.add(req_id)
        self._home[req_id] = (worker, 0)
        return worker

    def _send_fill(self, worker: _MaskWorker, req_ids: list[str], grammars: Mapping) -> None:
        items = []
        for req_id in req_ids:
            accepted = grammars[req_id].accepted
            items.append((req_id, accepted[self._home[req_id][1] :]))
            self._home[req_id] = (worker, len(accepted))
        worker.process.send(("fill", items))
        start = not worker.owed
        worker.owed.extend(req_ids)
        if start:
            worker.restart_clock()

    def _collect(self, grammars: Mapping, masks: dict, given_up: dict[str, str]) -> None:
        """Read the masks owed; kill a worker past the bounds and move its requests."""
        while True:
            owing = [w for w in self._workers if w.owed]
            if not owing:
                return
            now = time.monotonic()
            deadlines = [
                w.clock + self._max_wall_s if w.clock is not None else w.since + WORKER_START_S
                for w in owing
            ]
            wait([w.process.conn for w in owing], max(0.0, min(deadlines) - now))
            for worker in owing:
                while worker.process.poll():
                    if not self._take(worker, masks, given_up, grammars):
                        break
            now = time.monotonic()
            for worker in [w for w in self._workers if w.owed]:
                if worker.clock is not None and now - worker.clock >= self._max_wall_s:
                    reason = too_costly(f"over {1e3 * self._max_wall_s:,.0f} ms")
                    self._replace(worker, reason, grammars, given_up)
                elif worker.clock is None and now - worker.since >= WORKER_START_S:
                    self._replace(worker, "the grammar mask worker did not start", grammars,
                                  given_up)  # fmt: skip

    def _take(self, worker: _MaskWorker, masks: dict, given_up: dict, grammars: Mapping) -> bool:
        """Handle one message of ``worker``; False once it is gone."""
        message = worker.process.recv()
        if message is None:
            self._replace(worker, "the grammar mask worker died", grammars, given_up)
            return False
        if message[0] == "registered":
            worker.registering -= 1
        if message[0] in ("ready", "registered"):
            worker.restart_clock()
            return True
        req_id = worker.owed.popleft()
        worker.restart_clock()
        if message[0] == "mask_error":
            given_up[req_id] = f"the token mask failed: {message[2]}"
            return True
        _, _, mask, cpu_s = message
        if cpu_s > MAX_MASK_S:
            given_up[req_id] = too_costly(
                f"{1e3 * cpu_s:,.0f} ms of CPU time", f"at most {1e3 * MAX_MASK_S:,.0f} ms; "
            )
        else:
            masks[req_id] = mask
        return True

    def _replace(self, worker: _MaskWorker, reason: str, grammars: Mapping, given_up: dict) -> None:
        """Kill ``worker``: the request it was filling is given up for ``reason``; the others
        it owed masks move to a fresh worker, as its other requests will when next filled."""
        worker.process.kill()
        self._workers.remove(worker)
        if worker.owed:
            given_up[worker.owed.popleft()] = reason
        for req_id in worker.homes:
            self._home.pop(req_id, None)
        self.prepare()
        moved = [r for r in worker.owed if r not in given_up]
        by_home: dict[_MaskWorker, list[str]] = {}
        for req_id in moved:
            by_home.setdefault(self._home_of(req_id, grammars[req_id]), []).append(req_id)
        for home, req_ids in by_home.items():
            self._send_fill(home, req_ids, grammars)

    def _drop(self, req_id: str) -> None:
        home = self._home.pop(req_id, None)
        if home is not None:
            home[0].homes.discard(req_id)
            home[0].process.send(("drop", [req_id]))


def too_costly(took: str, bound: str = "") -> str:
    """The reason a request is given up: its mask ``took`` that long, past ``bound``."""
    return (
        f"the constraint is too costly to follow: a token mask took {took} ({bound}an "
        "ambiguous pattern, such as nested repetitions, makes masks slow)."
    )

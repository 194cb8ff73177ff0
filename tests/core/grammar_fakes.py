"""A fake grammar worker and backend for the compile and mask pools' tests: real worker
processes whose work is told by the constraint's text or the request id.

Compile text ``"sleep:S"`` sleeps S seconds, ``"spin:S"`` burns S seconds of CPU, ``"bad"``
fails, anything else compiles at once. A fill of request id ``"sleep..."`` sleeps 60 s, of
``"spin..."`` burns 60 ms of CPU; every other mask is the array of the tokens accepted so far.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection

import numpy as np

from tokenmill.core.grammar_workers import WorkerProcess


def _spin(seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def fake_worker(conn: Connection) -> None:
    history: dict[str, list[int]] = {}
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        if message[0] == "compile":
            _, job, _, text, _ = message
            if text.startswith("sleep:"):
                time.sleep(float(text[6:]))
            elif text.startswith("spin:"):
                _spin(float(text[5:]))
            if text == "bad":
                conn.send(("error", job, "structured_outputs: the constraint does not compile"))
            else:
                conn.send(("compiled", job, text, np.array([os.getpid()]), 0.0))
        elif message[0] == "register":
            history[message[1]] = []
            conn.send(("registered", message[1]))
        elif message[0] == "fill":
            for req_id, tokens in message[1]:
                history[req_id] += tokens
                start = time.thread_time()
                if req_id.startswith("sleep"):
                    time.sleep(60)
                elif req_id.startswith("spin"):
                    _spin(0.06)
                mask = np.array(history[req_id] or [-1])
                conn.send(("mask", req_id, mask, time.thread_time() - start))
        elif message[0] == "drop":
            for req_id in message[1]:
                history.pop(req_id, None)


def start_fake_worker(args: tuple = ()) -> WorkerProcess:
    return WorkerProcess("tests.core.grammar_fakes:fake_worker", args)


class FakeBackend:
    """Keys are the regex text; a cached grammar is its compiled text."""

    worker_args: tuple = ()

    def __init__(self) -> None:
        self.cache: dict = {}

    def key(self, params) -> tuple:
        return ("regex", params.regex, True)

    def cached(self, key, reasoning_end_token_ids=None):
        return self.cache.get(key)

    def store(self, key, text, first_mask) -> None:
        self.cache[key] = f"grammar of {text}"


class FakeGrammar:
    """A grammar as the mask filler sees it."""

    def __init__(self, accepted: list[int] | None = None, first_mask=None) -> None:
        self.text = "compiled"
        self.accepted = accepted or []
        self._first = first_mask

    def take_first_mask(self):
        mask, self._first = self._first, None
        return mask


class _GatedConn:
    """The worker's end of the pipe, holding each compile until the file ``gate`` exists."""

    def __init__(self, conn: Connection, gate: str) -> None:
        self.conn, self.gate = conn, gate

    def recv(self):
        message = self.conn.recv()
        if message is not None and message[0] == "compile":
            while not os.path.exists(self.gate):
                time.sleep(0.01)
        return message

    def send(self, message) -> None:
        self.conn.send(message)


def gated_worker(conn: Connection, gate: str, *args) -> None:
    """The real grammar worker, whose compiles wait for the file ``gate``."""
    from tokenmill.grammar_runtime import serve_grammars

    serve_grammars(_GatedConn(conn, gate), *args)

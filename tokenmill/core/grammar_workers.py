"""Worker processes for grammar work that must be stoppable.

xgrammar's compiles and token-mask fills run in C++ and cannot be interrupted: a thread that
runs one past its time limit keeps its core busy until the work ends, minutes later for an
ambiguous pattern. So the engine core hands this work to worker processes and kills a worker
(SIGKILL) whose job runs past its limit: the work stops at once and a fresh process takes its
place (``core/grammar_compilation.py``, ``core/grammar_masks.py``).

Workers are forked from a fork server that has imported the grammar engine once (~2-5 s, at
the first worker), so a replacement is ready in ~0.1 s. Each worker talks to the engine over
one pipe (pickled tuples) and exits when the pipe closes, so none outlives its engine.

Torch-free, like the rest of core/: the worker's code is named by a ``"module:function"``
string and imported in the worker.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import types
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

# What the fork server imports before forking any worker: the grammar engine (and torch,
# which it imports), ~2-5 s once instead of at every worker's start.
FORKSERVER_PRELOAD = ["tokenmill.grammar_runtime"]
_context: Any = None


def _mp_context() -> Any:
    """The fork-server context (its server starts with the first worker); spawn where there
    is no fork server."""
    global _context
    if _context is None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(FORKSERVER_PRELOAD)
        else:
            _context = multiprocessing.get_context("spawn")
    return _context


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Hide ``__main__`` while a worker starts, so that the worker does not import it again.

    NOTE: multiprocessing re-runs the parent's main script in each child it starts (spawn or
    fork server); an offline script that builds an ``LLM`` without an ``if __name__ ==
    "__main__"`` guard would then run again in every grammar worker. The worker runs only
    tokenmill code, which never needs the parent's main module.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _entry(target: str, conn: Connection, args: tuple, nice: int) -> None:
    """A worker's first code: lower its priority, leave SIGINT to the engine, run ``target``."""
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)(conn, *args)


class WorkerProcess:
    """One worker process and the engine's end of its pipe.

    Args:
        target: ``"module:function"`` run in the worker as ``function(conn, *args)``; it
            sends ``("ready",)`` once it can take work, then answers messages until the pipe
            closes or it gets None.
        args: picklable arguments of ``target``.
        nice: added to the worker's nice value (lower CPU priority than the engine loop).

    Attributes:
        ready: the worker has sent ``("ready",)`` (set by ``recv``).
    """

    def __init__(self, target: str, args: tuple = (), nice: int = 0) -> None:
        ctx = _mp_context()
        self.conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_entry, args=(target, child, args, nice), name="tokenmill-grammar", daemon=True
        )
        with _main_module_hidden():
            self._process.start()
        child.close()
        self.ready = False
        self.killed = False

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def fileno(self) -> int:
        """The pipe's descriptor (for ``multiprocessing.connection.wait``)."""
        return self.conn.fileno()

    def send(self, message: Any) -> bool:
        """Send ``message``; False if the worker is gone."""
        try:
            self.conn.send(message)
            return True
        except (OSError, ValueError):
            return False

    def poll(self) -> bool:
        try:
            return self.conn.poll()
        except (OSError, ValueError):
            return True  # recv reports the failure

    def recv(self) -> Any:
        """The next message; None if the worker is gone. ``("ready",)`` sets ``ready``."""
        try:
            message = self.conn.recv()
        except (EOFError, OSError, ValueError):
            return None
        if message == ("ready",):
            self.ready = True
        return message

    def kill(self) -> None:
        """Stop the worker at once (SIGKILL) and close the pipe."""
        if self.killed:
            return
        self.killed = True
        try:
            self._process.kill()
            self._process.join(1.0)
        except (OSError, ValueError, AttributeError):
            pass
        self.conn.close()

    def close(self) -> None:
        """Ask the worker to exit; kill it if it has not within a second."""
        if self.killed:
            return
        self.send(None)
        self._process.join(1.0)
        self.kill()

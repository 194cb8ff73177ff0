"""Worker processes for grammar work that must be stoppable.

xgrammar's compiles and token-mask fills run in C++ and cannot be interrupted: a thread that
runs one past its time limit keeps its core busy until the work ends, minutes later for an
ambiguous pattern. So the engine core hands this work to worker processes and kills a worker
(SIGKILL) whose job runs past its limit: the work stops at once and a fresh process takes its
place (``core/grammar_compilation.py``, ``core/grammar_masks.py``).

Workers are forked by a fork server of their own (``python -m tokenmill.core.grammar_workers``)
that imports the grammar engine once (~2-5 s, at the first worker), so a replacement is ready
in ~0.1 s. The engine sends the server one end of a socket pair per worker (SCM_RIGHTS); the
worker talks to the engine over it (pickled tuples) and exits when it closes, as the server
does when the engine's end of its own socket closes, so none outlives its engine. (The
engine core runs in a daemonic process, which multiprocessing does not let start children,
and multiprocessing's own fork server would import the user's main script in each worker.)

Torch-free, like the rest of core/: the worker's code is named by a ``"module:function"``
string and imported in the worker.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, NoReturn

logger = logging.getLogger(__name__)

# What the fork server imports before forking any worker: the grammar engine (and torch,
# which it imports), ~2-5 s once instead of at every worker's start.
PRELOAD = "tokenmill.grammar_runtime"
_server: _ForkServer | None = None


class _ForkServer:
    """The engine's handle on the fork server: ``fork()`` gives a new worker's pid."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.core.grammar_workers", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._sock = ours

    def alive(self) -> bool:
        return self._proc.poll() is None

    def fork(self, worker_sock: socket.socket) -> int:
        socket.send_fds(self._sock, [b"f"], [worker_sock.fileno()])
        data = b""
        while len(data) < 4:
            chunk = self._sock.recv(4 - len(data))
            if not chunk:
                raise RuntimeError("the grammar fork server exited")
            data += chunk
        return struct.unpack("i", data)[0]


def _fork_server() -> _ForkServer:
    global _server
    if _server is None or not _server.alive():
        _server = _ForkServer()
    return _server


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
        ours, theirs = socket.socketpair()
        try:
            self.pid: int | None = _fork_server().fork(theirs)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send((target, args, nice))
        self.ready = False
        self.killed = False

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
        """Stop the worker at once (SIGKILL; the fork server reaps it) and close the pipe."""
        if self.killed:
            return
        self.killed = True
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.conn.close()


def exit_skipping_finalisation(code: int) -> NoReturn:
    """End a process that has loaded xgrammar once its own resources are closed: flush the
    logs and standard streams, then ``os._exit(code)``.

    NOTE: the interpreter's finalisation is skipped on purpose: xgrammar's C++ runtime may
    still hold joinable threads whose static destructors call std::terminate ("terminate
    called without an active exception") while the process exits."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- the fork server (its own process) -----------------------------------------------------


def _serve(control_fd: int) -> None:
    """Fork a worker for each socket the engine sends; exit when the engine's end closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # exited workers are reaped at once
    try:
        importlib.import_module(PRELOAD)
    except ImportError as e:  # each worker then fails to start, and says why
        logger.warning("grammar fork server: %s", e)
    control = socket.socket(fileno=control_fd)
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(control, 1, 1)
        except OSError:
            return
        if not fds:
            return
        pid = os.fork()
        if pid == 0:
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _run_worker(fds[0])
            os._exit(0)
        os.close(fds[0])
        control.sendall(struct.pack("i", pid))


def _run_worker(fd: int) -> None:
    """A worker's first code: read its target, lower its priority, run it."""
    conn = Connection(fd)
    try:
        target, args, nice = conn.recv()
    except (EOFError, OSError):
        return
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)(conn, *args)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
    exit_skipping_finalisation(0)  # xgrammar is preloaded here

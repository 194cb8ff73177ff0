"""How the API server stops: on SIGTERM/SIGINT (drain, then abort) and on the engine's death.

SIGTERM or SIGINT stops accepting connections and gives running requests
``--shutdown-timeout`` seconds (default 0) to finish; the rest are aborted (their clients get an
error, in the stream or as the response), then the engine is shut down and the process exits
with 0. A second signal exits at once (code 128 + signal number).

When the engine process dies, every running request fails with a 503 (an error event in a
stream) and /health answers 503; then, as vLLM's server does, the server stops accepting
connections, lets those responses end and exits with code 1, so that an orchestrator restarts
it. ``--keep-alive-on-engine-death`` keeps it running instead, answering 503 to every request
(vLLM's ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from typing import Any, NoReturn

import uvicorn

from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.embedding_engine import AsyncEmbeddingEngine

logger = logging.getLogger("tokenmill.entrypoints.openai.server")

# After the shutdown timeout has aborted the running requests, how long their responses may
# take to end before uvicorn cancels them (a client that stopped reading, say) (seconds).
ABORTED_RESPONSE_GRACE_S = 5
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# On a second stop signal, how long aborted streams get to send their error event (seconds).
ABORT_FLUSH_S = 0.2


class Server(uvicorn.Server):
    """uvicorn's server, leaving SIGTERM and SIGINT to GracefulShutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: uvicorn's own handlers end a drain that runs out of time by cancelling the
        # requests' tasks (truncated streams, a traceback each) and re-raise the signal once
        # done; GracefulShutdown aborts the requests in the engine instead.
        yield


class GracefulShutdown:
    """What SIGTERM and SIGINT do while the server runs.

    The first signal makes uvicorn stop accepting connections; running requests get
    ``timeout_s`` seconds to finish, then the rest are aborted, so their clients get an
    error (an error event and ``[DONE]`` in a stream, else the response) rather than wait.
    The server then returns from ``serve`` once every response has ended. A second signal
    exits the process at once.

    Args:
        server: the uvicorn server.
        engine: the engine, killed by a second signal.
        servings: the handlers whose running requests are aborted.
        timeout_s: grace period of running requests (seconds); 0 aborts them at once.
    """

    def __init__(
        self,
        server: uvicorn.Server,
        engine: AsyncLLM | AsyncEmbeddingEngine,
        servings: list[Any],
        timeout_s: float,
    ) -> None:
        self.server = server
        self.engine = engine
        self.servings = servings
        self.timeout_s = timeout_s
        self.stopping = False
        self._exit_signal: int | None = None  # a second signal came: exit, do not drain
        self._abort_task: asyncio.Task | None = None

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.on_signal, sig)

    def uninstall(self) -> None:
        """Leave the event loop: from now on (engine shutdown) a signal exits at once."""
        if self._exit_signal is not None:  # the responses ended before ABORT_FLUSH_S
            exit_now(self.engine, self._exit_signal)
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
            signal.signal(sig, lambda signum, _: exit_now(self.engine, signum))
        if self._abort_task is not None:
            self._abort_task.cancel()

    def num_running(self) -> int:
        return sum(s.num_running() for s in self.servings)

    def on_signal(self, signum: int) -> None:
        """First signal: stop accepting, abort what still runs after the grace period.
        Second: abort what runs and exit, after a moment for the aborts to reach clients."""
        if self.stopping:
            self._abort_running()
            self._exit_signal = signum
            loop = asyncio.get_running_loop()
            loop.call_later(ABORT_FLUSH_S, exit_now, self.engine, signum)
            return
        self.stopping = True
        logger.info(
            "%s: shutting down; not accepting new requests; %d running request(s) get %g s "
            "to finish (a second signal exits at once)",
            signal.Signals(signum).name,
            self.num_running(),
            self.timeout_s,
        )
        self.server.should_exit = True
        self._abort_task = asyncio.get_running_loop().create_task(self._abort_after_timeout())

    async def _abort_after_timeout(self) -> None:
        if self.timeout_s > 0:
            await asyncio.sleep(self.timeout_s)
        aborted = self._abort_running()
        if aborted:
            logger.warning(
                "Shutdown timeout (%g s) reached: aborted %d running request(s)",
                self.timeout_s,
                aborted,
            )

    def _abort_running(self) -> int:
        return sum(s.abort_running() for s in self.servings)


def exit_now(engine: AsyncLLM | AsyncEmbeddingEngine, signum: int) -> NoReturn:
    """End the process at once (a second stop signal): kill the engine process, exit with
    128 + ``signum``, without unwinding the running requests (no tracebacks)."""
    logger.warning("%s again: exiting now", signal.Signals(signum).name)
    for proc in getattr(engine, "engine_procs", []):  # every data-parallel engine core
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    with contextlib.suppress(Exception):
        engine.shutdown()  # sockets and the IPC folder (idempotent)
    logging.shutdown()
    os._exit(128 + signum)


def exit_on_engine_death(server: uvicorn.Server, engine: AsyncLLM) -> None:
    """Make ``server`` stop once ``engine`` dies: it stops accepting connections and returns
    from ``serve`` when the running responses (each failed with a 503) have ended."""

    def on_death(error: str) -> None:
        if engine.stopped_by_signal:
            logger.warning("The engine stopped (%s): the server exits", error)
        else:
            logger.error(
                "The engine died (%s): the server exits (--keep-alive-on-engine-death keeps "
                "it answering 503 instead)",
                error,
            )
        server.should_exit = True

    engine.add_death_callback(on_death)

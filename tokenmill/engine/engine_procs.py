"""The engine core processes behind one AsyncLLM: started (one per data-parallel rank,
``-dp N``), waited for until each reports its start-up, stopped, and their ZMQ sockets and
socket files released. Each core reads its own input socket; all push their outputs to one
socket of the front end.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from typing import Any

import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.engine import engine_core_proc
from tokenmill.engine.errors import EngineDeadError


@dataclasses.dataclass
class EngineProcs:
    """The started processes and the front end's ends of their sockets.

    Attributes:
        ipc_dir: the directory holding the socket files.
        zmq_ctx: the asyncio ZMQ context of the sockets.
        output_sock: PULL socket every core pushes its outputs to.
        procs: one process per data-parallel rank.
        input_socks: PUSH socket to each process, in rank order.
        ready_conns: the read end of each process's start-up pipe.
    """

    ipc_dir: str
    zmq_ctx: Any
    output_sock: Any
    procs: list[Any]
    input_socks: list[Any]
    ready_conns: list[Any]

    @classmethod
    def spawn(cls, config: EngineConfig) -> EngineProcs:
        """Start the engine core process, or one per data-parallel rank."""
        ipc_dir = tempfile.mkdtemp(prefix="tokenmill-")
        tag = uuid.uuid4().hex[:8]
        output_address = f"ipc://{ipc_dir}/out-{tag}"
        ctx = zmq.asyncio.Context()
        output_sock = ctx.socket(zmq.PULL)
        output_sock.bind(output_address)
        mp = multiprocessing.get_context("spawn")
        pc = config.parallel_config
        procs = cls(ipc_dir, ctx, output_sock, [], [], [])
        for rank in range(pc.data_parallel_size):
            input_address = f"ipc://{ipc_dir}/in-{tag}-{rank}"
            sock = ctx.socket(zmq.PUSH)
            sock.connect(input_address)
            rank_config = config
            if pc.data_parallel_size > 1:
                rank_config = dataclasses.replace(
                    config, parallel_config=dataclasses.replace(pc, data_parallel_rank=rank)
                )
            parent_conn, child_conn = mp.Pipe(duplex=False)
            proc = mp.Process(
                # Looked up at call time so that tests can stand in for the engine.
                target=engine_core_proc.run_engine_core,
                args=(rank_config, input_address, output_address, child_conn,
                      logging.getLogger().getEffectiveLevel()),
                name="tokenmill-engine-core" + (f"-dp{rank}" if pc.data_parallel_size > 1 else ""),
                daemon=True,
            )  # fmt: skip
            proc.start()
            child_conn.close()
            procs.procs.append(proc)
            procs.input_socks.append(sock)
            procs.ready_conns.append(parent_conn)
        return procs

    def wait_ready(self, timeout_s: float) -> list[dict[str, Any]]:
        """Every process's start-up report (``max_model_len``, ``num_blocks``, ...).

        Raises:
            EngineDeadError: a process exited, failed, or did not report in ``timeout_s``
                (every process is then killed).
        """
        deadline = time.monotonic() + timeout_s
        return [
            self._wait_for_one(proc, conn, deadline, timeout_s)
            for proc, conn in zip(self.procs, self.ready_conns, strict=True)
        ]

    def _wait_for_one(
        self, proc: Any, parent_conn: Any, deadline: float, timeout_s: float
    ) -> dict[str, Any]:
        while not parent_conn.poll(0.2):
            if not proc.is_alive():
                self.kill()
                raise EngineDeadError(
                    f"the engine process exited during start-up (exit code "
                    f"{proc.exitcode}); see its log above"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise EngineDeadError(f"the engine did not start within {timeout_s:.0f} s")
        try:
            info = parent_conn.recv()
        except EOFError:
            info = {"status": "failed", "error": "the engine process exited during start-up"}
        parent_conn.close()
        if info.get("status") != "ready":
            proc.join(timeout=5)
            self.kill()
            raise EngineDeadError(f"the engine failed to start: {info.get('error')}")
        return info

    def kill(self) -> None:
        """SIGKILL the processes still alive and reap them."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(2)

    def terminate(self, timeout_s: float) -> None:
        """SIGTERM every process, wait up to ``timeout_s`` in all, then kill the rest."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def release(self) -> None:
        """Close the sockets and the start-up pipes; remove the socket files."""
        for sock in self.input_socks:
            sock.close(linger=0)
        self.output_sock.close(linger=0)
        self.zmq_ctx.term()
        for conn in self.ready_conns:
            conn.close()
        for name in os.listdir(self.ipc_dir):
            try:
                os.unlink(os.path.join(self.ipc_dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self.ipc_dir)
        except OSError:
            pass

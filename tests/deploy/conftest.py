"""Shared pieces of the deployment tests: the CPU image's entrypoint run as three local
replicas of the embedded model (started once for the package), a router in front of them,
and the external programs (helm, chromium) the tests need.

The replicas run the CPU Dockerfile's ENTRYPOINT with its ENV, outside a container (no
container engine runs here): they are the image's entrypoint under test as well as the
router's backends and the dashboard's server.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.conftest import RemoteServer, free_port

REPO = Path(__file__).resolve().parents[2]
CPU_DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile.cpu"
# Small enough for three replicas on a 2-core CI machine.
REPLICA_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--max-num-seqs", "8"]
NUM_REPLICAS = 3


def require_tool(name: str) -> str:
    """The path of program ``name``; skip the test without it, but fail under CI (which
    installs it: scripts/install-deploy-tools.sh)."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (scripts/install-deploy-tools.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        pending += stripped[:-1] + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            keyword, _, rest = pending.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
            pending = ""
    return instructions


def image_entrypoint(path: Path) -> tuple[list[str], dict[str, str]]:
    """The final stage's ENTRYPOINT (exec form) and ENV of a Dockerfile."""
    entrypoint: list[str] = []
    env: dict[str, str] = {}
    for keyword, rest in dockerfile_instructions(path):
        if keyword == "FROM":
            entrypoint, env = [], {}
        elif keyword == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif keyword == "ENV":
            for item in rest.split():
                name, _, value = item.partition("=")
                env[name] = value
    return entrypoint, env


class EntrypointReplica(RemoteServer):
    """The CPU image's ENTRYPOINT + flags, with the image's ENV (paths moved to a temporary
    home, ``PATH`` kept: ``tokenmill`` comes from this virtualenv)."""

    def __init__(self, args: list[str], home: str) -> None:
        entrypoint, image_env = image_entrypoint(CPU_DOCKERFILE)
        assert entrypoint[:2] == ["tokenmill", "serve"], entrypoint
        self._image_env = {
            k: v.replace("/home/tokenmill", home) for k, v in image_env.items() if k != "PATH"
        }
        self._entrypoint = [os.path.join(os.path.dirname(sys.executable), entrypoint[0])]
        self._entrypoint += entrypoint[1:]
        super().__init__(args)

    def _start_command(self) -> tuple[list[str], dict[str, str]]:
        command = [*self._entrypoint, *self.args, "--host", "127.0.0.1", "--port", str(self.port)]
        return command, self._image_env


@pytest.fixture(scope="package")
def replicas() -> Iterator[list[RemoteServer]]:
    """Three replicas of the embedded model, started together."""
    home = tempfile.mkdtemp(prefix="tokenmill-home-")
    with ThreadPoolExecutor(NUM_REPLICAS) as pool:
        futures = [pool.submit(EntrypointReplica, REPLICA_ARGS, home) for _ in range(NUM_REPLICAS)]
        servers = [f.result() for f in futures]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(home, ignore_errors=True)


class RouterProcess:
    """``tokenmill router`` over ``backends`` on a free loopback port."""

    def __init__(self, backends: list[str], *extra: str) -> None:
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="tokenmill-router-", suffix=".log")  # noqa: SIM115
        command = [
            sys.executable, "-m", "tokenmill.entrypoints.cli.main", "router",
            *(a for url in backends for a in ("--backend", url)),
            "--host", "127.0.0.1", "--port", str(self.port), "--health-check-interval", "0.5",
            *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_text()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"router did not become healthy:\n{self.log_text()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


@pytest.fixture(scope="package")
def router(replicas) -> Iterator[RouterProcess]:
    process = RouterProcess([r.url for r in replicas])
    try:
        yield process
    finally:
        process.stop()

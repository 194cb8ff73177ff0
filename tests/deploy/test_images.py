"""The container images: their Dockerfiles, their entrypoint and health check run here, and
the CPU image built and checked where a container engine runs.

No container engine runs on the CI machines (``docker`` there is only a client): the
replicas of ``conftest.replicas`` run the CPU image's ENTRYPOINT with its ENV outside a
container, and the image's HEALTHCHECK command is run against one of them. Where
``docker info`` answers, ``test_cpu_image_builds_and_answers_health`` builds the image and
checks /health from the container.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import pytest

from tests.deploy.conftest import CPU_DOCKERFILE, REPO, dockerfile_instructions
from tests.entrypoints.conftest import free_port

CUDA_DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile.cuda"
PINNED = re.compile(r"^[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+$")


def final_stage(path) -> list[tuple[str, str]]:
    instructions = dockerfile_instructions(path)
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def healthcheck_command(path) -> list[str]:
    rest = next(r for k, r in final_stage(path) if k == "HEALTHCHECK")
    return json.loads(rest[rest.index("CMD") + len("CMD") :])


@pytest.mark.parametrize("path", [CPU_DOCKERFILE, CUDA_DOCKERFILE], ids=["cpu", "cuda"])
def test_dockerfile(path):
    stage = dict(final_stage(path))
    assert json.loads(stage["ENTRYPOINT"]) == ["tokenmill", "serve"]
    assert "CMD" not in stage  # `docker run IMAGE FLAGS...` passes the flags to serve
    assert stage["USER"].split(":")[0] == "1000"  # not root
    assert "--start-period" in stage["HEALTHCHECK"]
    assert any("/health" in part for part in healthcheck_command(path))
    text = path.read_text()
    for base in re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, re.MULTILINE):
        assert re.search(r":\d+\.\d+\.\d+-", base), f"base image not pinned: {base}"
    assert "torch==2.13.0" in text


def test_cuda_image_persists_the_triton_cache():
    stage = final_stage(CUDA_DOCKERFILE)
    env = " ".join(r for k, r in stage if k == "ENV")
    assert "TRITON_CACHE_DIR=/var/cache/tokenmill/triton" in env
    assert ("VOLUME", '["/var/cache/tokenmill"]') in stage
    assert "--ipc=host" in CUDA_DOCKERFILE.read_text()


@pytest.mark.parametrize("name", ["requirements-py311.lock", "requirements-py312.lock"])
def test_locks_pin_every_dependency(name):
    lines = (REPO / "deploy" / "docker" / name).read_text().splitlines()
    pins = [line for line in lines if line and not line.startswith("#")]
    assert all(PINNED.match(line) for line in pins), [p for p in pins if not PINNED.match(p)]
    names = {p.split("==")[0].lower() for p in pins}
    assert {"fastapi", "transformers", "xgrammar", "prometheus-client"} <= names
    assert not any(n.startswith(("torch", "nvidia-")) for n in names)


def test_dockerignore_keeps_the_context_small():
    rules = (REPO / ".dockerignore").read_text().splitlines()
    assert rules[1:2] == ["**"]  # everything out, then what the images copy back in
    assert {"!pyproject.toml", "!README.md", "!tokenmill/**", "!deploy/docker/**"} <= set(rules)


@pytest.mark.slow
def test_entrypoint_serves_and_passes_the_healthcheck(replicas):
    replica = next(r for r in replicas if r.proc.poll() is None)
    command = healthcheck_command(CPU_DOCKERFILE)
    assert command[0] == "python"
    script = command[-1].replace("127.0.0.1:8000", f"127.0.0.1:{replica.port}")
    result = subprocess.run([sys.executable, *command[1:-1], script], timeout=30)
    assert result.returncode == 0
    assert replica.get("/v1/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct"


def _container_engine() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    info = subprocess.run([docker, "info"], capture_output=True, timeout=30)
    return docker if info.returncode == 0 else None


@pytest.mark.slow
def test_cpu_image_builds_and_answers_health():
    docker = _container_engine()
    if docker is None:
        pytest.skip("no container engine runs here (docker info fails): image not built")
    tag = "tokenmill-test:cpu"
    build = [docker, "build", "-f", str(CPU_DOCKERFILE), "-t", tag, str(REPO)]
    subprocess.run(build, check=True, timeout=3600)
    port = free_port()
    run = [docker, "run", "-d", "--rm", "-p", f"127.0.0.1:{port}:8000", tag,
           "--max-model-len", "1024"]  # fmt: skip
    container = subprocess.run(run, check=True, capture_output=True, text=True).stdout.strip()
    try:
        import httpx

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("the container did not answer /health")
    finally:
        subprocess.run([docker, "stop", container], timeout=60)

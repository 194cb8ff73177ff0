"""Real servers for the API tests: ``tokenmill serve`` subprocesses on free loopback ports.

Each distinct server starts once per test session (a start costs ~15-20 s on a small CPU):

- ``default_server``: the embedded SmolLM2-135M-Instruct, as ``tokenmill serve`` serves it.
- ``no_template_server``: a tiny random Llama (``--load-format dummy``) whose tokenizer has no
  chat template.
- ``template_server``: the same tiny model with ``--chat-template FILE`` and ``--api-key``.

Tests that kill or stop a server start their own with ``RemoteServer`` directly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

API_KEY = "tokenmill-test-key"
# ``tokenmill serve`` as a subprocess command (append its arguments).
SERVE_COMMAND = [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve"]
TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """``python -m tokenmill.entrypoints.cli.main serve ARGS`` on a free loopback port.

    Args:
        args: the serve flags (model, engine and server flags).
        api_key: the key clients send (if the server was given one).

    Raises:
        RuntimeError: the server exited or did not answer /health in time (with its log).
    """

    # HTTPS servers (--ssl-certfile) set these: the scheme and httpx's ``verify`` (a CA file).
    scheme = "http"
    verify: Any = True

    def __init__(self, args: list[str], api_key: str | None = None) -> None:
        self.port = free_port()
        self.args = args
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (kept open for the process)
            prefix="tokenmill-server-", suffix=".log", delete=False
        )
        cmd, extra_env = self._start_command()
        env = {**os.environ, "TOKENMILL_CPU_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra_env}
        env.pop("TOKENMILL_API_KEY", None)
        # Own process group: if a test leaves it hanging, the group can be killed whole.
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _start_command(self) -> tuple[list[str], dict[str, str]]:
        """The command that starts the server, and environment variables it adds."""
        return [*SERVE_COMMAND, *self.args, "--host", "127.0.0.1", "--port", str(self.port)], {}

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.proc.returncode}:\n{self.log_text()}"
                )
            try:
                health = httpx.get(self.url + "/health", timeout=2.0, verify=self.verify)
                if health.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(
            f"server did not become healthy in {START_TIMEOUT_S} s:\n{self.log_text()}"
        )

    def log_text(self, tail_chars: int = 8000) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-tail_chars:]

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("timeout", 60.0)
        kwargs.setdefault("verify", self.verify)
        return httpx.get(self.url + path, headers=self.headers, **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("timeout", 120.0)
        kwargs.setdefault("verify", self.verify)
        headers = {**self.headers, **kwargs.pop("headers", {})}
        if body is not None:
            kwargs["json"] = body
        return httpx.post(self.url + path, headers=headers, **kwargs)

    def openai(self, **kwargs: Any):
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=self.api_key or "unused",
            max_retries=0,
            timeout=120.0,
            **kwargs,
        )

    def async_openai(self, **kwargs: Any):
        import openai

        return openai.AsyncOpenAI(
            base_url=self.url + "/v1",
            api_key=self.api_key or "unused",
            max_retries=0,
            timeout=120.0,
            **kwargs,
        )

    def metrics(self) -> dict[str, float]:
        """``{"name{label=value,...}": value}`` of the tokenmill: samples."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self.get("/metrics").text
        result = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.startswith("tokenmill:"):
                    continue
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name"
                )
                result[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return result

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (graceful), then SIGKILL to the process group if it does not exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


def server_fixture(args: list[str], api_key: str | None = None) -> Iterator[RemoteServer]:
    server = RemoteServer(args, api_key)
    try:
        yield server
    finally:
        code = server.stop()
        if code not in (0, None):
            print(f"server exited with {code}; log tail:\n{server.log_text()}")


# The default model, sized for the tests: 2k context and a 256 MiB KV cache (~5.8k tokens).
DEFAULT_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "256MiB"]


@pytest.fixture(scope="session")
def default_server() -> Iterator[RemoteServer]:
    yield from server_fixture(DEFAULT_ARGS)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """A 2-layer random Llama folder (config.json) with SmolLM2's tokenizer minus its chat
    template; served with ``--load-format dummy``."""
    path = tmp_path_factory.mktemp("tiny-llama")
    smollm2_tokenizer.save_pretrained(path)
    template_file = path / "chat_template.jinja"
    if template_file.exists():
        template_file.unlink()
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 49152,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "tie_word_embeddings": True,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "torch_dtype": "float32",
            }
        )
    )
    return str(path)


def tiny_args(model_dir: str) -> list[str]:
    return [model_dir, "--load-format", "dummy", "--kv-cache-memory", "32MiB"]


@pytest.fixture(scope="session")
def no_template_server(tiny_model_dir) -> Iterator[RemoteServer]:
    yield from server_fixture(tiny_args(tiny_model_dir))


@pytest.fixture(scope="session")
def chat_template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "chatml.jinja"
    path.write_text(TINY_TEMPLATE)
    return str(path)


@pytest.fixture(scope="session")
def template_server(tiny_model_dir, chat_template_file) -> Iterator[RemoteServer]:
    args = [*tiny_args(tiny_model_dir), "--chat-template", chat_template_file, "--api-key", API_KEY]
    yield from server_fixture(args, api_key=API_KEY)

"""Sleep mode over HTTP: /sleep, /is_sleeping, /wake_up and /update_weights on a server
started with --enable-sleep-mode; generation requests get a 503 while it sleeps, requests
in flight finish after it wakes with the tokens they would have had."""

from __future__ import annotations

import threading
import time

import pytest

from tests.entrypoints.conftest import RemoteServer, server_fixture

pytestmark = pytest.mark.slow

BODY = {"prompt": "The sea is", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def sleepy_server(tiny_llama_checkpoints):
    first, _ = tiny_llama_checkpoints
    yield from server_fixture([first, "--kv-cache-memory", "32MiB", "--enable-sleep-mode"])


def completion(server: RemoteServer, body=BODY) -> list[str]:
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return [c["text"] for c in r.json()["choices"]]


def test_sleep_and_wake_up(sleepy_server):
    server = sleepy_server
    before = completion(server)
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert server.post("/sleep?level=1").status_code == 200
    assert server.get("/is_sleeping").json() == {"is_sleeping": True}
    r = server.post("/v1/completions", BODY)
    assert r.status_code == 503
    assert "wake_up" in r.json()["error"]["message"]
    assert server.get("/health").status_code == 200
    assert server.post("/wake_up").status_code == 200
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert completion(server) == before


def test_wake_up_by_parts_and_bad_values(sleepy_server):
    server = sleepy_server
    assert server.post("/sleep?level=3").status_code == 400
    assert server.post("/sleep?level=2").status_code == 200
    assert server.post("/wake_up?tags=weights").status_code == 200
    assert server.get("/is_sleeping").json() == {"is_sleeping": True}
    r = server.post("/wake_up?tags=everything")
    assert r.status_code == 400 and "tags" in r.json()["error"]["message"]
    assert server.post("/wake_up?tags=kv_cache").status_code == 200
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert completion(server)


def test_update_weights(sleepy_server, tiny_llama_checkpoints):
    server = sleepy_server
    first, second = tiny_llama_checkpoints
    original = completion(server)
    assert server.post("/update_weights", {"model_path": second}).status_code == 200
    updated = completion(server)
    assert updated != original
    r = server.post("/update_weights", {"model_path": "/nonexistent/folder"})
    assert r.status_code == 400
    assert "no such file or directory" in r.json()["error"]["message"]
    assert completion(server) == updated  # a failed update leaves the weights as they were
    assert server.post("/update_weights", {"model_path": first}).status_code == 200
    assert completion(server) == original


def test_requests_in_flight_finish_after_wake_up(sleepy_server):
    server = sleepy_server
    body = {**BODY, "max_tokens": 200}
    expected = completion(server, body)
    result: dict = {}

    def run() -> None:
        result["texts"] = completion(server, body)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.3)
    assert server.post("/sleep?level=1").status_code == 200
    time.sleep(0.5)
    assert thread.is_alive() or result  # (finished before the sleep on a fast machine)
    assert server.post("/wake_up").status_code == 200
    thread.join(120)
    assert result["texts"] == expected


def test_sleep_mode_off(no_template_server):
    r = no_template_server.post("/sleep")
    assert r.status_code == 400
    assert "--enable-sleep-mode" in r.json()["error"]["message"]

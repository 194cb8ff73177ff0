"""AsyncLLM's start-up: the engine process starts before the front end loads its tokenizer;
when the tokenizer fails, the process is stopped and the sockets and their files released."""

from __future__ import annotations

import os
import tempfile
import time
from types import SimpleNamespace

import pytest

from tokenmill.config import ParallelConfig
from tokenmill.engine import async_llm, engine_core_proc


def idle_engine(*args) -> None:
    """Stands in for the engine process (a spawn target, so importable by name)."""
    time.sleep(60)


def test_tokenizer_failure_stops_the_engine_and_releases_its_sockets(monkeypatch, tmp_path):
    monkeypatch.setattr(engine_core_proc, "run_engine_core", idle_engine)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spawned = []
    spawn = async_llm.AsyncLLM._spawn_engine

    def spawn_and_record(self):
        spawn(self)
        spawned.append(self.engine_proc)

    def no_tokenizer(*args, **kwargs):
        assert spawned and spawned[0].is_alive()  # the engine started first
        raise OSError("no tokenizer here")

    monkeypatch.setattr(async_llm.AsyncLLM, "_spawn_engine", spawn_and_record)
    monkeypatch.setattr(async_llm, "get_tokenizer", no_tokenizer)
    config = SimpleNamespace(model_config=SimpleNamespace(model="m", tokenizer="m"),
                             parallel_config=ParallelConfig())
    with pytest.raises(OSError, match="no tokenizer"):
        async_llm.AsyncLLM(config)
    assert not spawned[0].is_alive()
    assert os.listdir(tmp_path) == []  # the socket directory is gone

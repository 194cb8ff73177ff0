"""A worker process of a tensor-parallel engine killed mid-generation (the mp executor,
offline): the generation fails with the engine's error within seconds, and every later
generation fails at once instead of waiting on requests the dead engine can never run."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.distributed.models import ENGINE, PROMPTS, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.executor.multiproc import WorkerDiedError

pytestmark = pytest.mark.slow


def _generate(llm: LLM, max_tokens: int, copies: int = 1) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS * copies], params, use_tqdm=False)


def test_killed_worker_fails_this_and_later_generations(tmp_path, smollm2_gguf_path):
    path = save_tiny_model("qwen3", tmp_path)
    llm = LLM(path, tokenizer=smollm2_gguf_path, tensor_parallel_size=2, **ENGINE)
    pid = llm.llm_engine.engine_core.executor.procs[1].pid
    killer = threading.Timer(1.0, lambda: os.kill(pid, signal.SIGKILL))
    try:
        _generate(llm, 6)
        killer.start()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            _generate(llm, 100, copies=4)
        assert time.monotonic() - start < 30.0
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            _generate(llm, 6)
        assert time.monotonic() - start < 5.0
    finally:
        killer.cancel()
        llm.llm_engine.shutdown()

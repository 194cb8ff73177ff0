"""A step that raises leaves the in-process engine dead, as vLLM's engine core: the call
that hit it gets the error, and every later call gets ``EngineDeadError`` at once instead
of spinning on requests that can never finish."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.errors import EngineDeadError


def test_a_failed_step_fails_every_later_call_at_once(tiny_llama_checkpoints, monkeypatch):
    llm = LLM(tiny_llama_checkpoints[0], kv_cache_memory=16 << 20, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8)
    assert llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids
    executor = llm.llm_engine.engine_core.executor

    def fail(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(executor, "execute_model", fail)
    with pytest.raises(RuntimeError, match="kernel exploded"):
        llm.generate(["Hello again"], params, use_tqdm=False)
    monkeypatch.undo()  # the executor works again; the engine's state is still unknown
    try:
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            llm.generate(["And again"], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()

"""use_beam_search on /v1/completions and /v1/chat/completions (vLLM's request fields): n
beams come back as n choices, best first, the same on every call."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_completions_beam_search(default_server):
    body = {
        "prompt": ["The capital of France is", "2 + 2 ="],
        "max_tokens": 6,
        "n": 3,
        "use_beam_search": True,
        "temperature": 0.7,  # no effect on beam search, as in vLLM
    }
    r = default_server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    choices = data["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    assert all(c["text"] and c["finish_reason"] in ("stop", "length") for c in choices)
    assert len({c["text"] for c in choices[:3]}) == 3  # distinct beams
    usage = data["usage"]
    assert usage["completion_tokens"] <= 6 * 6 and usage["prompt_tokens"] > 0
    again = default_server.post("/v1/completions", body).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in choices]


def test_completions_beam_search_with_length_penalty(default_server):
    body = {"prompt": "Once upon a time", "max_tokens": 5, "n": 2, "use_beam_search": True}
    plain = default_server.post("/v1/completions", body)
    penalised = default_server.post(
        "/v1/completions", {**body, "length_penalty": 0.0, "early_stopping": "never"}
    )
    assert plain.status_code == penalised.status_code == 200, penalised.text
    assert len(penalised.json()["choices"]) == 2


def test_chat_beam_search(default_server):
    body = {
        "messages": [{"role": "user", "content": "What is 2+2? Answer with a number only."}],
        "max_tokens": 12,
        "n": 2,
        "use_beam_search": True,
    }
    r = default_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c in choices:
        assert c["message"]["role"] == "assistant"
        assert "4" in c["message"]["content"]
        assert "<|im_end|>" not in c["message"]["content"]
    assert choices[0]["finish_reason"] == "stop"

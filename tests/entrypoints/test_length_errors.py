"""The context-length error names the fields the client sent: ``prompt`` for completions,
``max_completion_tokens`` when that is how the chat request gave its limit."""

from __future__ import annotations

MSG = [{"role": "user", "content": "Hello"}]


def test_completions_overflow_speaks_of_the_prompt(default_server):
    response = default_server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 8200})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_tokens"
    assert "in the prompt, 8200 in the completion" in error["message"]
    assert "messages" not in error["message"]


def test_chat_overflow_names_max_completion_tokens(default_server):
    body = {"messages": MSG, "max_completion_tokens": 8200}
    response = default_server.post("/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_completion_tokens"
    assert "in the messages, 8200 in the completion" in error["message"]
    legacy = default_server.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 8200})
    assert legacy.json()["error"]["param"] == "max_tokens"

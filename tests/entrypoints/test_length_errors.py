"""Requests too long for the context: the error gives the numbers and names the fields the
client sent (``prompt`` for completions, ``max_completion_tokens`` when that is how the chat
request gave its limit); a conversation too large for it is refused before its template runs."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"


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


def test_context_overflow_message_gives_the_numbers(default_server):
    num_prompt = default_server.post("/tokenize", {"messages": MSG}).json()["count"]
    response = default_server.post(CHAT, {"messages": MSG, "max_tokens": 2040})
    message = response.json()["error"]["message"]
    assert response.status_code == 400
    for number in (2048, num_prompt + 2040, num_prompt, 2040):
        assert str(number) in message


def test_a_conversation_too_large_for_the_context_is_refused_before_rendering(default_server):
    """More messages than the context (2,048 tokens) holds, or more characters than any text
    of it can be: a 400 before the template runs (600,000 messages took 13 s to render on the
    event loop, and every stream waited)."""
    many = [{"role": "user", "content": "hi"}] * 2049
    for path, body in (
        (CHAT, {"messages": many, "max_tokens": 1}),
        ("/tokenize", {"messages": many}),
    ):
        response = default_server.post(path, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages" and "2,049 messages" in error["message"]
    long = [
        {"role": "system", "content": "a" * 200_000},
        {"role": "user", "content": "b" * 200_000},
    ]
    response = default_server.post(CHAT, {"messages": long, "max_tokens": 1})
    assert (
        response.status_code == 400 and "400,000 characters" in response.json()["error"]["message"]
    )
    assert default_server.post(CHAT, {"messages": MSG, "max_tokens": 2}).status_code == 200

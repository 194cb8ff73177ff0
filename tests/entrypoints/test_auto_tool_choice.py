"""tool_choice "auto" behind ``--enable-auto-tool-choice --tool-call-parser hermes`` on the real
default model. SmolLM2 does not write tool calls by itself, so one request constrains its output
(a regex) to Hermes' markup: the real model then writes a call the real parser must read, whole
and streamed; without the constraint it answers in plain text, which passes through."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.conftest import DEFAULT_ARGS, server_fixture
from tests.entrypoints.test_chat_completions import MODEL, sse_events
from tests.entrypoints.test_tool_calling import ASK, TOOLS

pytestmark = pytest.mark.slow

HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
    r'"unit": "celsius"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def auto_server():
    yield from server_fixture(
        [*DEFAULT_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    )


def test_plain_answers_pass_through(auto_server):
    client = auto_server.openai()
    kwargs = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=16)
    plain = client.chat.completions.create(**kwargs)
    auto = client.chat.completions.create(**kwargs, tools=TOOLS, tool_choice="auto")
    assert auto.choices[0].message.content == plain.choices[0].message.content
    assert auto.choices[0].message.tool_calls == []
    assert auto.choices[0].finish_reason == plain.choices[0].finish_reason
    stream = client.chat.completions.create(**kwargs, tools=TOOLS, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == plain.choices[0].message.content


def test_a_call_in_hermes_markup_is_read(auto_server):
    body = {
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0,
        # Forced off its own distribution, the model spells the markup in short pieces (66
        # tokens for its ~90 characters): room for that, not a guess at its tokenization.
        "max_tokens": 160,
        "structured_outputs": {"regex": HERMES_CALL},
    }
    whole = auto_server.post("/v1/chat/completions", body).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert arguments["unit"] == "celsius" and arguments["city"] in ("Paris", "Rome")

    events = sse_events(auto_server, "/v1/chat/completions", {**body, "stream": True})
    names, pieces, content, finish = [], "", "", None
    for event in events[:-1]:
        delta = event["choices"][0]["delta"]
        content += delta.get("content") or ""
        for piece in delta.get("tool_calls") or []:
            if piece.get("function", {}).get("name"):
                names.append(piece["function"]["name"])
            pieces += piece.get("function", {}).get("arguments") or ""
        finish = event["choices"][0]["finish_reason"] or finish
    assert names == ["get_weather"] and json.loads(pieces) == arguments
    assert content == "" and finish == "tool_calls"


def test_responses_api_auto_default(auto_server):
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    response = auto_server.openai().responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=tools,
        max_output_tokens=12,
        temperature=0,
    )
    assert response.output_text and response.output[0].type == "message"

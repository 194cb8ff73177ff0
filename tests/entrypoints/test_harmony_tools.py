"""gpt-oss' tool calls (``--tool-call-parser openai``) through the server, on the real default
model: a request constrains its output (a regex) to a harmony message addressed to a
function, after an ``analysis`` message, and the parser reads the call out of the text the
server decoded with the markers kept, whole and streamed. (SmolLM2's tokenizer spells the
markers as plain text; gpt-oss' has them as special tokens, which the parser's
``skip_special_tokens: false`` keeps.)"""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.conftest import DEFAULT_ARGS, server_fixture
from tests.entrypoints.test_chat_completions import sse_events
from tests.entrypoints.test_tool_calling import ASK, TOOLS

pytestmark = pytest.mark.slow

HARMONY_CALL = (
    r"<\|channel\|>analysis<\|message\|>Weather\.<\|end\|><\|start\|>assistant<\|channel\|>"
    r"commentary to=functions\.get_weather <\|constrain\|>json<\|message\|>"
    r'\{"city": "(Paris|Rome)", "unit": "celsius"\}'
)


@pytest.fixture(scope="module")
def harmony_server():
    yield from server_fixture(
        [*DEFAULT_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "openai"]
    )


def test_a_harmony_call_is_read_whole_and_streamed(harmony_server):
    body = {
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 200,  # SmolLM2 spells the forced markers in pieces: ~110 tokens
        "structured_outputs": {"regex": HARMONY_CALL},
    }
    choice = harmony_server.post("/v1/chat/completions", body).json()["choices"][0]
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert arguments["unit"] == "celsius" and arguments["city"] in ("Paris", "Rome")

    events = sse_events(harmony_server, "/v1/chat/completions", {**body, "stream": True})
    names, pieces, content = [], "", ""
    for event in events[:-1]:
        delta = event["choices"][0]["delta"]
        content += delta.get("content") or ""
        for piece in delta.get("tool_calls") or []:
            if piece.get("function", {}).get("name"):
                names.append(piece["function"]["name"])
            pieces += piece.get("function", {}).get("arguments") or ""
    assert names == ["get_weather"] and json.loads(pieces) == arguments
    assert content == ""


def test_plain_answers_pass_through(harmony_server):
    client = harmony_server.openai()
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=ASK, temperature=0, max_tokens=16)
    answer = client.chat.completions.create(**kwargs, tools=TOOLS, tool_choice="auto")
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls == []

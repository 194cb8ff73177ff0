"""Tool calling on /v1/chat/completions against the real default model (SmolLM2-135M-Instruct):
``tool_choice`` "required" and a named function (forced by a grammar, so the small model calls
validly), streamed and not, a whole round trip with the openai SDK, and the 400s naming the
field at fault."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.entrypoints.test_chat_completions import MODEL, sse_events

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


def check_calls(calls: list[tuple[str, str]]) -> None:
    """Each (name, arguments) names a tool and its arguments validate against its schema."""
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forced_choices_return_valid_calls(default_server, choice):
    client = default_server.openai()
    result = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=60
    )
    choice_out = result.choices[0]
    calls = choice_out.message.tool_calls
    check_calls([(c.function.name, c.function.arguments) for c in calls])
    assert all(c.id.startswith("call_") for c in calls)
    assert choice_out.message.content is None
    if choice == "required":
        assert choice_out.finish_reason == "tool_calls"
    else:  # as OpenAI: forcing a function ends with "stop"
        assert [c.function.name for c in calls] == ["get_time"]
        assert choice_out.finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forced_choices_stream_as_openai_does(default_server, choice):
    events = sse_events(
        default_server,
        "/v1/chat/completions",
        {
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": choice,
            "temperature": 0,
            "max_tokens": 60,
            "stream": True,
        },
    )
    assert events[-1] == "[DONE]"
    calls: dict[int, dict] = {}
    finish = None
    for event in events[:-1]:
        choice_out = event["choices"][0]
        delta = choice_out["delta"]
        assert not delta.get("content")  # no markup or JSON leaks into the content
        for call in delta.get("tool_calls") or []:
            if call["index"] not in calls:
                assert call["id"] and call["type"] == "function"
                calls[call["index"]] = {"name": call["function"]["name"], "arguments": ""}
            else:
                assert "name" not in call.get("function", {}) and "id" not in call
            calls[call["index"]]["arguments"] += call["function"].get("arguments") or ""
        finish = choice_out["finish_reason"] or finish
    check_calls([(c["name"], c["arguments"]) for _, c in sorted(calls.items())])
    assert finish == ("tool_calls" if choice == "required" else "stop")


def test_one_call_without_parallel_tool_calls(default_server):
    result = default_server.openai().chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    assert len(result.choices[0].message.tool_calls) == 1


def test_round_trip_with_the_openai_sdk(default_server):
    """Call, run the tool, send the result back, get the answer: the template renders the
    assistant's call and the tool message."""
    client = default_server.openai()
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"},
    ]
    second = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=30,
    )
    assert second.choices[0].message.content
    assert second.choices[0].message.tool_calls == []
    rendered = default_server.post(
        "/tokenize", {"messages": messages, "return_token_strs": False}
    ).json()
    assert rendered["count"] > 0


def test_tool_choice_none_answers_in_text(default_server):
    result = default_server.openai().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    )
    assert result.choices[0].message.content and result.choices[0].message.tool_calls == []


BAD = [
    # tool_choice "auto" (the default with tools) without --enable-auto-tool-choice.
    ({"tools": TOOLS}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
    (
        {
            "tools": [
                TOOLS[0],
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"a": {"allOf": [{"type": "string"}]}},
                        },
                    },
                },
            ],
            "tool_choice": "required",
        },
        "tools.1.function.parameters",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "pattern": "(?=x)"}},
                        },
                    },
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tools.0.function.parameters",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "bad name!"}}],
            "tool_choice": "required",
        },
        "tools.0.function.name",
    ),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize("extra,param", BAD)
def test_bad_tool_requests_are_400s_naming_the_field(default_server, extra, param):
    response = default_server.post(
        "/v1/chat/completions", {"messages": ASK, "max_tokens": 5, **extra}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize(
    "messages,param",
    [
        (
            [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "22"}],
            "messages.1.tool_call_id",
        ),
        (
            [
                *ASK,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": "not json"},
                        }
                    ],
                },
            ],
            "messages.1.tool_calls.0.function.arguments",
        ),
    ],
)
def test_tool_messages_must_match_their_calls(default_server, messages, param):
    response = default_server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 5})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param

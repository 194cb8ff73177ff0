"""/v1/responses (the OpenAI Responses API) against the real default model, with the official
``openai`` SDK and the ``openai-agents`` SDK: text, instructions, ``previous_response_id``
and ``store``, a function-call round trip, streaming events, and 400s naming the field."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.entrypoints.test_chat_completions import MODEL
from tests.entrypoints.test_tool_calling import WEATHER

pytestmark = pytest.mark.slow

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}
]


def test_text_answer_with_instructions_and_usage(default_server):
    client = default_server.openai()
    response = client.responses.create(
        model=MODEL,
        input="What is the capital of France?",
        instructions="Answer in one short sentence.",
        max_output_tokens=24,
        temperature=0,
    )
    assert response.status in ("completed", "incomplete")
    assert response.output_text and response.output[0].type == "message"
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    cut = client.responses.create(model=MODEL, input="Tell me a long story.",
                                  max_output_tokens=3, temperature=0)  # fmt: skip
    assert cut.status == "incomplete" and cut.output[-1].status == "incomplete"
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_previous_response_id_continues_the_conversation(default_server):
    client = default_server.openai()
    first = client.responses.create(
        model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    second = client.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    tokens_alone = client.responses.create(
        model=MODEL, input="What is my name?", max_output_tokens=8, temperature=0
    )
    # The follow-up's prompt holds the first exchange.
    assert second.usage.input_tokens > tokens_alone.usage.input_tokens + first.usage.output_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=MODEL, input="Again?", previous_response_id=first.id, max_output_tokens=4
        )
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_call_round_trip(default_server):
    client = default_server.openai()
    response = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    arguments = json.loads(calls[0].arguments)
    assert set(arguments) == {"city", "unit"}
    follow_up = client.responses.create(
        model=MODEL,
        previous_response_id=response.id,
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 degrees"}
        ],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=16,
        temperature=0,
    )
    assert follow_up.output_text
    # The same turn given in full, without the store.
    replay = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 degrees"},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=16,
        temperature=0,
        store=False,
    )
    assert replay.output_text == follow_up.output_text


def test_text_format_json_schema(default_server):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    response = default_server.openai().responses.create(
        model=MODEL,
        input="Name a city as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
        max_output_tokens=30,
        temperature=0,
    )
    assert set(json.loads(response.output_text)) == {"city"}


def test_streamed_events(default_server):
    client = default_server.openai()
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == done.arguments == final.output[0].arguments
    json.loads(pieces)
    with client.responses.stream(
        model=MODEL, input="Say hi.", max_output_tokens=10, temperature=0
    ) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert text == stream.get_final_response().output_text


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_sdk_calls_a_function_tool(default_server, api):
    """One turn of an Agents SDK agent, on the Responses API or on chat completions: the
    model calls the tool, the tool's output ends it."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        cities.append(city)
        return f"Sunny in {city}"

    async def run() -> str:
        client = default_server.async_openai()
        agent = Agent(
            name="weather",
            instructions="Use the tool.",
            tools=[get_weather],
            model=(OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel)(
                model=MODEL, openai_client=client
            ),
            model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
            tool_use_behavior="stop_on_first_tool",
        )
        result = await Runner.run(agent, "What is the weather in Paris?")
        await client.close()
        return result.final_output

    output = asyncio.run(run())
    assert len(cities) == 1 and output == f"Sunny in {cities[0]}"


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        (  # a text-only model takes no images
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input.0.content.0.image_url",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"},
                                                    {"type": "input_file", "file_id": "f"}]}]},
            "input.0.content.1.type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "input",
        ),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"truncation": "auto"}, "truncation"),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#"}}}},
         "text.format"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # SmolLM2's template
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ],
)
def test_unsupported_or_bad_fields_are_400s_naming_the_field(default_server, extra, param):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **extra}
    response = default_server.post("/v1/responses", body)
    expected = 404 if param == "previous_response_id" else 400
    assert response.status_code == expected, response.text
    assert response.json()["error"]["param"] == param


def test_a_missing_input_is_a_400(default_server):
    response = httpx.post(default_server.url + "/v1/responses", json={"model": MODEL})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"


def test_a_streamed_call_cut_by_max_output_tokens_is_incomplete_and_continuable(default_server):
    """A forced call that max_output_tokens cuts is an incomplete item, and the stored
    response still continues (the cut call is not part of the conversation)."""
    client = default_server.openai()
    with client.responses.stream(
        model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
        tool_choice="required", max_output_tokens=20, temperature=0,
    ) as stream:
        streamed = stream.get_final_response()
    response = client.responses.retrieve(streamed.id)  # as stored (response.completed's body)
    assert response.status == "incomplete"
    assert response.output[-1].type == "function_call"
    assert response.output[-1].status == "incomplete"
    follow_up = client.responses.create(
        model=MODEL, previous_response_id=response.id, input="Go on.", max_output_tokens=4,
        temperature=0,
    )
    assert follow_up.status in ("completed", "incomplete")

"""/v1/messages (Anthropic's Messages API) against the real default model with the official
``anthropic`` SDK: text, a system prompt, streaming events, a tool_use round trip, token
counting, and errors in Anthropic's shape (a missing ``max_tokens``, an unknown block, a
missing key given as ``x-api-key``)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.entrypoints.conftest import API_KEY
from tests.entrypoints.test_chat_completions import MODEL
from tests.entrypoints.test_load import _settle, assert_idle
from tests.entrypoints.test_tool_calling import WEATHER

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}  # sent as extra_body: newer SDKs leave temperature out
TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.url, api_key=server.api_key or "unused", max_retries=0, timeout=120.0
    )


def test_text_with_a_system_prompt(default_server):
    message = client(default_server).messages.create(
        model=MODEL,
        max_tokens=20,
        system="Answer in one short sentence.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]}],
        extra_body=GREEDY,
    )
    assert message.role == "assistant" and message.type == "message"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= 20 and message.usage.input_tokens > 0


def test_stream_equals_the_whole_answer(default_server):
    anth = client(default_server)
    kwargs = dict(
        model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi!"}], extra_body=GREEDY
    )
    whole = anth.messages.create(**kwargs)
    with anth.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences(default_server):
    message = client(default_server).messages.create(
        model=MODEL,
        max_tokens=40,
        messages=[{"role": "user", "content": "Count: 1, 2, 3,"}],
        stop_sequences=[","],
        extra_body=GREEDY,
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == ","


def test_tool_use_round_trip(default_server):
    anth = client(default_server)
    first = anth.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use"
    use = next(block for block in first.content if block.type == "tool_use")
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    second = anth.messages.create(
        model=MODEL,
        max_tokens=20,
        messages=[
            *ASK,
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "22 degrees"}
                ],
            },
        ],
        tools=TOOLS,
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert second.content[0].type == "text" and second.stop_reason in ("end_turn", "max_tokens")


def test_streamed_tool_use(default_server):
    with client(default_server).messages.stream(
        model=MODEL,
        max_tokens=60,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    assert json.loads(partial) == final.content[0].input
    assert final.content[0].id.startswith("toolu_")
    jsonschema.validate(final.content[0].input, WEATHER)


def test_count_tokens(default_server):
    count = client(default_server).messages.count_tokens(model=MODEL, messages=ASK)
    message = client(default_server).messages.create(
        model=MODEL, max_tokens=1, messages=ASK, extra_body=GREEDY
    )
    assert count.input_tokens == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0
    )


@pytest.mark.parametrize(
    "body,field",
    [
        ({"model": MODEL, "messages": ASK}, "max_tokens"),
        ({"model": MODEL, "messages": ASK, "max_tokens": "5"}, "max_tokens"),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "x"}}],
                    }
                ],
            },
            "messages.0.content.0",  # a text-only model takes no images
        ),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
         "messages.0.content.0.source.type"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/tiff",
                                         "data": "AA=="}}]}]},
         "messages.0.content.0.source.media_type"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "data": "x"}}]}]},
         "messages.0.content.0.type"),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": [
                    *ASK,
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}
                        ],
                    },
                ],
            },
            "messages.1.content.0.tool_use_id",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": ASK,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools.0.type",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "tool_choice",
        ),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tools": [{"name": "f"}]},
         "tools.0.input_schema"),
        ({"model": MODEL, "max_tokens": 5, "messages": ASK,
          "tools": [{"name": "f", "input_schema": "bad"}]}, "tools.0.input_schema"),
    ],
)
def test_bad_requests_answer_in_anthropics_shape(default_server, body, field):
    response = httpx.post(default_server.url + "/v1/messages", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(field), error


def test_sdk_errors_are_typed(default_server):
    with pytest.raises(anthropic.NotFoundError):
        client(default_server).messages.create(model="claude-x", max_tokens=5, messages=ASK)
    with pytest.raises(anthropic.BadRequestError):
        client(default_server).messages.create(model=MODEL, max_tokens=0, messages=ASK)


def test_the_api_key_as_x_api_key(template_server):
    """Anthropic's clients send the key as x-api-key; without it, a 401 in its shape."""
    body = {
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}],
        "model": template_server.get("/v1/models").json()["data"][0]["id"],
    }
    denied = httpx.post(template_server.url + "/v1/messages", json=body, timeout=60)
    assert denied.status_code == 401
    assert denied.json()["error"]["type"] == "authentication_error"
    allowed = httpx.post(
        template_server.url + "/v1/messages",
        json=body,
        headers={"x-api-key": API_KEY},
        timeout=60,
    )
    assert allowed.status_code == 200, allowed.text
    wrong = httpx.post(
        template_server.url + "/v1/models", headers={"x-api-key": "wrong"}, timeout=60
    )
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/responses", {"input": "Tell me a very long story.", "max_output_tokens": 1500}),
        (
            "/v1/messages",
            {"model": MODEL, "max_tokens": 1500,
             "messages": [{"role": "user", "content": "Tell me a very long story."}]},
        ),
    ],
)
def test_a_client_leaving_a_stream_aborts_its_request(default_server, path, body):
    """Both APIs' streams stop their generation when the client goes away (KV blocks freed)."""
    with httpx.stream(
        "POST", default_server.url + path, json={**body, "stream": True}, timeout=120.0
    ) as response:
        assert response.status_code == 200
        for i, _ in enumerate(response.iter_lines()):
            if i == 12:
                break  # leaving the block closes the connection
    _settle(default_server)
    assert_idle(default_server)

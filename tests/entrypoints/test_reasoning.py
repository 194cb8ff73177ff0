"""``--reasoning-parser deepseek_r1`` on the real default model, with a chat template that opens
the thinking in the prompt (``<think>``) unless ``enable_thinking`` is false, which closes it
(``<think></think>``), as thinking models' templates do. SmolLM2 never closes the thinking by
itself, so a request that thinks is all reasoning (and the structured output waits for the
thinking's end); one that does not is all answer, and a
structured output applies to it."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.conftest import DEFAULT_ARGS, server_fixture
from tests.entrypoints.test_chat_completions import MODEL, sse_events

pytestmark = pytest.mark.slow

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("think") / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    args = [*DEFAULT_ARGS, "--reasoning-parser", "deepseek_r1", "--chat-template", str(template)]
    yield from server_fixture(args)


def test_thinking_is_reasoning_content_streamed_as_its_own_deltas(reasoning_server):
    body = {"messages": ASK, "temperature": 0, "max_tokens": 16}
    whole = reasoning_server.post("/v1/chat/completions", body).json()["choices"][0]
    assert whole["message"]["reasoning_content"] and whole["message"]["content"] is None
    events = sse_events(reasoning_server, "/v1/chat/completions", {**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert reasoning == whole["message"]["reasoning_content"]
    assert not any(d.get("content") for d in deltas[1:])


def test_thinking_off_gives_the_answer(reasoning_server):
    body = {"messages": ASK, "temperature": 0, "max_tokens": 16, **NO_THINKING}
    message = reasoning_server.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["content"] and message["reasoning_content"] is None


def test_structured_output_applies_to_the_answer(reasoning_server):
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    body = {"messages": ASK, "temperature": 0, "max_tokens": 30, "response_format": fmt}
    answer = reasoning_server.post("/v1/chat/completions", {**body, **NO_THINKING}).json()
    assert isinstance(json.loads(answer["choices"][0]["message"]["content"])["sum"], int)
    # While it thinks the output is free: the thinking is the unconstrained one (SmolLM2 never
    # closes it, so the constraint never starts).
    thinking = reasoning_server.post("/v1/chat/completions", body).json()["choices"][0]
    del body["response_format"]
    free = reasoning_server.post("/v1/chat/completions", body).json()["choices"][0]
    assert thinking["message"]["reasoning_content"] == free["message"]["reasoning_content"]
    assert thinking["message"]["reasoning_content"] and thinking["message"]["content"] is None


def test_responses_and_messages_carry_the_reasoning(reasoning_server):
    with reasoning_server.openai().responses.stream(
        model=MODEL, input="What is 2 + 2?", max_output_tokens=12, temperature=0
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
        final = stream.get_final_response()
    assert final.output[0].type == "reasoning"
    assert final.output[0].content[0].text == deltas != ""
    import anthropic

    message = anthropic.Anthropic(base_url=reasoning_server.url, api_key="unused").messages.create(
        model=MODEL,
        max_tokens=12,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 8},
        extra_body={"temperature": 0},
    )
    assert message.content[0].type == "thinking" and message.content[0].thinking

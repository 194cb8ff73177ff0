"""What gpt-oss' chat template reads from a request, rendered without a server (SmolLM2's
tokenizer, a template with the harmony parts that matter here):

- ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses): the template's
  ``reasoning_effort`` variable, which gpt-oss' template writes into its system message; a
  400 for a template that does not read it and for a value OpenAI does not define.
- an assistant's past ``reasoning_content``: the template's ``message.thinking``, the
  analysis message before that turn's tool call.
"""

from __future__ import annotations

import pytest

from tokenmill.entrypoints.openai.errors import OpenAIError
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.responses_input import (
    ResponsesRequest,
    check_served,
    to_chat_request,
)
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat

# gpt-oss' template writes "Reasoning: {{ reasoning_effort }}" (medium when unset), and a
# past tool call as its thinking (analysis) then the call (commentary to=functions.NAME).
HARMONY_LIKE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}{% if m.tool_calls %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}"
    "<|end|>{% endif %}<|start|>assistant to=functions.{{ m.tool_calls[0].function.name }}"
    "<|channel|>commentary json<|message|>{{ m.tool_calls[0].function.arguments | tojson }}"
    "<|call|>{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
ASK = [{"role": "user", "content": "Hi"}]


def _chat(tokenizer, template: str) -> OpenAIServingChat:
    """The chat handler's rendering, without an engine."""
    chat = OpenAIServingChat.__new__(OpenAIServingChat)
    chat.tokenizer, chat.chat_template = tokenizer, template
    return chat


def _render(chat: OpenAIServingChat, **fields) -> str:
    request = ChatCompletionRequest.model_validate({"messages": ASK, **fields})
    return chat.render_text(request.messages, request)


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_the_effort_reaches_the_template(smollm2_tokenizer, effort):
    text = _render(_chat(smollm2_tokenizer, HARMONY_LIKE), reasoning_effort=effort)
    assert text.startswith(f"<|start|>system<|message|>Reasoning: {effort}<|end|>")


def test_without_an_effort_the_template_default_applies(smollm2_tokenizer):
    assert "Reasoning: medium" in _render(_chat(smollm2_tokenizer, HARMONY_LIKE))


def test_a_template_that_does_not_read_it_refuses_it(smollm2_tokenizer):
    with pytest.raises(OpenAIError) as caught:
        _render(_chat(smollm2_tokenizer, PLAIN), reasoning_effort="high")
    assert caught.value.status == 400 and caught.value.param == "reasoning_effort"


def test_an_unknown_effort_is_refused_by_the_request_model():
    with pytest.raises(ValueError, match="reasoning_effort"):
        ChatCompletionRequest.model_validate({"messages": ASK, "reasoning_effort": "max"})


def test_responses_reasoning_effort_becomes_the_chat_field():
    request = ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"effort": "low"}})
    check_served(request)
    chat_request = to_chat_request(request, [], [{"role": "user", "content": "Hi"}])
    assert chat_request.reasoning_effort == "low"
    bad = ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"effort": "extreme"}})
    with pytest.raises(OpenAIError) as caught:
        to_chat_request(bad, [], [{"role": "user", "content": "Hi"}])
    assert caught.value.param == "reasoning.effort"


def test_past_reasoning_is_the_templates_thinking(smollm2_tokenizer):
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        *ASK,
        {
            "role": "assistant",
            "reasoning_content": "Need the weather.",
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    text = _render(_chat(smollm2_tokenizer, HARMONY_LIKE), messages=messages)
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|><|start|>tool<|message|>22 C<|end|>'
    ) in text

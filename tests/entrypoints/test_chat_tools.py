"""The chat request's tools as the template sees them: transformers' ``tools`` argument, an
assistant's past calls (arguments as objects) and tool results, rendered by a Hermes-style
template as Qwen2.5's renders them; and the plan of each ``tool_choice``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.entrypoints.tool_parser_samples import WEATHER_TOOLS
from tokenmill.entrypoints.openai.chat_tools import ToolSettings, plan_tool_calls
from tokenmill.entrypoints.openai.errors import OpenAIError
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.tool_parsers import ToolParserManager

# The tool parts of Qwen2.5's template, shortened.
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
]


def test_tools_and_past_calls_reach_the_template(smollm2_tokenizer):
    request = ChatCompletionRequest(messages=CONVERSATION, tools=WEATHER_TOOLS)
    chat = SimpleNamespace(tokenizer=smollm2_tokenizer, chat_template=HERMES_TEMPLATE)
    text = OpenAIServingChat.render_text(chat, request.messages, request)
    assert text.startswith("<tools>get_weather;search;</tools>\n")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\n22 C<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def plan(**fields):
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], tools=WEATHER_TOOLS, **fields
    )
    hermes = ToolParserManager.get_tool_parser("hermes")
    return plan_tool_calls(request, ToolSettings(True, hermes))


def test_each_tool_choice_plan():
    assert plan().mode == "auto" and plan(tool_choice="none").mode == "off"
    required = plan(tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(required.constraint.json)
    assert schema["minItems"] == schema["maxItems"] == 1
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [
        ["get_weather"],
        ["search"],
    ]
    named = plan(tool_choice={"type": "function", "function": {"name": "search"}})
    assert named.name == "search"
    assert json.loads(named.constraint.json) == WEATHER_TOOLS[1]["function"]["parameters"]
    assert named.constraint.disable_any_whitespace


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)
def test_bad_choices(fields, param):
    with pytest.raises(OpenAIError) as info:
        plan(**fields)
    assert info.value.param == param and info.value.status == 400

"""Reasoning parsers on recorded outputs of thinking models (DeepSeek-R1's and Qwen3's
``<think>`` format), whole and streamed in several chunkings; the contract every registered
parser keeps; and one choice's pipeline: reasoning first, then tool calls in the answer."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.test_tool_parsers import REQUEST, chunkings
from tokenmill.entrypoints.openai.chat_output import ChoiceParser
from tokenmill.entrypoints.openai.chat_tools import ToolPlan
from tokenmill.entrypoints.openai.reasoning_parsers import ReasoningParserManager
from tokenmill.entrypoints.openai.tool_parsers import ToolParserManager

THOUGHT = "Okay, the user asks for the capital of France.\nThat is Paris."
# (output, reasoning, content)
SAMPLES = {
    "deepseek_r1": [
        (
            f"<think>\n{THOUGHT}\n</think>\n\nThe capital is Paris.",
            THOUGHT,
            "The capital is Paris.",
        ),
        # The template opened the thinking in the prompt: no <think> in the output.
        (f"{THOUGHT}\n</think>\n\nParis.", THOUGHT, "Paris."),
        # Cut by max_tokens while thinking: all reasoning.
        (f"<think>\n{THOUGHT}", THOUGHT, None),
        ("<think>\n\n</think>\n\nParis.", None, "Paris."),
    ],
    "qwen3": [
        (
            f"<think>\n{THOUGHT}\n</think>\n\nThe capital is Paris.",
            THOUGHT,
            "The capital is Paris.",
        ),
        ("<think>\n\n</think>\n\nParis.", None, "Paris."),
        # Thinking off (enable_thinking: false) or a model that does not think.
        (
            "The capital is Paris. I think </think> is a tag.",
            None,
            "The capital is Paris. I think </think> is a tag.",
        ),
        (f"<think>\n{THOUGHT}", THOUGHT, None),
    ],
    # gpt-oss' harmony channels (special tokens kept in the text).
    "openai_gptoss": [
        (
            f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final"
            "<|message|>The capital is Paris.",
            THOUGHT,
            "The capital is Paris.",
        ),
        (
            f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final"
            "<|message|>Paris.<|return|>",
            THOUGHT,
            "Paris.",
        ),
        (f"<|channel|>analysis<|message|>{THOUGHT}", THOUGHT, None),
        ("<|channel|>final<|message|>Paris.", None, "Paris."),
        # A tool call stays whole in the answer, for the tool parser.
        (
            f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>"
            'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
            THOUGHT,
            "<|start|>assistant<|channel|>commentary to=functions.get_weather "
            '<|constrain|>json<|message|>{"city": "Paris"}',
        ),
    ],
}
# Per parser: (a prompt that closed the thinking, prompts that did not, the reasoning's end
# marker, an output and its answer).
PROMPT_ENDS = {
    "deepseek_r1": (
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        ["<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n"],
        "</think>",
        f"<think>\n{THOUGHT}\n</think>\n\nParis.",
        "Paris.",
    ),
    "openai_gptoss": (
        "<|start|>assistant<|channel|>final<|message|>",
        ["<|start|>assistant", "<|start|>assistant<|channel|>analysis<|message|>"],
        "<|channel|>final<|message|>",
        f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final"
        "<|message|>Paris.",
        "Paris.",
    ),
}
PROMPT_ENDS["qwen3"] = PROMPT_ENDS["deepseek_r1"]


def stream(parser, pieces: list[str]) -> tuple[str, str]:
    text, reasoning, content = "", "", ""
    deltas = []
    for piece in pieces:
        previous, text = text, text + piece
        deltas.append(parser.extract_reasoning_content_streaming(previous, text, piece, [], [], []))
    deltas.append(parser.finish_streaming())
    for delta in deltas:
        if delta is not None:
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
    return reasoning, content


def test_every_registered_parser_has_recorded_samples():
    assert {"deepseek_r1", "qwen3", "openai_gptoss"} <= set(
        ReasoningParserManager.reasoning_parsers
    )
    assert set(ReasoningParserManager.reasoning_parsers) <= set(SAMPLES)


CASES = [(name, i) for name, samples in SAMPLES.items() for i in range(len(samples))]


@pytest.mark.parametrize("name,index", CASES)
def test_recorded_output_whole_and_streamed(name, index, smollm2_tokenizer):
    output, reasoning, content = SAMPLES[name][index]
    cls = ReasoningParserManager.get_reasoning_parser(name)
    assert cls(smollm2_tokenizer).extract_reasoning_content(output, REQUEST) == (
        reasoning,
        content,
    )
    for pieces in chunkings(output):
        assert stream(cls(smollm2_tokenizer), pieces) == (reasoning or "", content or "")


@pytest.mark.parametrize("name", sorted(ReasoningParserManager.reasoning_parsers))
def test_a_prompt_that_closed_the_thinking_ends_the_reasoning(name, smollm2_tokenizer):
    parser = ReasoningParserManager.get_reasoning_parser(name)(smollm2_tokenizer)
    closed, still_open, end, output, answer = PROMPT_ENDS[name]
    encode = lambda text: smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert parser.is_reasoning_end(encode(closed))
    assert not any(parser.is_reasoning_end(encode(p)) for p in still_open)
    end_ids = parser.reasoning_end_token_ids()
    assert end_ids and smollm2_tokenizer.decode(end_ids) == end
    assert smollm2_tokenizer.decode(parser.extract_content_ids(encode(output))).strip() == answer


def test_reasoning_then_tool_calls_in_the_answer(smollm2_tokenizer):
    """A thinking model's call: the thinking is reasoning, the call is read from the answer."""
    output = (
        f"<think>\n{THOUGHT}\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )

    def parser() -> ChoiceParser:
        return ChoiceParser(
            REQUEST,
            ToolPlan("auto"),
            ReasoningParserManager.get_reasoning_parser("qwen3")(smollm2_tokenizer),
            ToolParserManager.get_tool_parser("hermes")(smollm2_tokenizer),
        )

    whole = parser()
    parsed = whole.parse(output)
    assert parsed.reasoning_content == THOUGHT and parsed.content is None
    assert [json.loads(c.function.arguments) for c in parsed.tool_calls] == [{"city": "Paris"}]
    assert whole.finish_reason("stop") == "tool_calls"
    for pieces in chunkings(output):
        streamed = parser()
        reasoning, content, arguments = "", "", ""
        for i, piece in enumerate(pieces):
            delta = streamed.stream(piece, [], i == len(pieces) - 1)
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            arguments += "".join(c.function.arguments or "" for c in delta.tool_calls or [])
        assert (reasoning, content, json.loads(arguments)) == (THOUGHT, "", {"city": "Paris"})
        assert streamed.finish_reason("stop") == "tool_calls"


def test_gpt_oss_reasoning_then_its_tool_call(smollm2_tokenizer):
    """gpt-oss' harmony output through both of its parsers: the analysis channel is the
    reasoning, the commentary message to a function the call, and no marker is content."""
    output = (
        f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>"
        "commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    )

    def parser() -> ChoiceParser:
        return ChoiceParser(
            REQUEST,
            ToolPlan("auto"),
            ReasoningParserManager.get_reasoning_parser("openai_gptoss")(smollm2_tokenizer),
            ToolParserManager.get_tool_parser("openai")(smollm2_tokenizer),
        )

    whole = parser()
    parsed = whole.parse(output)
    assert (parsed.reasoning_content, parsed.content) == (THOUGHT, "Checking.")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert whole.finish_reason("stop") == "tool_calls"
    for pieces in chunkings(output):
        streamed = parser()
        reasoning, content, arguments = "", "", ""
        for i, piece in enumerate(pieces):
            delta = streamed.stream(piece, [], i == len(pieces) - 1)
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            arguments += "".join(c.function.arguments or "" for c in delta.tool_calls or [])
        assert (reasoning, content, json.loads(arguments)) == (
            THOUGHT, "Checking.", {"city": "Paris"}
        )


def test_gpt_oss_parsers_keep_the_markers_in_the_text(smollm2_tokenizer):
    for parser in (
        ReasoningParserManager.get_reasoning_parser("openai_gptoss")(smollm2_tokenizer),
        ToolParserManager.get_tool_parser("openai")(smollm2_tokenizer),
    ):
        assert parser.adjust_request(REQUEST.model_copy()).skip_special_tokens is False

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
}


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
    assert {"deepseek_r1", "qwen3"} <= set(ReasoningParserManager.reasoning_parsers)
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
    encode = lambda text: smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert parser.is_reasoning_end(encode("<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    assert not parser.is_reasoning_end(encode("<|im_start|>assistant\n<think>\n"))
    assert not parser.is_reasoning_end(encode("<|im_start|>assistant\n"))
    end_ids = parser.reasoning_end_token_ids()
    assert end_ids and smollm2_tokenizer.decode(end_ids) == "</think>"
    ids = encode(f"<think>\n{THOUGHT}\n</think>\n\nParis.")
    assert smollm2_tokenizer.decode(parser.extract_content_ids(ids)).strip() == "Paris."


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

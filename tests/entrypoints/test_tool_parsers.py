"""Tool parsers: every registered parser (and the forced-choice parsers) on recorded outputs of
its model family, whole and streamed in several chunkings, plus the contract every parser keeps:
plain text passes through unchanged, streamed calls send their name once and argument pieces
that concatenate to the whole output's arguments, and no markup reaches the content."""

from __future__ import annotations

import json
import random

import pytest

from tests.entrypoints.tool_parser_samples import PLAIN_TEXTS, SAMPLES, WEATHER_TOOLS
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from tokenmill.entrypoints.openai.tool_parsers.forced import (
    NamedToolCallParser,
    RequiredToolCallParser,
)

REQUEST = ChatCompletionRequest(
    messages=[{"role": "user", "content": "Weather?"}], tools=WEATHER_TOOLS
)
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<function=", "<|python",
          "<|channel|>", "<|message|>")


def chunkings(text: str) -> list[list[str]]:
    """The text whole, character by character, and in random pieces of 1-7 characters."""
    rng = random.Random(len(text))
    pieces, i = [], 0
    while i < len(text):
        size = rng.randint(1, 7)
        pieces.append(text[i : i + size])
        i += size
    return [[text], list(text), pieces]


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, dict[int, dict]]:
    """Feed the pieces; the content and the calls (index -> id, name, arguments) sent."""
    text, content, calls = "", "", {}
    deltas = []
    for piece in pieces:
        previous, text = text, text + piece
        deltas.append(
            parser.extract_tool_calls_streaming(previous, text, piece, [], [], [], REQUEST)
        )
    deltas.append(parser.finish_streaming(REQUEST))
    for delta in deltas:
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index not in calls:
                # A call's first piece carries its id, type and name, and only it does.
                assert call.id and call.type == "function" and call.function.name
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and (call.function is None or call.function.name is None)
            calls[call.index]["arguments"] += call.function.arguments or ""
    return content, calls


def test_every_registered_parser_has_recorded_samples():
    names = set(ToolParserManager.tool_parsers)
    assert {"hermes", "llama3_json", "mistral", "openai", "pythonic", "qwen3_coder"} <= names
    assert names <= set(SAMPLES), f"add recorded outputs for {names - set(SAMPLES)}"


CASES = [(name, i) for name, samples in SAMPLES.items() for i in range(len(samples))]


@pytest.mark.parametrize("name,index", CASES)
def test_recorded_output_whole_and_streamed(name, index):
    output, expected_calls, expected_content = SAMPLES[name][index]
    cls = ToolParserManager.get_tool_parser(name)
    info = cls(None).extract_tool_calls(output, REQUEST)
    if expected_calls is None:
        assert not info.tools_called and info.tool_calls == []
        assert info.content == (expected_content or output)
    else:
        assert info.tools_called
        assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == (
            expected_calls
        )
        assert len({c.id for c in info.tool_calls}) == len(info.tool_calls)
        assert info.content == expected_content
    for pieces in chunkings(output):
        content, calls = stream(cls(None), pieces)
        if expected_calls is not None:
            got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
            assert got == expected_calls, pieces
            assert content == (expected_content or "")
        elif not calls:  # not calls, and none were sent before that was known
            assert content == (expected_content or output)
        assert not any(m in content for m in MARKUP) or not calls


@pytest.mark.parametrize("name", sorted(ToolParserManager.tool_parsers))
@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_plain_text_passes_through(name, text):
    cls = ToolParserManager.get_tool_parser(name)
    info = cls(None).extract_tool_calls(text, REQUEST)
    assert (info.tools_called, info.content) == (False, text)
    for pieces in chunkings(text):
        assert stream(cls(None), pieces) == (text, {})


def test_mistral_keeps_its_control_tokens_and_uses_nine_character_ids():
    parser = ToolParserManager.get_tool_parser("mistral")(None)
    request = REQUEST.model_copy()
    assert parser.adjust_request(request).skip_special_tokens is False
    info = parser.extract_tool_calls(SAMPLES["mistral"][0][0], REQUEST)
    assert len(info.tool_calls[0].id) == 9 and info.tool_calls[0].id.isalnum()


def test_streamed_arguments_grow_while_the_model_writes_them():
    """Argument text is sent as it is generated, not only when the call closes."""
    parser = ToolParserManager.get_tool_parser("hermes")(None)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    delta = parser.extract_tool_calls_streaming("", text, text, [], [], [], REQUEST)
    assert delta.tool_calls[0].function.name == "get_weather"
    assert delta.tool_calls[0].function.arguments == '{"city": "Par'


FORCED = [
    (
        NamedToolCallParser,
        ("get_weather",),
        '{"city": "Paris", "days": 2}',
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
    (
        RequiredToolCallParser,
        (),
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "search", "parameters": {}}]',
        [PARIS := ("get_weather", {"city": "Paris"}), ("search", {})],
    ),
]


@pytest.mark.parametrize("cls,args,output,expected", FORCED)
def test_forced_choice_outputs_whole_and_streamed(cls, args, output, expected):
    info = cls(None, *args).extract_tool_calls(output, REQUEST)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == (
        expected
    )
    for pieces in chunkings(output):
        content, calls = stream(cls(None, *args), pieces)
        assert content == ""
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == (
            expected
        )


def test_a_plugin_file_registers_its_parser(tmp_path):
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from tokenmill.entrypoints.openai.tool_parsers import ToolParserManager\n"
        "from tokenmill.entrypoints.openai.tool_parsers.hermes import HermesToolParser\n"
        "@ToolParserManager.register_module('my_format')\n"
        "class MyParser(HermesToolParser):\n    pass\n"
    )
    try:
        ToolParserManager.import_tool_parser(str(plugin))
        assert ToolParserManager.get_tool_parser("my_format").__name__ == "MyParser"
    finally:
        ToolParserManager.tool_parsers.pop("my_format", None)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('nope')\n")
    with pytest.raises(ImportError, match="nope"):
        ToolParserManager.import_tool_parser(str(broken))
    with pytest.raises(KeyError, match="known: "):
        ToolParserManager.get_tool_parser("no_such_parser")


@pytest.mark.parametrize("output", [
    '<tool_call>{"name": "nope", "arguments": {"city": "X"}}</tool_call>',  # not a tool
    '<tool_call>{"name": "get_weather", "arguments": 5}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": "str"}</tool_call>',  # not an object
])
def test_a_call_that_cannot_be_made_is_content_whole_and_streamed(output):
    """An unknown tool or arguments that are no object: the whole output is content, streamed
    in any chunking as whole, and no call is sent."""
    cls = ToolParserManager.get_tool_parser("hermes")
    info = cls(None).extract_tool_calls(output, REQUEST)
    assert not info.tools_called and info.content == output
    for pieces in chunkings(output):
        content, calls = stream(cls(None), pieces)
        assert calls == {} and content == output, pieces


def test_a_repeated_name_never_renames_a_call():
    """A key repeated after the arguments (the call may already be streaming): the whole
    output is content, and a stream never sends the second name."""
    output = ('<tool_call>{"name": "get_weather", "arguments": {"city": "X"}, "name": "x"}'
              "</tool_call>")
    cls = ToolParserManager.get_tool_parser("hermes")
    assert not cls(None).extract_tool_calls(output, REQUEST).tools_called
    for pieces in chunkings(output):
        _, calls = stream(cls(None), pieces)
        assert all(c["name"] == "get_weather" for c in calls.values()), pieces

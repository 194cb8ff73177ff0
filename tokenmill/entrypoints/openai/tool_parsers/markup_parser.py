"""``MarkupToolParser``: a tool parser defined by one function, ``parse(text, final)``, that
reads the calls and the content out of an output or any prefix of it; whole outputs and
streams both follow from it.

Streaming sends what grew since the last chunk: new content, a call's id and name once the
name is complete, then each new piece of its arguments' JSON text. ``parse`` keeps every
piece it reports a prefix of what it will report for a longer text (content that may be the
start of tool-call markup is held back), so the pieces sent concatenate to the final values.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.entrypoints.openai.protocol import DeltaMessage
from tokenmill.entrypoints.openai.protocol_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    tool_call_id,
)
from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from tokenmill.entrypoints.openai.tool_parsers.json_scan import (
    MalformedJSON,
    ObjectScan,
    is_json_object,
)

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest


@dataclass
class PartialToolCall:
    """A tool call as far as the text goes.

    Attributes:
        name: the function's name, None until it is complete.
        arguments: the arguments' JSON text so far (a prefix of the final text).
        complete: the call's markup has closed.
    """

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedToolOutput:
    """What ``parse`` read: the text outside tool-call markup, and the calls in order."""

    content: str = ""
    calls: list[PartialToolCall] = field(default_factory=list)


def held_back(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``text`` may be the start of one of ``markers``
    (the longest such suffix), which streamed content holds back."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def visible(text: str, final: bool, markers: Sequence[str]) -> str:
    """``text`` without a suffix that may begin a marker, unless the output is final."""
    return text if final else text[: len(text) - held_back(text, markers)]


def call_from_object(
    text: str, start: int, scan: ObjectScan, args_keys: Sequence[str] = ("arguments", "parameters")
) -> PartialToolCall:
    """A call from a JSON object ``{"name": ..., "arguments": {...}}`` scanned so far
    (``start``: its ``{``). The arguments are the raw text of their object (a JSON string
    holding the object is decoded once complete; null means no arguments).

    Raises:
        MalformedJSON: the name is not a string (or missing from a complete object), or
            the arguments neither an object, a string nor null.
    """
    call = PartialToolCall(complete=scan.end is not None)
    name = scan.complete_value(text, "name")
    if (name is not None or call.complete) and not isinstance(name, str):
        raise MalformedJSON("a tool call needs a name, a string")
    call.name = name
    key = next((k for k in args_keys if k in scan.members), None)
    if key is None:
        call.arguments = "{}" if call.complete else ""
        return call
    begin, end = scan.members[key]
    first = text[begin]
    if first == "{":
        call.arguments = text[begin:end] if end is not None else text[begin:]
    elif first == '"':
        call.arguments = json.loads(text[begin:end]) if end is not None else ""
        if end is not None and not is_json_object(call.arguments):
            raise MalformedJSON("the arguments of a tool call must be an object")
    elif text.startswith("null", begin) or (end is None and "null".startswith(text[begin:])):
        call.arguments = "{}" if end is not None else ""
    else:
        raise MalformedJSON("the arguments of a tool call must be an object")
    return call


def _known_name(name: str, request: ChatCompletionRequest) -> bool:
    """Whether ``name`` is one of the request's tools (any name when it lists none)."""
    tools = getattr(request, "tools", None)
    return not tools or any(t.function.name == name for t in tools)


def _valid(call: PartialToolCall, request: ChatCompletionRequest) -> bool:
    """A call that can be made: complete, named after one of the request's tools, with a
    JSON object as arguments."""
    return (call.name is not None and call.complete and is_json_object(call.arguments)
            and _known_name(call.name, request))


class MarkupToolParser(ToolParser):
    """A tool parser from ``parse``; keeps the streaming state of one sequence.

    Whole outputs: calls that are all complete, named and with a JSON object as arguments
    become ``tool_calls`` and the rest content (stripped; None when empty); otherwise the
    whole output is content. Streams: content with trailing whitespace held until more text
    follows (dropped at the end when there were calls), a call's name once, then its
    arguments piece by piece.
    """

    def __init__(self, tokenizer: object) -> None:
        super().__init__(tokenizer)
        self._text = ""
        self._sent_content = 0
        self._sent_calls: list[tuple[str, int]] = []  # (id, argument characters sent)

    @abstractmethod
    def parse(self, text: str, final: bool, request: ChatCompletionRequest) -> ParsedToolOutput:
        """The content and calls in ``text`` (the whole output when ``final``, else a prefix
        of it). What it reports for a prefix must be a prefix of what it reports for any
        longer text: content that may begin markup is left out until it is known.
        Markup that cannot be read as calls is content when ``final`` (and held back while
        streaming)."""

    def new_call_id(self) -> str:
        """An id for the next call (OpenAI's ``call_`` form unless a model wants another)."""
        return tool_call_id()

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest
    ) -> ExtractedToolCallInformation:
        parsed = self.parse(model_output, True, request)
        if not parsed.calls or not all(_valid(c, request) for c in parsed.calls):
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        calls = []
        for call in parsed.calls:
            function = FunctionCall(name=call.name, arguments=call.arguments)
            calls.append(ToolCall(id=self.new_call_id(), function=function))
        content = parsed.content.strip() or None
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=content)

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: ChatCompletionRequest,
    ) -> DeltaMessage | None:
        self._text = current_text
        return self._delta(self.parse(current_text, False, request), False, request)

    def finish_streaming(self, request: ChatCompletionRequest) -> DeltaMessage | None:
        parsed = self.parse(self._text, True, request)
        if not self._sent_calls and not all(_valid(c, request) for c in parsed.calls):
            # As ``extract_tool_calls``: calls that cannot be made leave the whole output
            # content (what was sent so far is a prefix of it: the text before any markup).
            rest = self._text[self._sent_content :]
            return DeltaMessage(content=rest) if rest else None
        return self._delta(parsed, True, request)

    def _delta(self, parsed: ParsedToolOutput, final: bool,
               request: ChatCompletionRequest) -> DeltaMessage | None:
        """What grew since the last delta. A call is sent once its name is one of the
        request's tools and its arguments have begun (an object, or a string holding one)."""
        content = parsed.content
        if not (final and not parsed.calls):
            content = content.rstrip()
        new_content = content[self._sent_content :]
        self._sent_content = max(self._sent_content, len(content))
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(parsed.calls):
            if index == len(self._sent_calls):
                if call.name is None or not (call.arguments or call.complete) or (
                    not _known_name(call.name, request)
                ):
                    break  # calls are sent in order, each once it is known to be one
                call_id = self.new_call_id()
                self._sent_calls.append((call_id, 0))
                deltas.append(
                    DeltaToolCall(
                        index=index,
                        id=call_id,
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=""),
                    )
                )
            call_id, sent = self._sent_calls[index]
            piece = call.arguments[sent:]
            if piece:
                self._sent_calls[index] = (call_id, len(call.arguments))
                if deltas and deltas[-1].index == index and deltas[-1].function is not None:
                    deltas[-1].function.arguments = piece
                else:
                    function = DeltaFunctionCall(arguments=piece)
                    deltas.append(DeltaToolCall(index=index, function=function))
        if not new_content and not deltas:
            return None
        delta = DeltaMessage()
        if new_content:
            delta.content = new_content
        if deltas:
            delta.tool_calls = deltas
        return delta

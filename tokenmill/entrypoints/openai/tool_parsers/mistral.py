"""``mistral``: Mistral's tool calls after the ``[TOOL_CALLS]`` control token, in either of
its tokenizers' formats (mistral-common):

- up to v7 (Mistral 7B v0.3, Mixtral, Mistral Small 3.1, Nemo): one JSON array,
  ``[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]``;
- v11 and later (Mistral Small 3.2, Magistral, Devstral): one ``[TOOL_CALLS]name[ARGS]{...}``
  per call.

Text before the first ``[TOOL_CALLS]`` is content. The control tokens are special tokens, so
the parser asks for them to be kept in the text; call ids are 9 letters and digits, the form
Mistral's chat templates check.
"""

from __future__ import annotations

import secrets
import string
from typing import TYPE_CHECKING

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from tokenmill.entrypoints.openai.tool_parsers.json_scan import (
    MalformedJSON,
    scan_object,
    scan_object_array,
    skip_ws,
    value_end,
)
from tokenmill.entrypoints.openai.tool_parsers.markup_parser import (
    MarkupToolParser,
    ParsedToolOutput,
    PartialToolCall,
    call_from_object,
    visible,
)

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_ALPHABET = string.ascii_letters + string.digits


@ToolParserManager.register_module("mistral")
class MistralToolParser(MarkupToolParser):
    """Reads ``[TOOL_CALLS]`` followed by a JSON array of calls, or by ``name[ARGS]{...}``."""

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def parse(self, text: str, final: bool, request: ChatCompletionRequest) -> ParsedToolOutput:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return ParsedToolOutput(content=visible(text, final, [TOOL_CALLS]))
        parsed = ParsedToolOutput(content=text[:start])
        i = skip_ws(text, start + len(TOOL_CALLS))
        try:
            if i < len(text) and text[i] == "[":
                self._read_array(text, i, parsed)
            else:
                self._read_named(text, start, final, parsed)
        except MalformedJSON:
            if final:
                parsed.content = text
                parsed.calls = []
        return parsed

    @staticmethod
    def _read_array(text: str, i: int, parsed: ParsedToolOutput) -> None:
        scan = scan_object_array(text, i)
        for begin, obj in scan.objects:
            parsed.calls.append(call_from_object(text, begin, obj))

    @staticmethod
    def _read_named(text: str, start: int, final: bool, parsed: ParsedToolOutput) -> None:
        """``[TOOL_CALLS]name[ARGS]{...}`` repeated, from the marker at ``start``."""
        pos = start
        while text.startswith(TOOL_CALLS, pos):
            name_start = pos + len(TOOL_CALLS)
            args_at = text.find(ARGS, name_start)
            if args_at < 0:
                if final or TOOL_CALLS in text[name_start:]:
                    raise MalformedJSON("a call without [ARGS]")
                return
            call = PartialToolCall(name=text[name_start:args_at].strip())
            if not call.name:
                raise MalformedJSON("a call without a name")
            parsed.calls.append(call)
            begin = skip_ws(text, args_at + len(ARGS))
            if begin >= len(text):
                return
            if text[begin] != "{":
                raise MalformedJSON("the arguments of a call must be an object")
            end = value_end(text, begin)
            call.arguments = text[begin:end] if end is not None else text[begin:]
            if end is None:
                return
            scan_object(text, begin)  # the arguments must be an object
            call.complete = True
            pos = skip_ws(text, end)
        if pos < len(text) and not (not final and TOOL_CALLS.startswith(text[pos:])):
            raise MalformedJSON("text after the calls")

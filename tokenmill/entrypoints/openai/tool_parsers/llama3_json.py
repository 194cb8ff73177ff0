"""``llama3_json``: Llama 3.1/3.2/3.3's JSON tool calls (their chat templates' format), an
output that is one or more objects separated by ``;``, optionally after ``<|python_tag|>``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An output that does not start with ``{`` (or the tag) is plain content.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from tokenmill.entrypoints.openai.tool_parsers.json_scan import (
    MalformedJSON,
    scan_object,
    skip_ws,
)
from tokenmill.entrypoints.openai.tool_parsers.markup_parser import (
    MarkupToolParser,
    ParsedToolOutput,
    call_from_object,
)

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest

PYTHON_TAG = "<|python_tag|>"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(MarkupToolParser):
    """Reads ``{"name": ..., "parameters": {...}}`` objects (``arguments`` is accepted
    too) separated by ``;``. Output starting with ``{`` is held back while streaming until
    it is known to be calls; if it turns out not to be, it is content at the end."""

    def parse(self, text: str, final: bool, request: ChatCompletionRequest) -> ParsedToolOutput:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
            if i >= len(text):  # calls follow the tag
                return ParsedToolOutput()
        elif i == len(text) or PYTHON_TAG.startswith(text[i:]):
            return ParsedToolOutput(content=text if final else "")
        if i >= len(text) or text[i] != "{":
            return ParsedToolOutput(content=text)
        parsed = ParsedToolOutput()
        while True:
            try:
                scan = scan_object(text, i)
                call = call_from_object(text, i, scan)
            except MalformedJSON:  # not calls after all: content (after calls: at the end)
                if not parsed.calls:
                    return ParsedToolOutput(content=text)
                if final:
                    parsed.content = text[i:]
                return parsed
            parsed.calls.append(call)
            if scan.end is None:
                return parsed
            i = skip_ws(text, scan.end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            if i >= len(text):
                return parsed
            if text[i] != "{":
                if final:
                    parsed.content = text[i:]
                return parsed

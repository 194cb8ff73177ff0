"""``hermes``: calls as JSON objects in ``<tool_call>`` tags, as Hermes 2 Pro, Qwen2.5 and
Qwen3 write them (their chat templates' tool-call format)::

    I'll look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
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
    visible,
)

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest

START, END = "<tool_call>", "</tool_call>"


@ToolParserManager.register_module("hermes")
class HermesToolParser(MarkupToolParser):
    """Reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; the text
    around them is content. A block the end of the output cuts before ``</tool_call>`` still
    counts once its object is complete."""

    def parse(self, text: str, final: bool, request: ChatCompletionRequest) -> ParsedToolOutput:
        parsed = ParsedToolOutput()
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                parsed.content += visible(text[pos:], final, [START])
                return parsed
            parsed.content += text[pos:start]
            try:
                pos = self._read_block(text, start + len(START), parsed)
            except MalformedJSON:  # content at the end; held back while streaming
                if final:
                    parsed.content += text[start:]
                return parsed
            if pos >= len(text):
                return parsed

    @staticmethod
    def _read_block(text: str, i: int, parsed: ParsedToolOutput) -> int:
        """Read the call whose object starts at or after ``i`` into ``parsed``; the index
        past its closing tag (``len(text)`` while it is open; just past the object when
        other text follows it, which is then content).

        Raises:
            MalformedJSON: the block's text is not a call object.
        """
        i = skip_ws(text, i)
        if i >= len(text):
            return i
        scan = scan_object(text, i)
        parsed.calls.append(call_from_object(text, i, scan))
        if scan.end is None:  # open (or cut by the end of the output: an incomplete call)
            return len(text)
        j = skip_ws(text, scan.end)
        if text.startswith(END, j):
            return j + len(END)
        if END.startswith(text[j:]):  # the tag is cut off, or still to come
            return len(text)
        return scan.end

"""The outputs of ``tool_choice: "required"`` and of a named function, which a grammar over
the tools' schemas forces (``entrypoints/openai/chat_tools.py``): these parsers read them
back as calls. They are not selectable with ``--tool-call-parser``.

- named: the output is the arguments object itself;
- required: a JSON array of ``{"name": ..., "parameters": {...}}`` (vLLM's form).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.entrypoints.openai.tool_parsers.json_scan import (
    MalformedJSON,
    scan_object_array,
    skip_ws,
    value_end,
)
from tokenmill.entrypoints.openai.tool_parsers.markup_parser import (
    MarkupToolParser,
    ParsedToolOutput,
    PartialToolCall,
    call_from_object,
)

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest


class NamedToolCallParser(MarkupToolParser):
    """The output is the arguments of one call to ``name``.

    Args:
        tokenizer: the model's tokenizer.
        name: the function ``tool_choice`` names.
    """

    def __init__(self, tokenizer: object, name: str) -> None:
        super().__init__(tokenizer)
        self.name = name

    def parse(self, text: str, final: bool, request: ChatCompletionRequest) -> ParsedToolOutput:
        start = skip_ws(text, 0)
        call = PartialToolCall(name=self.name, arguments=text[start:].rstrip())
        try:
            end = value_end(text, start)
        except MalformedJSON:
            end = None
        call.complete = end is not None
        if end is not None:
            call.arguments = text[start:end]
        elif not final:  # whitespace at the end may still be inside a string
            call.arguments = text[start:]
        return ParsedToolOutput(calls=[call])


class RequiredToolCallParser(MarkupToolParser):
    """The output is a JSON array of ``{"name", "parameters"}`` objects."""

    def parse(self, text: str, final: bool, request: ChatCompletionRequest) -> ParsedToolOutput:
        parsed = ParsedToolOutput()
        start = skip_ws(text, 0)
        if start >= len(text):
            return parsed
        try:
            scan = scan_object_array(text, start)
            for begin, obj in scan.objects:
                parsed.calls.append(call_from_object(text, begin, obj, ("parameters",)))
        except MalformedJSON:
            if final:
                parsed.content = text
                parsed.calls = []
        return parsed

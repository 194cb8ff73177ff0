"""``openai``: gpt-oss' tool calls in the harmony format (``harmony_markup.py``), a
``commentary`` message addressed to a function, its body the arguments' JSON::

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>
    commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The content is the bodies of ``final`` messages and of ``commentary`` messages without a
recipient (preambles), and plain text outside messages. ``analysis`` messages (reasoning,
which ``--reasoning-parser openai_gptoss`` returns) and messages to built-in tools other
than functions are not content. The markers are special tokens, so the parser asks for them
to be kept in the text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.entrypoints.openai.protocol_tools import ExtractedToolCallInformation
from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from tokenmill.entrypoints.openai.tool_parsers.harmony_markup import parse_harmony
from tokenmill.entrypoints.openai.tool_parsers.markup_parser import (
    MarkupToolParser,
    ParsedToolOutput,
    PartialToolCall,
)

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest


@ToolParserManager.register_module("openai")
class OpenAIToolParser(MarkupToolParser):
    """Reads harmony messages to ``functions.NAME`` as calls (see the module)."""

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        request.skip_special_tokens = False
        return request

    def parse(self, text: str, final: bool, request: ChatCompletionRequest) -> ParsedToolOutput:
        parsed = ParsedToolOutput()
        for part in parse_harmony(text, final):
            if part.channel is None:
                parsed.content += part.body
            elif part.recipient is None and part.channel != "analysis":
                parsed.content += part.body
            elif part.function is not None:
                # The stop token <|call|> ends the output: the end of a final output closes
                # the call too.
                arguments = part.body.strip() if final or part.closed else part.body.lstrip()
                parsed.calls.append(PartialToolCall(part.function, arguments, part.closed or final))
        return parsed

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest
    ) -> ExtractedToolCallInformation:
        info = super().extract_tool_calls(model_output, request)
        parsed = self.parse(model_output, True, request)
        if not info.tools_called and not parsed.calls:
            # No call: the answer's text without the harmony markers.
            info.content = parsed.content or None
        return info

"""``openai_gptoss``: gpt-oss' reasoning, its harmony ``analysis`` channel.

The bodies of the output's ``analysis`` messages are the reasoning (joined by a newline).
The answer is the rest: the bodies of ``final`` messages and of ``commentary`` messages
without a recipient (preambles), and, kept whole with their markers so that the tool parser
(``--tool-call-parser openai``) reads them, messages addressed to a function
(``to=functions.NAME``). The markers are special tokens, so the parser asks for the output
decoded with ``skip_special_tokens=False``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParserManager,
)
from tokenmill.entrypoints.openai.reasoning_parsers.think_tags import ThinkTagReasoningParser
from tokenmill.entrypoints.openai.tool_parsers.harmony_markup import (
    FINAL_HEADER,
    parse_harmony,
)

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest


def split_harmony(text: str, final: bool) -> tuple[str, str]:
    """``(reasoning, answer)`` of an output or (``final`` False) a prefix of it; each a
    prefix of what the whole output gives."""
    reasoning: list[str] = []
    answer = ""
    for part in parse_harmony(text, final):
        if part.channel == "analysis":
            reasoning.append(part.body)
        elif part.recipient is not None:
            answer += part.raw
        else:
            answer += part.body
    return "\n".join(reasoning).strip(), answer.lstrip()


@ReasoningParserManager.register_module("openai_gptoss")
class GptOssReasoningParser(ThinkTagReasoningParser):
    """gpt-oss' ``analysis`` channel as reasoning (see the module). The reasoning ends at
    the answer's header, ``<|channel|>final<|message|>`` (structured outputs apply after
    it; a prompt that ends with it is all answer)."""

    end_tag = FINAL_HEADER
    starts_in_reasoning = True

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        request.skip_special_tokens = False  # the harmony markers are special tokens
        return request

    def split(self, text: str, final: bool) -> tuple[str, str, bool]:
        reasoning, answer = split_harmony(text, final)
        return reasoning, answer, bool(reasoning)

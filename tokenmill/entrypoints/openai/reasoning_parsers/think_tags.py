"""Reasoning between ``<think>`` and ``</think>``: ``deepseek_r1`` and ``qwen3``.

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ, and templates that open the thinking in
  the prompt): the output is reasoning until ``</think>``; the opening tag may or may not be
  in the output. Without ``</think>`` the whole output is reasoning.
- ``qwen3`` (Qwen3's hybrid thinking): reasoning only when the output opens with
  ``<think>``; otherwise it is all answer (``enable_thinking: false``, or a model that does
  not think).

Either way, an output after a prompt that already ends with ``</think>`` (thinking turned
off in the template) is all answer; the reasoning is stripped of surrounding whitespace and
the answer of leading whitespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.entrypoints.openai.protocol import DeltaMessage
from tokenmill.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
    ReasoningParserManager,
)
from tokenmill.entrypoints.openai.tool_parsers.markup_parser import visible

# Prompt tokens read back to see whether the prompt closed the thinking.
_PROMPT_TAIL_TOKENS = 16


class ThinkTagReasoningParser(ReasoningParser):
    """Reasoning inside ``start_tag`` ... ``end_tag``.

    Attributes:
        start_tag, end_tag: the markers.
        starts_in_reasoning: an output without the opening tag begins in reasoning.
    """

    start_tag = "<think>"
    end_tag = "</think>"
    starts_in_reasoning = False

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    def split(self, text: str, final: bool) -> tuple[str, str, bool]:
        """``(reasoning, content, has_reasoning)`` of ``text`` (a prefix of the output unless
        ``final``). Each part of a prefix is a prefix of that part of any longer text."""
        i = len(text) - len(text.lstrip())
        if text.startswith(self.start_tag, i):
            body, in_reasoning = i + len(self.start_tag), True
        elif not final and self.start_tag.startswith(text[i:]):
            return "", "", False  # may still open with the tag
        else:
            body, in_reasoning = 0, self.starts_in_reasoning
        if not in_reasoning:
            return "", text, False
        end = text.find(self.end_tag, body)
        if end < 0:
            return visible(text[body:], final, [self.end_tag]).strip(), "", True
        content = text[end + len(self.end_tag) :].lstrip()
        return text[body:end].strip(), content, True

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        tail = self.model_tokenizer.decode(list(input_ids[-_PROMPT_TAIL_TOKENS:]))
        return tail.rstrip().endswith(self.end_tag)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        end = self.reasoning_end_token_ids()
        if end:
            for i in range(len(input_ids) - len(end), -1, -1):
                if input_ids[i : i + len(end)] == end:
                    return input_ids[i + len(end) :]
        return [] if self.starts_in_reasoning else list(input_ids)

    def extract_reasoning_content(
        self, model_output: str, request: Any = None
    ) -> tuple[str | None, str | None]:
        reasoning, content, _ = self.split(model_output, True)
        return reasoning or None, content or None

    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        self._text = current_text
        return self._delta(final=False)

    def finish_streaming(self) -> DeltaMessage | None:
        return self._delta(final=True)

    def _delta(self, final: bool) -> DeltaMessage | None:
        reasoning, content, _ = self.split(self._text, final)
        new_reasoning = reasoning[self._sent_reasoning :]
        new_content = content[self._sent_content :]
        self._sent_reasoning = max(self._sent_reasoning, len(reasoning))
        self._sent_content = max(self._sent_content, len(content))
        if not new_reasoning and not new_content:
            return None
        delta = DeltaMessage()
        if new_reasoning:
            delta.reasoning_content = new_reasoning
        if new_content:
            delta.content = new_content
        return delta

    def reasoning_end_token_ids(self) -> list[int] | None:
        return list(self.model_tokenizer.encode(self.end_tag, add_special_tokens=False))


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """Reasoning until ``</think>``, with or without ``<think>`` in the output."""

    starts_in_reasoning = True


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Reasoning only inside an output that opens with ``<think>``."""

    starts_in_reasoning = False

"""One choice's output, split into reasoning, content and tool calls, whole or streamed.

The reasoning parser (``--reasoning-parser``) takes the raw text first; the answer it leaves
goes to the tool parser of the request's plan (``--tool-call-parser`` for ``auto``, the
forced parsers for ``required`` and a named function).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.entrypoints.openai.chat_tools import ToolPlan, ToolSettings
from tokenmill.entrypoints.openai.protocol import DeltaMessage
from tokenmill.entrypoints.openai.protocol_tools import ToolCall
from tokenmill.entrypoints.openai.tool_parsers.forced import (
    NamedToolCallParser,
    RequiredToolCallParser,
)

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
    from tokenmill.entrypoints.openai.reasoning_parsers import ReasoningParser
    from tokenmill.entrypoints.openai.tool_parsers import ToolParser


@dataclass
class ParsedChoice:
    """A whole output, split."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChoiceParser:
    """Splits one sequence's output (a choice).

    Args:
        request: the chat request.
        plan: how its tools are served.
        reasoning: a reasoning parser for this sequence, or None.
        tools: a tool parser for this sequence, or None.
    """

    def __init__(
        self,
        request: ChatCompletionRequest,
        plan: ToolPlan,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
    ) -> None:
        self.request = request
        self.plan = plan
        self.reasoning = reasoning
        self.tools = tools
        self.called_tools = False
        self._text = ""
        self._token_ids: list[int] = []
        self._content = ""  # the answer's text so far (after the reasoning)

    # ---- whole outputs --------------------------------------------------------------------

    def parse(self, text: str) -> ParsedChoice:
        """The reasoning, content and tool calls of a whole output."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning_content(text, self.request)
        parsed = ParsedChoice(content=content, reasoning_content=reasoning)
        if self.tools is not None:
            info = self.tools.extract_tool_calls(content or "", self.request)
            if info.tools_called:
                calls = info.tool_calls if self.plan.parallel else info.tool_calls[:1]
                parsed.content, parsed.tool_calls = info.content, calls
                self.called_tools = True
        return parsed

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish reason: ``tool_calls`` for an output that ended by itself after
        calling tools (``auto`` or ``required``; a named function keeps ``stop``)."""
        if reason == "stop" and self.called_tools and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    # ---- streams --------------------------------------------------------------------------

    def stream(self, delta_text: str, delta_ids: Sequence[int], finished: bool) -> DeltaMessage:
        """The delta to send for the newest piece of the output (possibly empty), with what
        was held back when ``finished``."""
        out = DeltaMessage()
        previous, self._text = self._text, self._text + delta_text
        previous_ids = list(self._token_ids)
        self._token_ids.extend(delta_ids)
        if self.reasoning is None:
            answer = delta_text
        else:
            step = self.reasoning.extract_reasoning_content_streaming(
                previous, self._text, delta_text, previous_ids, self._token_ids, list(delta_ids)
            )
            if finished:
                step = _merge(step, self.reasoning.finish_streaming())
            answer = (step.content or "") if step is not None else ""
            if step is not None and step.reasoning_content:
                out.reasoning_content = step.reasoning_content
        if self.tools is None:
            if answer:
                out.content = answer
            return out
        self._stream_tools(answer, delta_ids, finished, out)
        return out

    def _stream_tools(
        self, answer: str, delta_ids: Sequence[int], finished: bool, out: DeltaMessage
    ) -> None:
        assert self.tools is not None
        step = None
        if answer or not finished:
            previous, self._content = self._content, self._content + answer
            step = self.tools.extract_tool_calls_streaming(
                previous,
                self._content,
                answer,
                self._token_ids[: len(self._token_ids) - len(delta_ids)],
                self._token_ids,
                list(delta_ids),
                self.request,
            )
        if finished:
            step = _merge(step, self.tools.finish_streaming(self.request))
        if step is None:
            return
        if step.content:
            out.content = step.content
        calls = step.tool_calls or []
        if not self.plan.parallel:
            calls = [c for c in calls if c.index == 0]
        if calls:
            out.tool_calls = calls
            self.called_tools = True


def _merge(first: DeltaMessage | None, second: DeltaMessage | None) -> DeltaMessage | None:
    """Two deltas as one: texts concatenated, tool-call pieces in order."""
    if first is None or second is None:
        return first or second
    merged = DeltaMessage()
    for name in ("content", "reasoning_content"):
        text = (getattr(first, name) or "") + (getattr(second, name) or "")
        if text:
            setattr(merged, name, text)
    calls = (first.tool_calls or []) + (second.tool_calls or [])
    if calls:
        merged.tool_calls = calls
    return merged


def choice_parsers(
    request: ChatCompletionRequest,
    plan: ToolPlan,
    settings: ToolSettings,
    tokenizer: Any,
    prompt_ids: Sequence[int],
) -> list[ChoiceParser] | None:
    """One parser per choice (``n``), or None when the output is plain text (no reasoning
    parser, no tools called)."""
    reasoning_cls = settings.reasoning_parser
    if reasoning_cls is not None and reasoning_cls(tokenizer).is_reasoning_end(prompt_ids):
        reasoning_cls = None  # the template closed the thinking: all answer
    if reasoning_cls is None and plan.mode == "off":
        return None
    parsers = []
    for _ in range(request.n or 1):
        tools: ToolParser | None = None
        if plan.mode == "auto" and settings.tool_parser is not None:
            tools = settings.tool_parser(tokenizer)
        elif plan.mode == "named":
            tools = NamedToolCallParser(tokenizer, plan.name or "")
        elif plan.mode == "required":
            tools = RequiredToolCallParser(tokenizer)
        reasoning = reasoning_cls(tokenizer) if reasoning_cls is not None else None
        parsers.append(ChoiceParser(request, plan, reasoning, tools))
    return parsers


def reasoning_end_ids(
    settings: ToolSettings, tokenizer: Any, prompt_ids: Sequence[int]
) -> list[int] | None:
    """The token ids after which a constraint applies (the end of the reasoning), or None
    when it applies from the start (no reasoning parser, or the prompt closed the
    thinking)."""
    cls = settings.reasoning_parser
    if cls is None:
        return None
    parser = cls(tokenizer)
    if parser.is_reasoning_end(prompt_ids):
        return None
    return parser.reasoning_end_token_ids()

"""Tool-calling models of the OpenAI chat API (pydantic): the tools a request offers, the
calls a response carries, and their streamed deltas.

Names and shapes follow the OpenAI API reference (``tools``, ``tool_choice``,
``message.tool_calls``, ``delta.tool_calls``) and vLLM's ``ExtractedToolCallInformation``,
so tool parsers written for vLLM's interface port with their imports changed.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    """Request-side models: strict types, unknown fields ignored (as OpenAIBaseModel)."""

    model_config = ConfigDict(strict=True, extra="ignore")


def tool_call_id() -> str:
    """A fresh tool call id in OpenAI's form: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- request -----------------------------------------------------------------------------------


class FunctionDefinition(_Strict):
    """A function the model may call: its name, what it does and its arguments' JSON Schema."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_Strict):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class ChatCompletionNamedToolChoiceParam(_Strict):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name"}}``."""

    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCallParam(_Strict):
    """A past call in an assistant message: ``arguments`` is the JSON text of the arguments."""

    name: str
    arguments: str


class ToolCallParam(_Strict):
    """One entry of an assistant message's ``tool_calls`` in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


# ---- response ----------------------------------------------------------------------------------


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call the model made: ``function.arguments`` is JSON text."""

    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: the first piece of call ``index`` carries its id,
    type and name; the later ones carry argument text to append."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ExtractedToolCallInformation(BaseModel):
    """What a tool parser found in a whole output (vLLM's interface).

    Attributes:
        tools_called: whether the output is (or holds) tool calls.
        tool_calls: the calls, in order.
        content: the text outside the calls, or None when there is none.
    """

    tools_called: bool
    tool_calls: list[ToolCall] = Field(default_factory=list)
    content: str | None = None

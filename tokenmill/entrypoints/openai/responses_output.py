"""Response objects of the Responses API: the response envelope, its output items
(``reasoning``, ``message``, ``function_call``) and its usage, as the OpenAI API reference
shapes them; and the streamed events (``response.created`` ... ``response.completed``).

The objects are built as dicts; the pydantic models at the end describe the same shapes in
the OpenAPI document (tests/entrypoints/test_openapi.py checks the answers against them).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from tokenmill.entrypoints.openai.protocol import ChatCompletionMessage, UsageInfo
from tokenmill.entrypoints.openai.responses_input import ResponsesRequest
from tokenmill.entrypoints.openai.tool_parsers.json_scan import is_json_object


def item_id(prefix: str) -> str:
    """An output item id such as ``msg_3f2a...`` (OpenAI's prefixes: resp, msg, fc, rs)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def envelope(request: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response object before its output: status ``in_progress``, the request's
    settings echoed."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "metadata": request.metadata or {},
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "previous_response_id": request.previous_response_id,
        "tools": request.tools or [],
        "tool_choice": request.tool_choice or "auto",
        "text": request.text or {"format": {"type": "text"}},
        "reasoning": request.reasoning or {"effort": None, "summary": None},
        "truncation": request.truncation or "disabled",
        "store": request.store is not False,
        "background": False,
        "user": request.user,
        "usage": None,
    }


def reasoning_item(text: str, item: str | None = None, status: str = "completed") -> dict:
    return {
        "type": "reasoning",
        "id": item or item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
        "status": status,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, item: str | None = None, status: str = "completed") -> dict:
    content = [text_part(text)] if text is not None else []
    return {
        "type": "message",
        "id": item or item_id("msg"),
        "role": "assistant",
        "status": status,
        "content": content,
    }


def function_call_item(
    call_id: str, name: str, arguments: str, item: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item or item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: ChatCompletionMessage) -> list[dict[str, Any]]:
    """A chat answer as output items: its reasoning, its text, its calls (in that order)."""
    items = []
    if message.reasoning_content:
        items.append(reasoning_item(message.reasoning_content))
    if message.content:
        items.append(message_item(message.content))
    for call in message.tool_calls:
        items.append(function_call_item(call.id, call.function.name, call.function.arguments))
    return items


def usage(chat_usage: UsageInfo | None, reasoning_tokens: int) -> dict[str, Any]:
    """The Responses API's usage from chat's counts."""
    u = chat_usage or UsageInfo()
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": u.total_tokens,
    }


def finish(body: dict[str, Any], finish_reason: str | None) -> None:
    """Set the final status: ``incomplete`` (max_output_tokens) when the answer was cut, and
    then so is the output item it was writing (its last message, reasoning or function
    call), as OpenAI's."""
    if finish_reason == "length":
        body["status"] = "incomplete"
        body["incomplete_details"] = {"reason": "max_output_tokens"}
        output = body.get("output") or []
        if output and output[-1].get("type") in ("message", "reasoning", "function_call"):
            output[-1]["status"] = "incomplete"
    else:
        body["status"] = "completed"


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the assistant chat message that continues the conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in items:
        if item["type"] == "reasoning" and item["content"]:
            message["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            message["content"] = "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            if item.get("status") == "incomplete" and not is_json_object(item["arguments"]):
                continue  # cut by max_output_tokens: no call was made (nothing can answer it)
            call = {"name": item["name"], "arguments": item["arguments"]}
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": call}
            )
    if message["content"] is None and "tool_calls" not in message:
        message["content"] = ""
    return [message]


def sse(event: dict[str, Any]) -> str:
    """One server-sent event: ``event: <type>`` and its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


# ---- the shapes above, for the OpenAPI document ----------------------------------------------


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"]
    id: str
    summary: list[dict[str, Any]]
    content: list[ReasoningText]
    status: str


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class MessageItem(BaseModel):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: str
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="The call's arguments as JSON text.")
    status: str


OutputItem = Annotated[ReasoningItem | MessageItem | FunctionCallItem, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    """A response (``envelope`` once answered): its output items, usage and the request's
    settings."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[OutputItem]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    instructions: str | None
    metadata: dict[str, Any]
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    previous_response_id: str | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    text: dict[str, Any]
    reasoning: dict[str, Any]
    truncation: str
    store: bool
    background: bool
    user: str | None
    usage: ResponseUsage | None


class ResponseDeleted(BaseModel):
    """DELETE /v1/responses/{id}'s answer."""

    id: str
    object: Literal["response"]
    deleted: bool

"""Requests of Anthropic's Messages API and their translation into a chat request.

Served: ``model``, ``max_tokens`` (required), ``messages`` with text, ``tool_use``,
``tool_result``, ``thinking`` and (in user turns) ``image`` blocks (base64 or URL sources,
as the chat request's ``image_url`` parts), ``system`` (text or text blocks), ``stop_sequences``,
``stream``, ``temperature``, ``top_p``, ``top_k``, custom ``tools`` (``input_schema``),
``tool_choice`` (auto, any, tool, none; ``disable_parallel_tool_use``), ``thinking``
(enabled or disabled: the template's ``enable_thinking``), ``metadata``; plus vLLM's
``chat_template_kwargs``. Documents, server tools (web search, code execution...),
``container`` and ``mcp_servers`` are a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.sampling_params import MAX_STOP_STRINGS

_UNSERVED = ("container", "mcp_servers")


class MessagesRequest(BaseModel):
    """POST /v1/messages (Anthropic's request); strict types (``"5"`` is not a number)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: (
        Annotated[list[str], Field(json_schema_extra={"maxItems": MAX_STOP_STRINGS})] | None
    ) = None
    stream: bool = False
    # The bounds the chat request enforces on the fields they become.
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, description="-1 or 0: no top-k")] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    container: Any = None
    mcp_servers: Any = None


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without ``max_tokens``."""

    max_tokens: Annotated[int, Field(ge=1)] = 1


def _text(content: Any, field: str) -> str:
    """Text content: a string or text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{field} must be a string or a list of content blocks.", field)
    texts = []
    for j, block in enumerate(content):
        if not (isinstance(block, dict) and block.get("type") == "text"):
            kind = block.get("type") if isinstance(block, dict) else None
            where = f"{field}.{j}.type"
            raise bad_request(f"{where}: only text blocks are supported here, not {kind!r}.", where)
        texts.append(_str(block, "text", f"{field}.{j}"))
    return "".join(texts)


def _str(block: dict[str, Any], key: str, field: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{field}.{key} must be a string.", f"{field}.{key}")
    return value


_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _image_part(block: dict[str, Any], field: str) -> dict[str, Any]:
    """An image block (``source``: base64 data with its media type, or a URL) as the chat
    request's ``image_url`` part."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media = _str(source, "media_type", f"{field}.source")
        if media not in _IMAGE_TYPES:
            types = ", ".join(_IMAGE_TYPES)
            raise bad_request(f"{field}.source.media_type must be one of {types}.",
                              f"{field}.source.media_type")  # fmt: skip
        url = f"data:{media};base64,{_str(source, 'data', f'{field}.source')}"
    elif kind == "url":
        url = _str(source, "url", f"{field}.source")
    else:
        raise bad_request(f"{field}.source.type must be 'base64' or 'url', not {kind!r}.",
                          f"{field}.source.type")  # fmt: skip
    return {"type": "image_url", "image_url": {"url": url}}


def _user_messages(content: Any, field: str, tool_ids: set[str]) -> list[dict[str, Any]]:
    """A user turn: its tool results (each a tool message), then its text and images in
    their order."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{field} must be a string or a list of content blocks.", field)
    messages, texts, parts = [], [], []
    for j, block in enumerate(content):
        where = f"{field}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_str(block, "text", where))
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image":
            parts.append(_image_part(block, where))
        elif kind == "tool_result":
            tool_use_id = _str(block, "tool_use_id", where)
            if tool_use_id not in tool_ids:
                raise bad_request(
                    f"{where}.tool_use_id: {tool_use_id!r} answers no earlier tool_use block.",
                    f"{where}.tool_use_id",
                )
            result = _text(block.get("content", ""), f"{where}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            messages.append({"role": "tool", "tool_call_id": tool_use_id, "content": result})
        else:
            raise bad_request(
                f"{where}.type: content blocks of type {kind!r} are not supported.",
                f"{where}.type",
            )
    if len(parts) > len(texts):  # images: the parts in order
        messages.append({"role": "user", "content": parts})
    elif texts:
        messages.append({"role": "user", "content": "".join(texts)})
    return messages


def _assistant_message(content: Any, field: str, tool_ids: set[str]) -> dict[str, Any]:
    """An assistant turn: text, thinking (reasoning_content) and tool_use blocks (calls)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{field} must be a string or a list of content blocks.", field)
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, block in enumerate(content):
        where = f"{field}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            message["content"] += _str(block, "text", where)
        elif kind == "thinking":
            message["reasoning_content"] = _str(block, "thinking", where)
        elif kind == "tool_use":
            call_id = _str(block, "id", where)
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad_request(f"{where}.input must be an object.", f"{where}.input")
            tool_ids.add(call_id)
            function = {"name": _str(block, "name", where), "arguments": json.dumps(arguments)}
            message.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": function}
            )
        else:
            raise bad_request(
                f"{where}.type: content blocks of type {kind!r} are not supported.",
                f"{where}.type",
            )
    return message


def chat_messages(request: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages, the system prompt first.

    Raises:
        OpenAIError: 400 naming the block at fault.
    """
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": _text(request.system, "system")})
    tool_ids: set[str] = set()
    for i, message in enumerate(request.messages):
        field = f"messages.{i}"
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role == "user":
            messages += _user_messages(content, f"{field}.content", tool_ids)
        elif role == "assistant":
            messages.append(_assistant_message(content, f"{field}.content", tool_ids))
        else:
            raise bad_request(f"{field}.role must be user or assistant.", f"{field}.role")
    return messages


def _tools(request: MessagesRequest) -> list[dict[str, Any]] | None:
    if not request.tools:
        return None
    tools = []
    for i, tool in enumerate(request.tools):
        if tool.get("type") not in (None, "custom"):
            raise bad_request(
                f"tools.{i}.type: server tools ({tool.get('type')!r}) are not supported; give "
                "custom tools with input_schema.",
                f"tools.{i}.type",
            )
        if not isinstance(tool.get("input_schema"), dict):
            # Anthropic requires it: an object (a JSON schema of the tool's input).
            raise bad_request(f"tools.{i}.input_schema: Field required (a JSON schema object).",
                              f"tools.{i}.input_schema")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Chat's ``tool_choice`` and ``parallel_tool_calls`` for Anthropic's ``tool_choice``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request(
        "tool_choice.type must be auto, any, tool (with a name) or none.", "tool_choice"
    )


def _template_kwargs(request: MessagesRequest) -> dict[str, Any] | None:
    kwargs = dict(request.chat_template_kwargs or {})
    if request.thinking is not None:
        kind = request.thinking.get("type")
        if kind not in ("enabled", "disabled"):
            raise bad_request("thinking.type must be enabled or disabled.", "thinking")
        kwargs.setdefault("enable_thinking", kind == "enabled")
    return kwargs or None


def to_chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that serves a Messages request.

    Raises:
        OpenAIError: 400 naming the field at fault.
    """
    for name in _UNSERVED:
        if getattr(request, name) is not None:
            raise bad_request(f"tokenmill does not implement {name}.", name)
    tool_choice, parallel = _tool_choice(request.tool_choice)
    body: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(request),
        "max_completion_tokens": request.max_tokens,
        "stop": request.stop_sequences,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "tools": _tools(request),
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": _template_kwargs(request),
        "stream": request.stream,
    }
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}, strict=False
        )
    except ValidationError as e:
        error = e.errors()[0]
        loc = ".".join(str(p) for p in error.get("loc", ()))
        loc = loc.replace("max_completion_tokens", "max_tokens").replace(
            ".function.parameters", ".input_schema").replace(".function.", ".")
        raise bad_request(f"{loc}: {error.get('msg')}", loc.split(".")[0] or None) from None


# ---- answers, for the OpenAPI document (serving_messages.py builds them as dicts) ------------


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]


class MessageUsage(BaseModel):
    input_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    """POST /v1/messages' answer: the assistant's content blocks and why it stopped."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error of the Messages API: ``{"type": "error", "error": {"type", "message"}}``."""

    type: Literal["error"]
    error: AnthropicErrorDetail

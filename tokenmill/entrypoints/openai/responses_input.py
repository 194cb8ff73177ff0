"""POST /v1/responses requests (the OpenAI Responses API) and their translation into a chat
request: input items to messages, function tools, ``tool_choice`` and ``text.format``.

Served: ``input`` as text or items (messages with text parts -- and ``input_image`` parts
with an ``image_url`` in user messages, as the chat request's image parts -- ``function_call``,
``function_call_output`` and ``reasoning`` items), ``instructions``, function ``tools``,
``tool_choice``, ``parallel_tool_calls``, ``previous_response_id``, ``store``, ``stream``,
``temperature``, ``top_p``, ``max_output_tokens``, ``text.format`` (text, json_object,
json_schema), ``metadata``, ``user``. Anything else that would change the answer (hosted
tools, files, ``background``, ``conversation``, ...) is a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest

_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
# Fields that would change the answer and are not served: given (not null), a 400.
_UNSERVED = ("background", "conversation", "prompt", "top_logprobs", "max_tool_calls")


class ResponsesRequest(BaseModel):
    """POST /v1/responses (OpenAI's Responses API), plus vLLM's ``chat_template_kwargs``;
    strict types, as the chat request (``"5"`` is not a number)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    # The bounds the chat request enforces on the fields they become.
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None


def check_served(request: ResponsesRequest) -> None:
    """Raises a 400 naming the first field given that the server does not serve."""
    for name in _UNSERVED:
        value = getattr(request, name)
        if value is not None and value is not False:
            raise bad_request(f"tokenmill does not implement {name} on /v1/responses.", name)
    if request.truncation == "auto":
        raise bad_request(
            'truncation "auto" is not implemented: a conversation too long for the context '
            "is refused.",
            "truncation",
        )
    reasoning = request.reasoning or {}
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) is not None:
            raise bad_request(
                f"reasoning.{key} is not implemented; the model's reasoning comes back whole "
                "(see --reasoning-parser), and chat_template_kwargs such as enable_thinking "
                "turn it on or off.",
                "reasoning",
            )
    for item in request.include or []:
        if item != "reasoning.encrypted_content":  # a no-op: reasoning is returned in clear
            raise bad_request(f"include {item!r} is not implemented.", "include")


def _text_of(content: Any, field: str) -> str:
    """The text of a message's content: a string, or text parts joined.

    Raises:
        OpenAIError: 400 naming the part that is not text (an image, a file, audio).
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{field} must be a string or a list of content parts.", field)
    return "".join(_part_text(part, f"{field}.{j}", " (text only)")
                   for j, part in enumerate(content))  # fmt: skip


def _part_text(part: Any, field: str, only: str = "") -> str:
    """A text part's text.

    Raises:
        OpenAIError: 400 naming the part's type when it is not a text part.
    """
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
        where = f"{field}.type"
        raise bad_request(f"{where}: content parts of type {kind!r} are not supported{only}.",
                          where)  # fmt: skip
    return part["text"]


class _Conversation:
    """Chat messages built from input items: consecutive function calls become one
    assistant message's tool_calls; a reasoning item goes with the assistant turn after it."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = messages
        self._reasoning: str | None = None

    def add(self, item: Any, i: int) -> None:
        field = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_request(f"{field} must be an object.", field)
        kind = item.get("type", "message")
        if kind == "message":
            self._message(item, field)
        elif kind == "function_call":
            self._function_call(item, field)
        elif kind == "function_call_output":
            output = item.get("output")
            output = output if isinstance(output, str) else _text_of(output, f"{field}.output")
            call_id = _required_str(item, "call_id", field)
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            self._reasoning = _text_of(parts, f"{field}.content")
        else:
            raise bad_request(
                f"{field}.type: input items of type {kind!r} are not supported.", f"{field}.type"
            )

    def _message(self, item: dict[str, Any], field: str) -> None:
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request(
                f"{field}.role must be user, system, developer or assistant.", f"{field}.role"
            )
        content = item.get("content")
        message: dict[str, Any] = {
            "role": role,
            "content": (_user_parts(content, f"{field}.content") if role == "user"
                        and _has_images(content) else _text_of(content, f"{field}.content")),
        }  # fmt: skip
        if role == "assistant" and self._reasoning is not None:
            message["reasoning_content"], self._reasoning = self._reasoning, None
        self.messages.append(message)

    def _function_call(self, item: dict[str, Any], field: str) -> None:
        call = {
            "id": _required_str(item, "call_id", field),
            "type": "function",
            "function": {
                "name": _required_str(item, "name", field),
                "arguments": _required_str(item, "arguments", field),
            },
        }
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self._reasoning is not None:
            last = {"role": "assistant", "content": None}
            if self._reasoning is not None:
                last["reasoning_content"], self._reasoning = self._reasoning, None
            self.messages.append(last)
        last.setdefault("tool_calls", []).append(call)


def _has_images(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") == "input_image" for p in content
    )


def _user_parts(content: list[Any], field: str) -> list[dict[str, Any]]:
    """A user message's text and ``input_image`` parts (``image_url``: a URL or a data URL)
    as the chat request's parts, in their order.

    Raises:
        OpenAIError: 400 naming an image part without an ``image_url`` (a ``file_id``) or a
            part of another kind.
    """
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                where = f"{field}.{j}.image_url"
                raise bad_request(f"{where} must be a URL or a data URL (file_id is not "
                                  "supported).", where)  # fmt: skip
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _part_text(part, f"{field}.{j}")})
    return parts


def _required_str(item: dict[str, Any], key: str, field: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{field}.{key} must be a string.", f"{field}.{key}")
    return value


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of the request's ``input`` (without instructions or history).

    Raises:
        OpenAIError: 400 naming the item or part at fault.
    """
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    conversation = _Conversation([])
    for i, item in enumerate(request.input):
        conversation.add(item, i)
    return conversation.messages


def chat_tools(request: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The function tools in chat form.

    Raises:
        OpenAIError: 400 for a tool that is not a function (hosted tools are not served).
    """
    if not request.tools:
        return None
    tools = []
    for i, tool in enumerate(request.tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools.{i}.type: only function tools are supported, not {tool.get('type')!r}.",
                f"tools.{i}.type",
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        tools.append({"type": "function", "function": function})
    return tools


def chat_tool_choice(choice: Any) -> Any:
    """``tool_choice`` in chat form (``{"type": "function", "name"}`` -> chat's named form).

    Raises:
        OpenAIError: 400 for a choice of a hosted tool or of allowed tools.
    """
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "name": ...}.',
        "tool_choice",
    )


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        spec = {"name": fmt.get("name", "output"), "schema": fmt.get("schema")}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


# The chat request's fields under the names a Responses request gives them (errors name
# the field the client sent).
CHAT_TO_RESPONSES_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
    "response_format": "text.format",
}


def to_chat_request(
    request: ResponsesRequest, history: list[dict[str, Any]], messages: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request that serves ``request``: instructions as the system message, then
    the stored ``history`` (``previous_response_id``), then the new input ``messages``.

    Raises:
        OpenAIError: 400 naming the field at fault.
    """
    conversation = list(history) + list(messages)
    if request.instructions:
        conversation.insert(0, {"role": "system", "content": request.instructions})
    body: dict[str, Any] = {
        "model": request.model,
        "messages": conversation,
        "tools": chat_tools(request),
        "tool_choice": chat_tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_completion_tokens": request.max_output_tokens,
        "response_format": response_format(request.text),
        "chat_template_kwargs": request.chat_template_kwargs,
        "reasoning_effort": (request.reasoning or {}).get("effort"),
        "stream": bool(request.stream),
        "user": request.user,
    }
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}, strict=False
        )
    except ValidationError as e:
        error = e.errors()[0]
        parts = [str(p) for p in error.get("loc", ())]
        if parts and parts[0] in CHAT_TO_RESPONSES_NAMES:
            parts[0] = CHAT_TO_RESPONSES_NAMES[parts[0]]
        loc = ".".join(parts)
        param = parts[0] if parts else None
        raise bad_request(f"{loc}: {error.get('msg')}", param) from None

"""Chat messages as the chat template takes them: the conversation (text and image content
parts, tool calls and tool results), the template's extra variables, and the size of the
messages for the context check made before rendering."""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.chat_images import image_part_url
from tokenmill.entrypoints.openai.chat_tools import tool_message_fields, tools_for_template
from tokenmill.entrypoints.openai.errors import bad_request

# Parameters of the rendering call itself, which chat_template_kwargs may not override
# (the rest reach the template as variables).
RENDER_PARAMETERS = frozenset(
    {
        "conversation", "messages", "chat_template", "add_generation_prompt", "tokenize",
        "tokenizer", "self", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "tokenizer_kwargs", "return_assistant_tokens_mask",
    }
)  # fmt: skip


def template_conversation(messages: list[Any], images: list | None = None) -> list[dict[str, Any]]:
    """The messages as the chat template's ``conversation``; an ``image_url`` part becomes
    an image part and its ``(url, field)`` is appended to ``images``.

    Raises:
        OpenAIError: 400 when a content part is neither text nor (with ``images``) an
            image, or a non-assistant message has no content.
    """
    conversation = []
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        content: Any = message.content
        if isinstance(content, list):
            content = content_parts(content, i, images)
        elif content is None:
            if message.role != "assistant" and not message.tool_calls:
                raise bad_request(
                    f"messages[{i}]: a {message.role} message needs content.",
                    f"messages.{i}.content",
                )
            content = ""
        entry: dict[str, Any] = {"role": message.role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        entry.update(tool_message_fields(message, i, call_ids))
        conversation.append(entry)
    return conversation


def template_kwargs(request: Any, template: Any) -> dict[str, Any]:
    """The variables the chat template gets besides the messages: the request's
    ``chat_template_kwargs``, its ``tools``, ``reasoning_effort`` and
    ``continue_final_message``. ``template`` is the chat template that renders them (its
    text, or the tokenizer's dict of named templates).

    Raises:
        OpenAIError: 400 when ``chat_template_kwargs`` names a parameter of the rendering
            call, or ``reasoning_effort`` is given and the template does not read it.
    """
    kwargs: dict[str, Any] = dict(getattr(request, "chat_template_kwargs", None) or {})
    tools = tools_for_template(request)
    if tools is not None:
        kwargs["tools"] = tools
    reserved = sorted(set(kwargs) & RENDER_PARAMETERS)
    if reserved:
        raise bad_request(
            f"chat_template_kwargs cannot set {', '.join(reserved)}: the server decides "
            "how the template is rendered (use the request's own fields, e.g. "
            "add_generation_prompt).",
            "chat_template_kwargs",
        )
    effort = getattr(request, "reasoning_effort", None)
    if effort is not None:
        # NOTE: a template that never reads the variable would silently ignore the effort.
        if "reasoning_effort" not in str(template or ""):
            raise bad_request(
                "reasoning_effort is not read by this model's chat template (gpt-oss' "
                "template reads it); leave it out.",
                "reasoning_effort",
            )
        kwargs["reasoning_effort"] = effort
    if getattr(request, "continue_final_message", False):
        kwargs["continue_final_message"] = True
    return kwargs


def content_parts(parts: list[Any], i: int, images: list | None) -> list[dict[str, Any]]:
    """A message's content parts as the chat template takes them."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if part.type == "image_url" and images is not None:
            images.append((image_part_url(part, f"messages.{i}.content.{j}"),
                           f"messages.{i}.content.{j}.image_url"))  # fmt: skip
            out.append({"type": "image"})
            continue
        if part.type != "text":
            raise bad_request(
                f"messages[{i}]: content parts of type {part.type!r} are not supported "
                "(text parts, and image_url parts for models that take images).",
                f"messages.{i}.content",
            )
        if part.text is None:
            raise bad_request(
                f"messages[{i}]: a text content part needs its 'text'.",
                f"messages.{i}.content",
            )
        out.append({"type": "text", "text": part.text})
    return out


def content_chars(content: Any) -> int:
    """Characters of a message's content: a string, text parts, or none."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(getattr(part, "text", None) or "") for part in content)
    return 0

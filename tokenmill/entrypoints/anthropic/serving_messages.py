"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens.

A Messages request is served as a chat request (``protocol.to_chat_request``); the answer
comes back as content blocks (``thinking``, ``text``, ``tool_use``) with Anthropic's stop
reasons (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``). Streams send
Anthropic's events: ``message_start``, ``ping``, per block ``content_block_start``, its
``content_block_delta`` events (``thinking_delta``, ``text_delta``, ``input_json_delta``)
and ``content_block_stop``, then ``message_delta`` (stop reason, output tokens) and
``message_stop``; an error after the start is an ``error`` event.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.entrypoints.anthropic.errors import error_event
from tokenmill.entrypoints.anthropic.protocol import MessagesRequest, to_chat_request
from tokenmill.entrypoints.openai.errors import OpenAIError
from tokenmill.entrypoints.openai.protocol import ChatCompletionMessage
from tokenmill.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from tokenmill.entrypoints.openai.serving_engine import to_openai_error
from tokenmill.entrypoints.openai.serving_responses import rename_param

logger = logging.getLogger(__name__)


def tool_use_id(call_id: str) -> str:
    """A chat tool call's id in Anthropic's form (``call_x`` -> ``toolu_x``); a
    ``tool_result`` answers it by this id, which the chat path then takes as the call's."""
    return "toolu_" + call_id.removeprefix("call_")


def _stop_reason(
    finish_reason: str | None, stop_reason: Any, called_tools: bool, stop_sequences: list[str]
) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for a chat finish."""
    if called_tools:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return "end_turn", None


def content_blocks(message: ChatCompletionMessage) -> list[dict[str, Any]]:
    """A chat answer as content blocks: thinking, text, then tool_use."""
    blocks: list[dict[str, Any]] = []
    if message.reasoning_content:
        blocks.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:  # a plugin parser's malformed arguments: an object all the same
            arguments = None
        if not isinstance(arguments, dict):
            logger.warning("tool call %s: arguments are not a JSON object", call.id)
            arguments = {}
        blocks.append(
            {"type": "tool_use", "id": tool_use_id(call.id), "name": call.function.name,
             "input": arguments}
        )
    return blocks


class AnthropicServingMessages:
    """Serves the Messages API on top of the chat handler.

    Args:
        chat: the chat completions handler.
    """

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, request: MessagesRequest) -> Response:
        """Answer one Messages request (streaming or not).

        Raises:
            OpenAIError: 400 naming the field at fault, 404 for an unknown model, 503 if
                the engine is dead (the route answers them in Anthropic's shape).
        """
        chat_request = to_chat_request(request)
        try:
            run = await self.chat.start_chat(chat_request)
        except OpenAIError as e:
            raise rename_param(
                e, {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}
            ) from None
        message_id = f"msg_{uuid.uuid4().hex}"
        if request.stream:
            return StreamingResponse(
                self._events(request, run, message_id), media_type="text/event-stream"
            )
        response = await self.chat.full_response(run)
        choice = response.choices[0]
        stop_reason, stop_sequence = _stop_reason(
            choice.finish_reason,
            choice.stop_reason,
            bool(choice.message.tool_calls),
            request.stop_sequences or [],
        )
        body = self._message(
            run, message_id, content_blocks(choice.message), stop_reason, stop_sequence
        )
        body["usage"] = self._usage(run, response.usage.completion_tokens)
        return JSONResponse(body)

    async def count_tokens(self, request: MessagesRequest) -> dict[str, int]:
        """``{"input_tokens": N}``: the prompt's tokens, as the template renders it."""
        chat_request = to_chat_request(request)
        self.chat.check_model(chat_request.model)
        ids = await self.chat.render_prompt_async(chat_request.messages, chat_request)
        return {"input_tokens": len(ids)}

    def _message(
        self,
        run: ChatRun,
        message_id: str,
        content: list[dict[str, Any]],
        stop_reason: str | None,
        stop_sequence: str | None,
    ) -> dict[str, Any]:
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": self.chat.response_model(run.request.model),
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
        }

    @staticmethod
    def _usage(run: ChatRun, output_tokens: int) -> dict[str, int]:
        """Anthropic's usage: prompt tokens read from the prefix cache apart."""
        cached = run.first.num_cached_tokens or 0
        return {
            "input_tokens": len(run.first.prompt_token_ids) - cached,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": output_tokens,
        }

    async def _events(
        self, request: MessagesRequest, run: ChatRun, message_id: str
    ) -> AsyncIterator[str]:
        writer = _BlockWriter()
        start = self._message(run, message_id, [], None, None)
        start["usage"] = self._usage(run, 0)
        finish_reason, stop_reason, output_tokens = None, None, 0
        try:
            yield _event("message_start", message=start)
            yield _event("ping")
            async for chunk in self.chat.stream_chunks(run):
                if chunk.usage is not None:
                    output_tokens = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                for event in writer.delta(choice.delta):
                    yield event
                if choice.finish_reason is not None:
                    finish_reason, stop_reason = choice.finish_reason, choice.stop_reason
        except Exception as e:  # the stream has begun: an error event ends it
            yield error_event(to_openai_error(e))
            return
        finally:  # a client gone before the first chunk: abort the request all the same
            await run.stream.aclose()
        for event in writer.close():
            yield event
        reason, sequence = _stop_reason(
            finish_reason, stop_reason, writer.called_tools, request.stop_sequences or []
        )
        yield _event(
            "message_delta",
            delta={"stop_reason": reason, "stop_sequence": sequence},
            usage={"output_tokens": output_tokens},
        )
        yield _event("message_stop")


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


class _BlockWriter:
    """Turns chat deltas into content-block events, one block open at a time."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.call_index: int | None = None
        self.called_tools = False

    def delta(self, delta: Any) -> list[str]:
        events: list[str] = []
        if delta.reasoning_content:
            events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(
                self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content})
            )
        if delta.content:
            events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or []:
            function = call.function
            if call.id is not None and call.index != self.call_index:
                events += self.close()
                self.call_index = call.index
                self.called_tools = True
                name = function.name if function and function.name else ""
                block = {"type": "tool_use", "id": tool_use_id(call.id), "name": name, "input": {}}
                events += self._start("tool_use", block, new=True)
            if function is not None and function.arguments and self.open == "tool_use":
                events.append(
                    self._delta({"type": "input_json_delta", "partial_json": function.arguments})
                )
        return events

    def _start(self, kind: str, block: dict[str, Any], new: bool = False) -> list[str]:
        if self.open == kind and not new:
            return []
        events = self.close()
        self.index += 1
        self.open = kind
        events.append(_event("content_block_start", index=self.index, content_block=block))
        return events

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", index=self.index, delta=delta)

    def close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        events.append(_event("content_block_stop", index=self.index))
        self.open, self.call_index = None, None
        return events

"""POST /v1/responses (the OpenAI Responses API), GET and DELETE /v1/responses/{id}.

A Responses request is served as a chat request (``responses_input.to_chat_request``): the
chat handler renders, generates and splits the output into reasoning, text and tool calls,
which come back as output items. Streams send the Responses API's events: ``response.created``,
``response.in_progress``, per item ``response.output_item.added`` / ``.done`` with its
deltas (``response.reasoning_text.delta``, ``response.output_text.delta``,
``response.function_call_arguments.delta``) and their ``.done`` events, then
``response.completed`` (its status ``incomplete`` when cut by ``max_output_tokens``), or
``response.failed`` on an error. With ``store`` (the default) the response and its
conversation are kept (``responses_store.py``) for ``previous_response_id``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.entrypoints.openai import responses_output as out
from tokenmill.entrypoints.openai.errors import OpenAIError
from tokenmill.entrypoints.openai.protocol import ChatCompletionStreamResponse, UsageInfo
from tokenmill.entrypoints.openai.responses_input import (
    CHAT_TO_RESPONSES_NAMES,
    ResponsesRequest,
    check_served,
    input_messages,
    to_chat_request,
)
from tokenmill.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from tokenmill.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from tokenmill.entrypoints.openai.serving_engine import to_openai_error


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    shown = response_id[:256]
    return OpenAIError(
        f"Response with id {shown!r} not found (it was not stored, or the server has dropped "
        "it: see --max-stored-responses).",
        HTTPStatus.NOT_FOUND,
        param,
        "response_not_found",
    )


def rename_param(error: OpenAIError, names: dict[str, str]) -> OpenAIError:
    """``error`` naming the field the client sent: the chat request's field (its first
    component) becomes this API's name for it."""
    if error.param:
        head = error.param.split(".", 1)[0]
        if head in names:
            error.param = names[head]
            error.message = error.message.replace(head, names[head], 1)
    return error


class OpenAIServingResponses:
    """Serves the Responses API on top of the chat handler.

    Args:
        chat: the chat completions handler.
        max_stored_responses: responses kept for ``previous_response_id``.
    """

    def __init__(self, chat: OpenAIServingChat, max_stored_responses: int) -> None:
        self.chat = chat
        self.store = ResponseStore(max_stored_responses)

    async def create(self, request: ResponsesRequest) -> Response:
        """Answer one Responses request (streaming or not).

        Raises:
            OpenAIError: 400 naming the field at fault, 404 for an unknown model or
                ``previous_response_id``, 503 if the engine is dead.
        """
        self.chat.check_model(request.model)
        check_served(request)
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            if stored is None:
                raise not_found(request.previous_response_id, "previous_response_id")
            history = stored.messages
        messages = input_messages(request)
        chat_request = to_chat_request(request, history, messages)
        conversation = history + messages
        try:
            run = await self.chat.start_chat(chat_request)
        except OpenAIError as e:
            raise rename_param(e, CHAT_TO_RESPONSES_NAMES) from None
        body = out.envelope(request, out.item_id("resp"), self.chat.response_model(request.model))
        if request.stream:
            events = self._events(request, run, body, conversation)
            return StreamingResponse(events, media_type="text/event-stream")
        chat_response = await self.chat.full_response(run)
        choice = chat_response.choices[0]
        body["output"] = out.output_items(choice.message)
        reasoning = choice.message.reasoning_content
        body["usage"] = out.usage(chat_response.usage, self._num_tokens(reasoning))
        out.finish(body, choice.finish_reason)
        self._keep(request, body, conversation)
        return JSONResponse(body)

    def get(self, response_id: str) -> dict[str, Any]:
        """A stored response.

        Raises:
            OpenAIError: 404 when it is not stored.
        """
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.response

    def delete(self, response_id: str) -> dict[str, Any]:
        """Drop a stored response.

        Raises:
            OpenAIError: 404 when it is not stored.
        """
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def _keep(
        self, request: ResponsesRequest, body: dict[str, Any], conversation: list[dict[str, Any]]
    ) -> None:
        if request.store is not False:
            messages = conversation + out.chat_messages(body["output"])
            self.store.put(body["id"], StoredResponse(body, messages))

    def _num_tokens(self, text: str | None) -> int:
        return len(self.chat.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    async def _events(
        self,
        request: ResponsesRequest,
        run: ChatRun,
        body: dict[str, Any],
        conversation: list[dict[str, Any]],
    ) -> AsyncIterator[str]:
        events = _EventWriter(body)
        finish_reason = None
        chat_usage: UsageInfo | None = None
        try:
            yield events.emit("response.created", response=dict(body))
            yield events.emit("response.in_progress", response=dict(body))
            async for chunk in self.chat.stream_chunks(run):
                chat_usage = chunk.usage or chat_usage
                for event in events.chunk(chunk):
                    yield event
                if chunk.choices and chunk.choices[0].finish_reason is not None:
                    finish_reason = chunk.choices[0].finish_reason
        except Exception as e:  # the stream has begun: end it with response.failed
            error = to_openai_error(e)
            for event in events.close_item():
                yield event
            body["status"] = "failed"
            body["error"] = {"code": error.code or error.err_type, "message": error.message}
            yield events.emit("response.failed", response=body)
            return
        finally:  # a client gone before the first chunk: abort the request all the same
            await run.stream.aclose()
        for event in events.close_item():
            yield event
        body["usage"] = out.usage(chat_usage, self._num_tokens(events.reasoning_text))
        out.finish(body, finish_reason)
        self._keep(request, body, conversation)
        # NOTE: response.completed also ends an incomplete response (its status says so), as
        # vLLM sends it: the SDKs' stream helpers wait for that event.
        yield events.emit("response.completed", response=body)


class _EventWriter:
    """Turns chat chunks into Responses events, one output item open at a time.

    Args:
        body: the response object; finished items are appended to its ``output``.
    """

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.sequence = 0
        self.item: dict[str, Any] | None = None  # the open item
        self.text = ""  # the open item's text or arguments so far
        self.call_index: int | None = None  # the chat tool-call index of an open call
        self.reasoning_text = ""

    def emit(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out.sse(event)

    @property
    def _index(self) -> int:
        return len(self.body["output"])

    def chunk(self, chunk: ChatCompletionStreamResponse) -> list[str]:
        """The events for one chat chunk's delta."""
        if not chunk.choices:
            return []
        delta = chunk.choices[0].delta
        events: list[str] = []
        if delta.reasoning_content:
            events += self._open("reasoning")
            events.append(
                self._text_delta("response.reasoning_text.delta", delta.reasoning_content)
            )
            self.reasoning_text += delta.reasoning_content
        if delta.content:
            events += self._open("message")
            events.append(self._text_delta("response.output_text.delta", delta.content))
        for call in delta.tool_calls or []:
            function = call.function
            if call.index != self.call_index and call.id is not None:
                events += self.close_item()
                self.call_index = call.index
                name = function.name if function and function.name else ""
                self.item = out.function_call_item(call.id, name, "", status="in_progress")
                events.append(self._added())
            if self.item is not None and function is not None and function.arguments:
                self.text += function.arguments
                events.append(
                    self.emit(
                        "response.function_call_arguments.delta",
                        item_id=self.item["id"],
                        output_index=self._index,
                        delta=function.arguments,
                    )
                )
        return events

    def _added(self) -> str:
        return self.emit("response.output_item.added", output_index=self._index, item=self.item)

    def _open(self, kind: str) -> list[str]:
        """Open an item of ``kind`` unless one is open (closing another kind first)."""
        if self.item is not None and self.item["type"] == kind:
            return []
        events = self.close_item()
        if kind == "reasoning":
            self.item = out.reasoning_item("", status="in_progress")
            return [*events, self._added()]
        self.item = out.message_item(None, status="in_progress")
        part = out.text_part("")
        return [
            *events,
            self._added(),
            self.emit(
                "response.content_part.added",
                item_id=self.item["id"],
                output_index=self._index,
                content_index=0,
                part=part,
            ),
        ]

    def _text_delta(self, kind: str, text: str) -> str:
        assert self.item is not None
        self.text += text
        extra = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return self.emit(
            kind,
            item_id=self.item["id"],
            output_index=self._index,
            content_index=0,
            delta=text,
            **extra,
        )

    def close_item(self) -> list[str]:
        """The events that finish the open item; it joins the response's output."""
        item = self.item
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self._index}
        events = []
        if item["type"] == "reasoning":
            events.append(
                self.emit("response.reasoning_text.done", **where, content_index=0, text=self.text)
            )
            item = out.reasoning_item(self.text, item["id"])
        elif item["type"] == "message":
            part = out.text_part(self.text)
            events.append(
                self.emit(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=self.text,
                    logprobs=[],
                )
            )
            events.append(
                self.emit("response.content_part.done", **where, content_index=0, part=part)
            )
            item = out.message_item(self.text, item["id"])
        else:
            events.append(
                self.emit(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=self.text,
                )
            )
            item = out.function_call_item(item["call_id"], item["name"], self.text, item["id"])
        events.append(self.emit("response.output_item.done", output_index=self._index, item=item))
        self.body["output"].append(item)
        self.item, self.text, self.call_index = None, "", None
        return events

"""POST /v1/chat/completions: messages -> chat template -> engine -> OpenAI chat response.

Streaming answers are server-sent events: a first chunk per choice carrying the role, chunks of
new text (never a broken UTF-8 character: the detokenizer holds incomplete ones back), the
finish reason on a choice's last chunk, an optional usage chunk with no choices
(``stream_options.include_usage``), then ``data: [DONE]``.

With tools (``chat_tools.py``) or ``--reasoning-parser``, each choice's output goes through its
parsers (``chat_output.py``): deltas then carry ``reasoning_content`` and ``tool_calls``
pieces, and whole answers ``message.reasoning_content`` and ``message.tool_calls``. The
Responses and Messages APIs reuse ``start_chat``, ``full_response`` and ``stream_chunks``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenmill.entrypoints.openai.chat_images import attach_images, check_model_takes_images
from tokenmill.entrypoints.openai.chat_output import (
    ChoiceParser,
    choice_parsers,
    reasoning_end_ids,
)
from tokenmill.entrypoints.openai.chat_rendering import (
    content_chars,
    template_conversation,
    template_kwargs,
)
from tokenmill.entrypoints.openai.chat_tools import (
    ToolSettings,
    plan_tool_calls,
)
from tokenmill.entrypoints.openai.errors import OpenAIError, bad_request
from tokenmill.entrypoints.openai.logprobs import (
    TokenBytes,
    clamp_logprob,
    prompt_logprobs_json,
    token_label,
    top_ranked,
)
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from tokenmill.entrypoints.openai.serving_engine import (
    OpenAIServing,
    RequestLogger,
    check_implemented,
    first_output,
    to_openai_error,
)
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import BeamSearchParams
from tokenmill.tokenizer import encode_prompt, render_chat_template

if TYPE_CHECKING:
    from tokenmill.engine.async_llm import AsyncLLM

SSE_DONE = "data: [DONE]\n\n"

def chat_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob]],
    num_top: int,
    token_bytes: TokenBytes,
    as_ids: bool = False,
) -> ChatCompletionLogProbs:
    """OpenAI's chat ``logprobs.content``: per output token its text, logprob, bytes and the
    ``num_top`` most likely tokens (rank order). Logprobs are clamped to finite values.
    ``as_ids``: tokens named ``"token_id:<id>"`` instead of their text (``token_label``).
    """
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        chosen = entry.get(token_id)
        if chosen is None:  # cannot happen with engine outputs; keep the schema valid anyway
            chosen = Logprob(float("-inf"), None, None)
        top = top_ranked(entry, num_top)
        content.append(
            ChatCompletionLogProbsContent(
                token=token_label(token_id, chosen.decoded_token or "", as_ids),
                logprob=clamp_logprob(chosen.logprob),
                bytes=token_bytes(token_id, chosen.decoded_token or ""),
                top_logprobs=[
                    ChatCompletionLogProb(
                        token=token_label(tid, lp.decoded_token or "", as_ids),
                        logprob=clamp_logprob(lp.logprob),
                        bytes=token_bytes(tid, lp.decoded_token or ""),
                    )
                    for tid, lp in top
                ],
            )
        )
    return ChatCompletionLogProbs(content=content)


@dataclass
class ChatRun:
    """A chat request the engine has accepted: its first output is in, the rest streams.

    Attributes:
        request: the request.
        request_id: its id (``chatcmpl-...``).
        first: the first output.
        stream: the later outputs.
        start: arrival time (``time.monotonic()``).
        parsers: per choice, the reasoning and tool-call parser; None for plain text.
    """

    request: ChatCompletionRequest
    request_id: str
    first: RequestOutput
    stream: AsyncIterator[RequestOutput]
    start: float
    parsers: list[ChoiceParser] | None


class OpenAIServingChat(OpenAIServing):
    """Serves chat completions.

    Args:
        engine: the running AsyncLLM.
        request_logger: logs arrivals and finishes; None disables request logs.
        chat_template: Jinja template text replacing the tokenizer's own (``--chat-template``).
        response_role: the role of generated messages (``--response-role``).
        tool_settings: the tool-call and reasoning parsers (``--tool-call-parser``...).
    """

    def __init__(
        self,
        engine: AsyncLLM,
        request_logger: RequestLogger | None = None,
        chat_template: str | None = None,
        response_role: str = "assistant",
        tool_settings: ToolSettings | None = None,
    ) -> None:
        super().__init__(engine, request_logger)
        self.chat_template = chat_template
        self.response_role = response_role
        self.tool_settings = tool_settings or ToolSettings()

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request | None = None
    ) -> Response:
        """Answer one chat request (streaming or not).

        Raises:
            OpenAIError: 400 for an invalid request, 404 for an unknown model, 503 if the
                engine is dead.
        """
        run = await self.start_chat(request)
        if request.stream:
            return StreamingResponse(self._stream(run), media_type="text/event-stream")
        response = await self.full_response(run)
        return Response(response.model_dump_json(), media_type="application/json")

    async def start_chat(self, request: ChatCompletionRequest) -> ChatRun:
        """Check, render and submit one chat request; wait for its first output.

        Raises:
            OpenAIError: 400 for an invalid request, 404 for an unknown model, 503 if the
                engine is dead.
        """
        start = time.monotonic()
        self.check_model(request.model)
        self._check_supported(request)
        self.check_stream_options(request)
        plan = plan_tool_calls(request, self.tool_settings)
        if plan.mode == "auto" and self.tool_settings.tool_parser is not None:
            request = self.tool_settings.tool_parser(self.tokenizer).adjust_request(request)
        if self.tool_settings.reasoning_parser is not None:
            request = self.tool_settings.reasoning_parser(self.tokenizer).adjust_request(request)
        check_model_takes_images(self.engine, request.messages)
        images: list[tuple[str, str]] = []
        prompt_ids = await self.render_prompt_async(request.messages, request, images)
        mm_features = None
        if images:
            if request.truncate_prompt_tokens is not None:
                # Left truncation would cut the placeholders the images' features point at.
                raise bad_request(
                    "truncate_prompt_tokens cannot be used with images (it could cut an "
                    "image's placeholder tokens).",
                    "truncate_prompt_tokens",
                )
            prompt_ids, mm_features = await attach_images(self.engine, prompt_ids, images)
        max_tokens = (
            request.max_completion_tokens
            if request.max_completion_tokens is not None
            else request.max_tokens
        )
        prompt_ids = self.truncate_prompt(prompt_ids, request, max_tokens)
        self.check_prompt_length(len(prompt_ids), "messages")
        params = self.build_sampling_params(
            request,
            len(prompt_ids),
            max_tokens,
            self._num_logprobs(request),
            prompt_logprobs=request.prompt_logprobs,
            best_of=request.best_of,
        )
        settings = self.tool_settings
        if plan.constraint is not None:  # (never with use_beam_search, which refuses tools)
            params.structured_outputs = plan.constraint
        if not isinstance(params, BeamSearchParams) and params.structured_outputs is not None:
            # The constraint holds for the answer, after any reasoning.
            end_ids = reasoning_end_ids(settings, self.tokenizer, prompt_ids)
            params.structured_outputs = dataclasses.replace(
                params.structured_outputs, reasoning_end_token_ids=end_ids
            )
        parsers = choice_parsers(request, plan, settings, self.tokenizer, prompt_ids)
        request_id = random_id("chatcmpl")
        if self.request_logger is not None:
            # A token holds at least one character: decoding max_log_len tokens is enough.
            shown = prompt_ids[: self.request_logger.max_log_len]
            self.log_arrival(request_id, self.tokenizer.decode(shown), prompt_ids, params,
                             request.truncate_prompt_tokens)
        stream = self.generate(
            prompt_ids, None, params, request_id, request.priority, mm_features, request.model
        )
        first = await first_output(stream)
        try:
            self.check_first_output(first, request)
        except OpenAIError:
            await stream.aclose()  # type: ignore[attr-defined]
            raise
        return ChatRun(request, request_id, first, stream, start, parsers)

    async def full_response(self, run: ChatRun) -> ChatCompletionResponse:
        """The whole answer of a run that does not stream.

        Raises:
            OpenAIError: the request failed in the engine (see ``aborted_error``).
        """
        try:
            final = run.first
            async for out in run.stream:
                final = out
        except Exception as e:
            raise to_openai_error(e) from None
        request = run.request
        response = self._full_response(run, final, request.top_logprobs or 0)
        if request.prompt_logprobs is not None:
            response.prompt_logprobs = prompt_logprobs_json(
                final.prompt_token_ids, final.prompt_logprobs
            )
        reasons = [c.finish_reason for c in response.choices]
        self.log_finish(run.request_id, reasons, response.usage, run.start)
        return response

    # ---- request -> prompt ------------------------------------------------------------------

    def _check_supported(self, request: ChatCompletionRequest) -> None:
        for name in ("functions", "function_call"):  # OpenAI's deprecated tool calling
            if getattr(request, name) is not None:
                raise bad_request(
                    f"tokenmill does not implement {name}; use tools and tool_choice.", name
                )
        if request.echo:
            raise bad_request("tokenmill does not implement echo for chat yet.", "echo")
        if request.chat_template is not None:
            raise bad_request(
                "a chat template in the request is not accepted: the server's template "
                "(--chat-template, or the model's) applies.",
                "chat_template",
            )
        if request.mm_processor_kwargs is not None:
            # NOTE: encoder outputs are cached by image content alone, which holds while
            # every request processes images alike.
            raise bad_request(
                "mm_processor_kwargs in the request is not accepted: the server's "
                "--mm-processor-kwargs applies to every image.",
                "mm_processor_kwargs",
            )
        check_implemented(request)
        if request.stream and request.prompt_logprobs is not None:
            # vLLM's chat answers the same: its streamed chunks have no place for them.
            raise bad_request("prompt_logprobs cannot be used with stream.", "prompt_logprobs")
        if request.continue_final_message and request.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true.",
                "continue_final_message",
            )

    def _num_logprobs(self, request: ChatCompletionRequest) -> int | None:
        top = request.top_logprobs
        if top is not None and top < 0:
            raise bad_request(f"top_logprobs must be non-negative, got {top}.", "top_logprobs")
        if not request.logprobs:
            if top:
                raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
            return None
        limit = self.model_config.max_logprobs
        if top is not None and 0 <= limit < top:
            raise bad_request(
                f"top_logprobs must be at most {limit} (--max-logprobs), got {top}.",
                "top_logprobs",
            )
        return top or 0

    def render_prompt(self, messages: list[Any], request: Any = None) -> list[int]:
        """Render the messages with the chat template and tokenize them (on this thread).

        Raises:
            OpenAIError: see ``render_text``.
        """
        return encode_prompt(
            self.tokenizer, self.render_text(messages, request), add_special_tokens=False
        )

    async def render_prompt_async(
        self, messages: list[Any], request: Any = None, images: list | None = None
    ) -> list[int]:
        """``render_prompt`` with the rendering and the tokenizing off the event loop (see
        AsyncTokenizer), a conversation too large for the context refused before either;
        ``images`` collects the image parts (see ``render_text``).

        Raises:
            OpenAIError: see ``render_text``; InvalidRequestError: the conversation cannot
                fit the context.
        """
        text = await self.engine.render_chat(
            lambda: self.render_text(messages, request, images),
            len(messages),
            sum(content_chars(m.content) for m in messages),
            "messages",
        )
        return await self.engine.encode(text, add_special_tokens=False, param="messages")

    def render_text(
        self, messages: list[Any], request: Any = None, images: list | None = None
    ) -> str:
        """Render the messages with the chat template; an ``image_url`` part becomes an
        image part of the template (its image token) and its ``(url, field)`` is appended
        to ``images``.

        Raises:
            OpenAIError: 400 when a content part is neither text nor (with ``images``) an
                image, there is no chat template, or the template fails on the messages.
        """
        conversation = template_conversation(messages, images)
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        kwargs = template_kwargs(request, template)
        add_generation_prompt = getattr(request, "add_generation_prompt", True)
        try:
            return render_chat_template(
                self.tokenizer,
                conversation,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except Exception as e:  # ChatTemplateError, or a template kwarg transformers rejects
            raise bad_request(str(e), "messages") from None

    # ---- outputs -> response ----------------------------------------------------------------

    def _logprobs(
        self, output: CompletionOutput, num_top: int, request: ChatCompletionRequest
    ) -> ChatCompletionLogProbs | None:
        if output.logprobs is None:
            return None
        return chat_logprobs(output.token_ids, output.logprobs, num_top, self.token_bytes,
                             self.tokens_as_ids(request))

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached: int) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def _check_not_aborted(self, output: CompletionOutput, request: ChatCompletionRequest) -> None:
        if output.finish_reason == "abort":
            raise self.aborted_error(output.stop_reason, request)

    def _message(
        self, run: ChatRun, output: CompletionOutput
    ) -> tuple[ChatCompletionMessage, str | None]:
        """A choice's message, split by its parsers, and its finish reason."""
        if run.parsers is None:
            message = ChatCompletionMessage(role=self.response_role, content=output.text)
            return message, output.finish_reason
        parser = run.parsers[output.index]
        parsed = parser.parse(output.text)
        message = ChatCompletionMessage(
            role=self.response_role,
            content=parsed.content,
            tool_calls=parsed.tool_calls,
            reasoning_content=parsed.reasoning_content,
        )
        return message, parser.finish_reason(output.finish_reason)

    def _full_response(
        self, run: ChatRun, final: RequestOutput, num_top: int
    ) -> ChatCompletionResponse:
        choices = []
        for output in final.outputs:
            self._check_not_aborted(output, run.request)
            message, finish_reason = self._message(run, output)
            choices.append(
                ChatCompletionChoice(
                    index=output.index,
                    message=message,
                    logprobs=self._logprobs(output, num_top, run.request),
                    finish_reason=finish_reason,
                    stop_reason=output.stop_reason,
                )
            )
        completion_tokens = sum(len(o.token_ids) for o in final.outputs)
        usage = self._usage(len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens)
        return ChatCompletionResponse(
            id=run.request_id,
            model=self.response_model(run.request.model),
            choices=choices,
            usage=usage,
        )

    async def _stream(self, run: ChatRun) -> AsyncIterator[str]:
        """Server-sent events of ``stream_chunks``; an error after the start goes in-band."""
        try:
            async for chunk in self.stream_chunks(run):
                yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
        except Exception as e:  # the stream has begun: report in-band, then end it
            yield to_openai_error(e).to_sse()
        yield SSE_DONE

    async def stream_chunks(self, run: ChatRun) -> AsyncIterator[ChatCompletionStreamResponse]:
        """The chunks of a streamed answer: per choice a role chunk, then its deltas (split
        by its parsers), the finish reason on its last; a usage chunk when asked.

        Raises:
            OpenAIError: the request failed in the engine after the stream began.
        """
        request, first, stream = run.request, run.first, run.stream
        created = int(time.time())
        n = request.n or 1
        num_top = request.top_logprobs or 0
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and bool(options and options.continuous_usage_stats)
        prompt_tokens = len(first.prompt_token_ids)
        completion_tokens = [0] * n
        finish_reasons: list[str | None] = [None] * n
        cached = first.num_cached_tokens
        model = self.response_model(request.model)

        def chunk(
            choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None
        ) -> ChatCompletionStreamResponse:
            out = ChatCompletionStreamResponse(
                id=run.request_id,
                object="chat.completion.chunk",
                created=created,
                model=model,
                choices=choices,
            )
            if include_usage:
                out.usage = usage
            return out

        try:
            for i in range(n):
                role = DeltaMessage(role=self.response_role, content="")
                yield chunk(
                    [
                        ChatCompletionStreamChoice(
                            index=i, delta=role, logprobs=None, finish_reason=None
                        )
                    ],
                    self._usage(prompt_tokens, 0, cached) if continuous_usage else None,
                )
            output: RequestOutput | None = first
            while output is not None:
                for c in output.outputs:
                    self._check_not_aborted(c, request)
                    completion_tokens[c.index] += len(c.token_ids)
                    logprobs = self._logprobs(c, num_top, request)
                    if not c.text and c.finish_reason is None and not c.token_ids:
                        continue
                    delta, finish_reason = self._delta(run, c)
                    finish_reasons[c.index] = finish_reason
                    choice = ChatCompletionStreamChoice(
                        index=c.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason
                    )
                    if c.finish_reason is not None:
                        choice.stop_reason = c.stop_reason
                    usage = None
                    if continuous_usage:  # this choice's own counts, as vLLM reports them
                        usage = self._usage(prompt_tokens, completion_tokens[c.index], cached)
                    yield chunk([choice], usage)
                output = await anext(stream, None)
            usage = self._usage(prompt_tokens, sum(completion_tokens), cached)
            if include_usage:
                yield chunk([], usage)
            self.log_finish(run.request_id, finish_reasons, usage, run.start)
        finally:
            await stream.aclose()

    def _delta(self, run: ChatRun, c: CompletionOutput) -> tuple[DeltaMessage, str | None]:
        """A streamed choice's delta for its newest output, and its finish reason."""
        if run.parsers is None:
            return (DeltaMessage(content=c.text) if c.text else DeltaMessage()), c.finish_reason
        parser = run.parsers[c.index]
        delta = parser.stream(c.text, c.token_ids, c.finish_reason is not None)
        return delta, parser.finish_reason(c.finish_reason)

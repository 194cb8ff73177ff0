"""What the chat and completions handlers share: model-name checks, sampling parameters,
request logging, engine-error mapping and client-disconnect handling (logprob formatting
is in ``logprobs.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from tokenmill.core.engine_io import (
    CONSTRAINT_BUSY_PREFIX,
    CONSTRAINT_FAILURE_PREFIX,
    REQUEST_REFUSED_PREFIX,
)
from tokenmill.engine.async_llm import EngineDeadError
from tokenmill.engine.input_processor import InvalidRequestError, truncate_prompt
from tokenmill.entrypoints.openai.beam_search import beam_search_params, check_beam_search_request
from tokenmill.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    engine_dead,
    model_not_found,
)
from tokenmill.entrypoints.openai.logprobs import TokenBytes
from tokenmill.entrypoints.openai.protocol import (
    UNIMPLEMENTED_FIELDS,
    ChatCompletionRequest,
    SamplingFields,
    UsageInfo,
)
from tokenmill.entrypoints.openai.sleep_routes import asleep_error
from tokenmill.entrypoints.openai.structured_outputs import (
    constraint_error,
    constraint_field,
    structured_outputs_of,
)
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
)
from tokenmill.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.entrypoints.openai.serving_models import ServingModels

logger = logging.getLogger("tokenmill.entrypoints.openai")

T = TypeVar("T")

# HTTP status logged for a request whose client went away (nginx's convention).
CLIENT_CLOSED_REQUEST = 499
SHUTTING_DOWN = "The server is shutting down; it takes no new requests."


# Items of a list or dict field of the logged parameters shown before "..." (bad_words,
# allowed_token_ids and logit_bias may hold thousands).
LOGGED_ITEMS = 16


def shown_params(params: Any, shown: dict[str, Any] | None = None) -> str:
    """``str(params)``, with each list or dict field of a dataclass cut to its first
    ``LOGGED_ITEMS`` items plus a count; for a dataclass, ``shown`` gives values logged in
    place of the fields of those names (or after the fields, for names that are no field)."""
    if not dataclasses.is_dataclass(params) or isinstance(params, type):
        return str(params)
    extra = dict(shown or {})
    parts = []
    for f in dataclasses.fields(params):
        value = extra.pop(f.name) if f.name in extra else getattr(params, f.name)
        text = repr(value)
        if isinstance(value, (list, dict)) and len(value) > LOGGED_ITEMS:
            items = list(value.items() if isinstance(value, dict) else value)[:LOGGED_ITEMS]
            text = f"{items!r}... ({len(value)} in all)"
        parts.append(f"{f.name}={text}")
    parts += [f"{name}={value!r}" for name, value in extra.items()]
    return f"{type(params).__name__}({', '.join(parts)})"


class RequestLogger:
    """Logs one line when a request arrives and one when it finishes.

    Args:
        max_log_len: most characters (of the prompt) and token ids printed; None: all.
    """

    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def log_arrival(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: Any,
        truncate_prompt_tokens: int | None = None,
    ) -> None:
        """Log an arriving request. ``truncate_prompt_tokens``: the truncation the request
        asked for, logged among ``params`` (the server cuts the prompt itself, so the
        engine's params do not carry it; ``prompt_token_ids`` are those kept)."""
        limit = self.max_log_len
        shown = None
        if truncate_prompt_tokens is not None:
            shown = {"truncate_prompt_tokens": truncate_prompt_tokens}
        shown_prompt = prompt if prompt is None or limit is None else prompt[:limit]
        shown_ids = prompt_token_ids if limit is None else prompt_token_ids[:limit]
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
            request_id,
            shown_prompt,
            shown_params(params, shown),
            shown_ids,
        )

    def log_finish(
        self,
        request_id: str,
        finish_reasons: list[str | None],
        usage: UsageInfo,
        start_time: float,
    ) -> None:
        logger.info(
            "Finished request %s: finish_reason=%s, prompt_tokens=%d, completion_tokens=%d, "
            "e2e=%.3f s",
            request_id,
            ",".join(str(r) for r in finish_reasons),
            usage.prompt_tokens,
            usage.completion_tokens,
            time.monotonic() - start_time,
        )


def to_openai_error(error: BaseException) -> OpenAIError:
    """The client-facing error for an exception raised while serving a request.

    Validation errors (``InvalidRequestError``, ``SamplingParamsError``, ``ChatTemplateError``,
    any ValueError) become 400s naming the field; a dead engine a 503; anything else a 500.
    """
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, EngineDeadError):
        return engine_dead(str(error))
    if isinstance(error, ChatTemplateError):
        return bad_request(str(error), "messages")
    if isinstance(error, ValueError):
        return bad_request(str(error), getattr(error, "param", None))
    logger.exception("unexpected error while serving a request", exc_info=error)
    return OpenAIError(f"Internal server error: {type(error).__name__}: {error}", 500)


class OpenAIServing:
    """Shared state and steps of the chat and completions handlers.

    Args:
        engine: the running AsyncLLM.
        request_logger: logs arrivals and finishes; None disables request logs.
    """

    def __init__(self, engine: AsyncLLM, request_logger: RequestLogger | None = None) -> None:
        self.engine = engine
        self.model_config = engine.model_config
        self.model_name = engine.model_config.served_model_name
        self.tokenizer = engine.get_tokenizer()
        self.request_logger = request_logger
        self.default_params = engine.input_processor.default_sampling_params()
        self.priority_scheduling = engine.config.scheduler_config.scheduling_policy == "priority"
        self.token_bytes = TokenBytes(self.tokenizer)
        # The served names and LoRA adapters (``build_app`` sets it); None: the base only.
        self.models: ServingModels | None = None
        # --return-tokens-as-token-ids: the default of the request field of that name.
        self.return_tokens_as_token_ids = False
        # Ids of the requests whose streams this handler has open; aborted at shutdown.
        self._running: set[str] = set()
        self._closed = False

    def tokens_as_ids(self, request: SamplingFields) -> bool:
        """Whether logprobs name tokens ``"token_id:<id>"``: the request's
        ``return_tokens_as_token_ids``, else the server's flag."""
        asked = request.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if asked is None else asked

    def check_model(self, model: str | None) -> None:
        """Raises a 404 OpenAIError unless ``model`` is None, one of the served names or a
        LoRA adapter's name."""
        if self.models is not None:
            self.models.check(model)
        elif model is not None and model not in self.model_config.served_model_names:
            raise model_not_found(model)

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response carries: the LoRA adapter's name when the request named
        one (as vLLM answers), else the served model's first name.

        ``check_model`` admitted the request's ``model`` on arrival, so a name other than
        the served ones is an adapter's, even one unloaded while the request ran (it
        finished with that adapter)."""
        if model is not None and model not in self.model_config.served_model_names:
            return model
        return self.model_name

    def truncate_prompt(
        self, ids: list[int], request: SamplingFields, max_tokens: int | None
    ) -> list[int]:
        """The prompt's last ``request.truncate_prompt_tokens`` tokens (vLLM's left
        truncation; -1: the most the context holds with room for ``max_tokens``, or for
        one generated token when it is unset), or ``ids`` when the field is unset or the
        prompt is shorter.

        Raises:
            OpenAIError: 400 for a value other than -1 or 1..max_model_len - 1.
        """
        k = request.truncate_prompt_tokens
        if k is None:
            return ids
        try:
            return truncate_prompt(ids, k, self.model_config.max_model_len, max_tokens)
        except InvalidRequestError as e:
            raise bad_request(str(e), e.param) from None

    def check_prompt_length(self, num_prompt_tokens: int, param: str) -> None:
        """Raises a 400 when the prompt leaves no room for even one generated token."""
        max_len = self.model_config.max_model_len
        if num_prompt_tokens >= max_len:
            raise bad_request(
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"prompt has {num_prompt_tokens} tokens, which leaves no room for the "
                "completion. Please reduce the length of the prompt.",
                param,
            )

    def build_sampling_params(
        self,
        request: SamplingFields,
        num_prompt_tokens: int,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        best_of: int | None = None,
    ) -> SamplingParams | BeamSearchParams:
        """SamplingParams for one prompt of a request (BeamSearchParams with
        ``use_beam_search``).

        Fields the request leaves unset take the model's generation_config defaults. Without
        ``max_tokens`` the answer may fill the rest of the context (``max_model_len`` minus
        ``num_prompt_tokens``), capped by the generation config's ``max_new_tokens``.

        Raises:
            OpenAIError: 400 naming the field that is out of range.
        """
        if request.priority != 0 and not self.priority_scheduling:
            raise bad_request(
                "priority is only honoured with --scheduling-policy priority; this server "
                "schedules first come, first served.",
                "priority",
            )
        if max_tokens is None:
            max_tokens = max(1, self.model_config.max_model_len - num_prompt_tokens)
            default_max = self.model_config.generation_config.get("max_new_tokens")
            if default_max:
                max_tokens = min(max_tokens, int(default_max))
        elif max_tokens > 0:
            self.check_room_for_max_tokens(request, num_prompt_tokens, max_tokens)
        if request.use_beam_search:
            return beam_search_params(request, max_tokens)
        defaults = self.default_params

        def pick(value: T | None, default: T) -> T:
            return default if value is None else value

        try:
            return SamplingParams(
                n=pick(request.n, 1),
                best_of=best_of,
                presence_penalty=pick(request.presence_penalty, 0.0),
                frequency_penalty=pick(request.frequency_penalty, 0.0),
                repetition_penalty=pick(request.repetition_penalty, defaults.repetition_penalty),
                temperature=pick(request.temperature, defaults.temperature),
                top_p=pick(request.top_p, defaults.top_p),
                top_k=pick(request.top_k, defaults.top_k),
                min_p=pick(request.min_p, defaults.min_p),
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                logit_bias=parse_logit_bias(request.logit_bias),
                allowed_token_ids=request.allowed_token_ids,
                bad_words=request.bad_words,
                structured_outputs=structured_outputs_of(request),
                output_kind=RequestOutputKind.DELTA
                if request.stream
                else RequestOutputKind.FINAL_ONLY,
            )
        except SamplingParamsError as e:
            message, param = str(e), e.param
            if param == "max_tokens":
                param = max_tokens_field(request)
                message = message.replace("max_tokens", param, 1)
            raise bad_request(message, param) from None

    def check_room_for_max_tokens(
        self, request: SamplingFields, num_prompt_tokens: int, max_tokens: int
    ) -> None:
        """Raises a 400 when prompt + ``max_tokens`` exceed the context, naming the fields
        the client sent (``messages`` or ``prompt``; ``max_completion_tokens`` or
        ``max_tokens``)."""
        max_len = self.model_config.max_model_len
        total = num_prompt_tokens + max_tokens
        if total <= max_len:
            return
        prompt = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
        raise bad_request(
            f"This model's maximum context length is {max_len} tokens. However, you "
            f"requested {total} tokens ({num_prompt_tokens} in the {prompt}, {max_tokens} in "
            f"the completion). Please reduce the length of the {prompt} or completion.",
            max_tokens_field(request),
        )

    def check_stream_options(self, request: SamplingFields) -> None:
        """The fields that depend on ``stream``: ``stream_options`` needs it; ``best_of``
        above ``n`` cannot have it (the best are known only at the end).

        Raises:
            OpenAIError: 400 naming the field.
        """
        if request.stream_options is not None and not request.stream:
            raise bad_request(
                "stream_options may only be set when stream is true.", "stream_options"
            )
        if request.stream and request.best_of is not None and request.best_of > (request.n or 1):
            raise bad_request("best_of cannot be used with stream.", "best_of")

    def log_arrival(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams | BeamSearchParams,
        truncate_prompt_tokens: int | None = None,
    ) -> None:
        if self.request_logger is not None:
            self.request_logger.log_arrival(
                request_id, prompt, prompt_ids, params, truncate_prompt_tokens
            )

    def log_finish(
        self, request_id: str, reasons: list[str | None], usage: UsageInfo, start_time: float
    ) -> None:
        if self.request_logger is not None:
            self.request_logger.log_finish(request_id, reasons, usage, start_time)

    def generate(
        self,
        prompt_ids: list[int],
        prompt: str | None,
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        priority: int,
        mm_features: list[Any] | None = None,
        model: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit one prompt (already tokenized; ``mm_features``: its processed images) to
        the engine, run by the LoRA adapter that ``model`` names, if it names one.

        Raises:
            OpenAIError: 503, the server is shutting down (``abort_running`` was called) or
                the engine sleeps (``POST /sleep``).
        """
        if self._closed:
            raise OpenAIError(SHUTTING_DOWN, HTTPStatus.SERVICE_UNAVAILABLE)
        if self.engine.sleeping:
            raise asleep_error()
        engine_prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids, "prompt": prompt}
        if mm_features:
            engine_prompt["mm_features"] = mm_features
        lora = self.models.lora_request(model) if self.models is not None else None
        # NOTE: only with an adapter: engines without LoRA take no lora_request.
        extra = {"lora_request": lora} if lora is not None else {}
        stream = self.engine.generate(engine_prompt, params, request_id, priority=priority, **extra)
        return self._tracked(request_id, stream)

    async def _tracked(
        self, request_id: str, stream: AsyncGenerator[RequestOutput, None]
    ) -> AsyncIterator[RequestOutput]:
        """``stream``, counted in ``num_running`` from its first step until it ends."""
        self._running.add(request_id)
        try:
            async for output in stream:
                yield output
        finally:
            self._running.discard(request_id)
            await stream.aclose()

    def aborted_error(
        self, stop_reason: int | str | None = None, request: SamplingFields | None = None
    ) -> OpenAIError:
        """The error for a request that ended with finish_reason "abort": its structured-output
        constraint failed (400, the engine's reason, naming the field of ``request`` that
        carried the constraint) or found the grammar compilers busy (429), the engine refused
        it on arrival (400, the engine's reason), the engine died (503), the server is shutting
        down (503), or it was aborted otherwise (500)."""
        field = "structured_outputs" if request is None else constraint_field(request)
        if isinstance(stop_reason, str) and stop_reason.startswith(CONSTRAINT_FAILURE_PREFIX):
            return constraint_error(stop_reason, field)
        if isinstance(stop_reason, str) and stop_reason.startswith(CONSTRAINT_BUSY_PREFIX):
            message = f"{field}: {stop_reason.removeprefix(CONSTRAINT_BUSY_PREFIX).strip()}"
            return OpenAIError(
                message, HTTPStatus.TOO_MANY_REQUESTS, field, code="rate_limit_exceeded"
            )
        if isinstance(stop_reason, str) and stop_reason.startswith(REQUEST_REFUSED_PREFIX):
            return OpenAIError(
                stop_reason.removeprefix(REQUEST_REFUSED_PREFIX).strip(), HTTPStatus.BAD_REQUEST
            )
        if self.engine.errored:
            return engine_dead(self.engine.dead_error or "unknown error")
        if self._closed:
            return OpenAIError(
                "The server is shutting down; the request was aborted.",
                HTTPStatus.SERVICE_UNAVAILABLE,
            )
        return OpenAIError("The request was aborted.", HTTPStatus.INTERNAL_SERVER_ERROR)

    def check_first_output(self, first: RequestOutput, request: SamplingFields) -> None:
        """Raise the error of a request the engine ended before its first token (refused on
        arrival: an adapter that cannot be read, a grammar that does not compile, ...), so
        that a streaming response fails with a status code instead of after its 200.

        Raises:
            OpenAIError: see ``aborted_error``.
        """
        for c in first.outputs:
            if c.finish_reason == "abort":
                raise self.aborted_error(c.stop_reason, request)

    def num_running(self) -> int:
        """Requests of this handler in the engine now."""
        return len(self._running)

    def abort_running(self) -> int:
        """Abort every running request and refuse new ones (503): the server shuts down.

        Each aborted stream ends with finish_reason "abort", which the handler turns into
        an error for its client. Returns how many requests were aborted.
        """
        self._closed = True
        running = list(self._running)
        if running:
            self.engine.abort(running)
        return len(running)


def check_implemented(request: SamplingFields) -> None:
    """Reject the request fields tokenmill accepts only to refuse them.

    Raises:
        OpenAIError: 400 naming the first such field given (one of
            ``UNIMPLEMENTED_FIELDS``).
    """
    for name in UNIMPLEMENTED_FIELDS:
        if getattr(request, name) is not None:
            raise bad_request(f"tokenmill does not implement {name} yet.", name)
    if request.use_beam_search:
        check_beam_search_request(request)


def max_tokens_field(request: SamplingFields) -> str:
    """The field that carried the request's token limit: chat's ``max_completion_tokens``
    (which wins when both are given), else ``max_tokens``."""
    if getattr(request, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    return "max_tokens"


def parse_logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``{"token id as a string": bias}`` -> ``{token_id: bias}``.

    Raises:
        OpenAIError: a key is not an integer.
    """
    if not logit_bias:
        return None
    try:
        return {int(k): float(v) for k, v in logit_bias.items()}
    except ValueError:
        raise bad_request(
            "logit_bias keys must be token ids (integers as strings), got "
            f"{sorted(logit_bias)[:5]}.",
            "logit_bias",
        ) from None


async def first_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Wait for a request's first output, turning a rejection into an OpenAIError.

    The engine validates a request when its stream is first awaited, so waiting here lets
    a bad request fail with a status code before a streaming response has started.
    """
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise OpenAIError("The engine returned no output for this request.", 500) from None
    except (ValueError, EngineDeadError) as e:
        raise to_openai_error(e) from None


async def _wait_for_disconnect(raw_request: Request) -> None:
    """Return when the client closes its connection (the ASGI ``http.disconnect`` message)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(raw_request: Request, handler: Awaitable[Response]) -> Response:
    """Run a request handler, cancelling it if the client disconnects first.

    Cancelling the handler closes its engine streams, which aborts the requests in the
    engine and frees their KV blocks. (Once a streaming response has started, Starlette
    cancels the stream itself on disconnect.)
    """
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    logger.info("client disconnected; request aborted")
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async streams as items arrive: yields ``(stream index, item)``.

    Leaving early (an error, a disconnect) closes every stream, aborting its request.
    """
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            aclose = getattr(streams[0], "aclose", None)
            if aclose is not None:
                await aclose()
        return
    pending: dict[asyncio.Future, int] = {
        asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

"""POST /v1/completions: prompt(s) -> engine -> OpenAI (legacy) completions response.

A request may carry several prompts; each becomes its own engine request, all run
concurrently, and prompt ``p``'s ``i``-th sequence is choice ``p * n + i``. With ``echo`` the
prompt text is prepended to each choice (and, with ``logprobs``, the prompt tokens' logprobs
to its logprobs, the first being null as nothing precedes it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenmill import envs
from tokenmill.engine.stage_timings import FRONT_END_TIMINGS
from tokenmill.entrypoints.openai.errors import OpenAIError, bad_request
from tokenmill.entrypoints.openai.logprobs import (
    clamp_logprob,
    per_prompt_position,
    prompt_logprobs_json,
    token_label,
    top_ranked,
)
from tokenmill.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from tokenmill.entrypoints.openai.serving_engine import (
    OpenAIServing,
    RequestLogger,
    check_implemented,
    first_output,
    merge_streams,
    to_openai_error,
)
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import MAX_N
from tokenmill.tokenizer import decode_token_texts

if TYPE_CHECKING:
    from tokenmill.engine.async_llm import AsyncLLM

SSE_DONE = "data: [DONE]\n\n"
# The most sequences one completions request may start (its prompts times max(n, best_of)):
# each is an engine request, and 2,000 prompts x n=128 held the front end for minutes.
MAX_SEQUENCES_PER_REQUEST = 4096

# One prompt as given: its text (None for token ids) and its token ids.
Prompt = tuple[str | None, list[int]]


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob] | None],
    num_top: int,
    token_text: dict[int, str],
    initial_offset: int = 0,
    as_ids: bool = False,
) -> tuple[CompletionLogProbs, int]:
    """OpenAI's legacy ``logprobs`` object for a run of tokens.

    Args:
        token_ids: the tokens, in order.
        logprobs: per token, its Logprob entry (the chosen token and the top ones) or None
            (the first prompt token, which has no logprob).
        num_top: how many alternatives go into ``top_logprobs`` (besides the chosen token).
        token_text: texts of tokens without an entry (decoded by the caller).
        initial_offset: character offset of the first token in the choice's text.
        as_ids: tokens (and top_logprobs' keys) named ``"token_id:<id>"`` instead of their
            text (``token_label``); offsets still count the texts.

    Returns:
        tokens, token_logprobs, top_logprobs ({token: logprob}) and text_offset (characters
        into the choice's text), logprobs clamped to finite values; and the offset after
        the last token's text.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    offset = initial_offset
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        chosen = entry.get(token_id) if entry is not None else None
        if entry is None or chosen is None:
            text = token_text.get(token_id, "")
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            text = chosen.decoded_token or ""
            token_logprobs.append(clamp_logprob(chosen.logprob))
            top = {
                token_label(tid, lp.decoded_token or "", as_ids): clamp_logprob(lp.logprob)
                for tid, lp in top_ranked(entry, num_top)
            }
            top.setdefault(token_label(token_id, text, as_ids), clamp_logprob(chosen.logprob))
            top_logprobs.append(top)
        tokens.append(token_label(token_id, text, as_ids))
        text_offset.append(offset)
        offset += len(text)
    # Every field is passed explicitly: streamed chunks are dumped with exclude_unset.
    result = CompletionLogProbs(
        text_offset=text_offset,
        token_logprobs=token_logprobs,
        tokens=tokens,
        top_logprobs=top_logprobs,
    )
    return result, offset


class OpenAIServingCompletion(OpenAIServing):
    """Serves (legacy) text completions.

    Args:
        engine: the running AsyncLLM.
        request_logger: logs arrivals and finishes; None disables request logs.
    """

    def __init__(self, engine: AsyncLLM, request_logger: RequestLogger | None = None) -> None:
        super().__init__(engine, request_logger)
        self._timed = envs.log_step_stats()  # front-end stage timings (a debug aid)

    async def create_completion(
        self, request: CompletionRequest, raw_request: Request | None = None
    ) -> Response:
        """Answer one completions request (streaming or not).

        Raises:
            OpenAIError: 400 for an invalid request, 404 for an unknown model, 503 if the
                engine is dead.
        """
        start = time.monotonic()
        self.check_model(request.model)
        self._check_supported(request)
        self.check_stream_options(request)
        prompts = await self._prompts(request)
        timed = self._timed
        if timed:
            FRONT_END_TIMINGS.record("handler->tokenized", time.monotonic() - start)
        request_id = random_id("cmpl")
        streams = []
        if request.truncate_prompt_tokens is not None:
            cut: list[Prompt] = []
            for text, ids in prompts:
                kept = self.truncate_prompt(ids, request, request.max_tokens)
                # A cut prompt echoes its kept tokens' text.
                cut.append((text if len(kept) == len(ids) else None, kept))
            prompts = cut
        for p, (text, ids) in enumerate(prompts):
            if ids:  # (an empty prompt is the engine's to reject)
                self.check_prompt_length(len(ids), "prompt")
            params = self.build_sampling_params(
                request,
                len(ids),
                # Echo with max_tokens 0 scores the prompt: one token is generated, not sent.
                1 if _echo_only(request) else request.max_tokens,
                request.logprobs,
                # An explicit prompt_logprobs wins; echo with logprobs falls back to logprobs.
                prompt_logprobs=(
                    request.prompt_logprobs
                    if request.prompt_logprobs is not None or not request.echo
                    else request.logprobs
                ),
                best_of=request.best_of,
            )
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{p}"
            self.log_arrival(sub_id, text, ids, params, request.truncate_prompt_tokens)
            streams.append(
                self.generate(ids, text, params, sub_id, request.priority, model=request.model)
            )
        submitted = time.monotonic()
        firsts = await self._first_outputs(streams, request)
        if timed:
            FRONT_END_TIMINGS.record("submitted->first output", time.monotonic() - submitted)
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, prompts, firsts, streams, start),
                media_type="text/event-stream",
            )
        finals = list(firsts)
        try:
            pending = [s for s, f in zip(streams, firsts, strict=True) if not f.finished]
            index = [p for p, f in enumerate(firsts) if not f.finished]
            async for i, out in merge_streams(pending):
                finals[index[i]] = out
        except Exception as e:
            raise to_openai_error(e) from None
        response = self._full_response(request, request_id, prompts, finals)
        self.log_finish(
            request_id, [c.finish_reason for c in response.choices], response.usage, start
        )
        return Response(response.model_dump_json(), media_type="application/json")

    # ---- request -> prompts -----------------------------------------------------------------

    def _check_supported(self, request: CompletionRequest) -> None:
        check_implemented(request)
        prompt = request.prompt
        single = isinstance(prompt, str) or all(isinstance(p, int) for p in prompt)
        num_prompts = 1 if single else len(prompt)
        copies = max(request.n or 1, request.best_of or 1)
        # (n or best_of above MAX_N get their own error from the sampling parameters.)
        if copies <= MAX_N and num_prompts * copies > MAX_SEQUENCES_PER_REQUEST:
            raise bad_request(
                f"a request may ask for at most {MAX_SEQUENCES_PER_REQUEST} sequences (prompts "
                f"x max(n, best_of)); this one asks for {num_prompts} x {copies}.",
                "prompt",
            )
        if request.suffix:
            raise bad_request("tokenmill does not implement suffix (insertion) yet.", "suffix")
        if request.max_tokens == 0 and not request.echo:
            raise bad_request(
                "max_tokens must be at least 1, got 0 (0 is allowed only with echo, which "
                "returns the prompt and generates nothing).",
                "max_tokens",
            )
        if _echo_only(request) and request.min_tokens:
            # (Scoring the prompt samples one token internally, which must not leak here.)
            raise bad_request(
                f"min_tokens must be 0 with max_tokens 0 (echo returns the prompt and "
                f"generates nothing), got {request.min_tokens}.",
                "min_tokens",
            )

    async def _prompts(self, request: CompletionRequest) -> list[Prompt]:
        prompt = request.prompt
        if isinstance(prompt, str):
            return [(prompt, await self._encode(prompt))]
        if not prompt:
            raise bad_request("prompt must not be empty.", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [(None, list(prompt))]  # type: ignore[arg-type]
        texts = [p for p in prompt if isinstance(p, str)]
        encoded = iter(await asyncio.gather(*(self._encode(t) for t in texts)))
        return [
            (p, next(encoded)) if isinstance(p, str) else (None, list(p))  # type: ignore[misc]
            for p in prompt
        ]

    async def _encode(self, text: str) -> list[int]:
        # The engine's own rule for text prompts: the tokenizer's default special tokens,
        # encoded off the event loop.
        return await self.engine.encode(text, add_special_tokens=True, param="prompt")

    async def _first_outputs(
        self, streams: list[AsyncIterator[RequestOutput]], request: CompletionRequest
    ) -> list[RequestOutput]:
        """Submit every prompt at once and wait for each one's first output.

        Raises:
            OpenAIError: a prompt was rejected (the other prompts are aborted).
        """
        results = await asyncio.gather(*(first_output(s) for s in streams), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            try:
                for r in results:
                    self.check_first_output(r, request)  # type: ignore[arg-type]
            except OpenAIError as e:
                errors.append(e)
        if errors:
            for stream in streams:
                await stream.aclose()  # type: ignore[attr-defined]
            raise to_openai_error(errors[0])
        return results  # type: ignore[return-value]

    # ---- outputs -> response ----------------------------------------------------------------

    def _prompt_text(self, prompt: Prompt) -> str:
        text, ids = prompt
        return text if text is not None else self.tokenizer.decode(ids)

    def _echo_logprobs(
        self, prompt_ids: list[int], prompt_logprobs: list | None, num_top: int, as_ids: bool
    ) -> tuple[CompletionLogProbs, int]:
        entries = per_prompt_position(prompt_ids, prompt_logprobs)
        bare = [t for t, e in zip(prompt_ids, entries, strict=True) if e is None]
        texts = dict(zip(bare, decode_token_texts(self.tokenizer, bare), strict=True))
        return completion_logprobs(prompt_ids, entries, num_top, texts, 0, as_ids)

    def _choice(
        self,
        request: CompletionRequest,
        prompt: Prompt,
        prompt_logprobs: list | None,
        c: CompletionOutput,
        choice_index: int,
        echo: bool,
        text_offset: int,
        first: bool = True,
    ) -> tuple[CompletionChoice, int]:
        """One choice (or one chunk of it); returns it and the text offset after it (after
        its tokens' texts when it carries logprobs).

        Args:
            echo: prepend the prompt (and its logprobs): the choice's first chunk only.
            text_offset: characters of this choice's text sent before (streaming).
            first: the choice's first chunk, which carries ``prompt_logprobs`` if asked for.
        """
        if c.finish_reason == "abort":
            raise self.aborted_error(c.stop_reason, request)
        num_top = request.logprobs or 0
        as_ids = self.tokens_as_ids(request)
        prefix = self._prompt_text(prompt) if echo else ""
        logprobs = None
        start = text_offset + len(prefix)
        if echo and request.logprobs is not None:
            # The generated tokens' offsets go on from the prompt tokens' (whose texts, one
            # token at a time, may count a split character twice), so none overlap.
            logprobs, start = self._echo_logprobs(prompt[1], prompt_logprobs, num_top, as_ids)
        text = prefix + c.text
        end = text_offset + len(text)
        if c.logprobs is not None:
            generated, after = completion_logprobs(
                c.token_ids, c.logprobs, num_top, {}, start, as_ids
            )
            if generated.tokens:
                # Offsets follow the tokens' texts: a token whose character is not complete
                # yet sends no text in its chunk but still takes its place in the offsets.
                end = after
            if logprobs is None:
                logprobs = generated
            else:
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(logprobs, name).extend(getattr(generated, name))
        choice = CompletionChoice(
            index=choice_index, text=text, logprobs=logprobs, finish_reason=c.finish_reason
        )
        if c.finish_reason is not None:
            choice.stop_reason = c.stop_reason
        if first and request.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs_json(prompt[1], prompt_logprobs)
        return choice, end

    def _full_response(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[Prompt],
        finals: list[RequestOutput],
    ) -> CompletionResponse:
        n = request.n or 1
        choices = []
        prompt_tokens = completion_tokens = cached = 0
        for p, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            prompt_tokens += len(final.prompt_token_ids)
            cached += final.num_cached_tokens
            for c in final.outputs:
                c = _without_generation(c) if _echo_only(request) else c
                completion_tokens += len(c.token_ids)
                choice, _ = self._choice(
                    request,
                    prompt,
                    final.prompt_logprobs,
                    c,
                    p * n + c.index,
                    bool(request.echo),
                    0,
                )
                choices.append(choice)
        return CompletionResponse(
            id=request_id,
            model=self.response_model(request.model),
            choices=choices,
            usage=_usage(prompt_tokens, completion_tokens, cached),
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[Prompt],
        firsts: list[RequestOutput],
        streams: list[AsyncIterator[RequestOutput]],
        start: float,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        n = request.n or 1
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and bool(options and options.continuous_usage_stats)
        prompt_tokens = sum(len(f.prompt_token_ids) for f in firsts)
        cached = sum(f.num_cached_tokens for f in firsts)
        num_choices = len(prompts) * n
        completion_tokens = [0] * num_choices
        sent = [False] * num_choices
        finish_reasons: list[str | None] = [None] * num_choices
        offsets = [0] * num_choices
        timed = self._timed
        # DELTA outputs carry the prompt logprobs once; every echoed choice needs them.
        prompt_logprobs: list[list | None] = [f.prompt_logprobs for f in firsts]
        model = self.response_model(request.model)

        def sse(choice: CompletionChoice | None, usage: UsageInfo | None = None) -> str:
            chunk = CompletionStreamResponse(
                id=request_id,
                object="text_completion",
                created=created,
                model=model,
                choices=[choice] if choice is not None else [],
            )
            if include_usage:
                chunk.usage = usage
            return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"

        async def chained(p: int) -> AsyncIterator[RequestOutput]:
            yield firsts[p]
            if not firsts[p].finished:
                async for out in streams[p]:
                    yield out

        try:
            async for p, output in merge_streams([chained(p) for p in range(len(prompts))]):
                if prompt_logprobs[p] is None:
                    prompt_logprobs[p] = output.prompt_logprobs
                for c in output.outputs:
                    c = _without_generation(c) if _echo_only(request) else c
                    k = p * n + c.index
                    completion_tokens[k] += len(c.token_ids)
                    finish_reasons[k] = c.finish_reason
                    first, sent[k] = not sent[k], True
                    choice, offsets[k] = self._choice(
                        request, prompts[p], prompt_logprobs[p], c, k,
                        bool(request.echo) and first, offsets[k], first=first,
                    )  # fmt: skip
                    usage = None
                    if continuous_usage:  # this choice's own counts, as vLLM reports them
                        usage = _usage(
                            len(firsts[p].prompt_token_ids),
                            completion_tokens[k],
                            firsts[p].num_cached_tokens,
                        )
                    if timed:
                        FRONT_END_TIMINGS.record("handler->first chunk", time.monotonic() - start)
                        timed = False
                    yield sse(choice, usage)
            usage = _usage(prompt_tokens, sum(completion_tokens), cached)
            if include_usage:
                yield sse(None, usage)
            self.log_finish(request_id, finish_reasons, usage, start)
        except Exception as e:  # the stream has begun: report in-band, then end it
            yield to_openai_error(e).to_sse()
        finally:
            for stream in streams:
                await stream.aclose()  # type: ignore[attr-defined]
        yield SSE_DONE


def _echo_only(request: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens: 0``: the prompt (and its logprobs) and nothing generated,
    as OpenAI's legacy completions and vLLM answer (evaluation harnesses score prompts so)."""
    return bool(request.echo) and request.max_tokens == 0


def _without_generation(c: CompletionOutput) -> CompletionOutput:
    """``c`` with its generated tokens dropped; a finished one ends at the length limit."""
    reason = c.finish_reason if c.finish_reason in (None, "abort") else "length"
    logprobs = None if c.logprobs is None else []
    stop = c.stop_reason if reason == "abort" else None
    return CompletionOutput(c.index, "", [], None, logprobs, reason, stop)


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )

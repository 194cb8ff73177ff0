"""OpenAIServing without a server: the running-request registry that shutdown aborts, and the
context-length error's wording. A fake engine stands in for AsyncLLM (no model, no process).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from tokenmill.entrypoints.openai.errors import OpenAIError
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.entrypoints.openai.serving_engine import (
    OpenAIServing,
    RequestLogger,
    max_tokens_field,
    shown_params,
)
from tokenmill.sampling_params import BeamSearchParams, SamplingParams

MAX_MODEL_LEN = 64


class FakeEngine:
    """Streams ``tokens`` outputs per request; ``abort`` ends a stream as AsyncLLM does, with
    a final output (here the string "abort")."""

    def __init__(self, tokens: int = 3) -> None:
        self.tokens = tokens
        self.model_config = SimpleNamespace(
            served_model_name="fake",
            served_model_names=("fake", "alias"),
            max_model_len=MAX_MODEL_LEN,
            generation_config={},
        )
        self.config = SimpleNamespace(scheduler_config=SimpleNamespace(scheduling_policy="fcfs"))
        self.input_processor = SimpleNamespace(default_sampling_params=SamplingParams)
        self.errored = False
        self.sleeping = False
        self.dead_error: str | None = None
        self.aborted: list[str] = []
        self._queues: dict[str, asyncio.Queue] = {}

    def get_tokenizer(self) -> object:
        return object()

    async def generate(
        self, prompt: Any, params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        for i in range(self.tokens):
            queue.put_nowait(f"token {i}")
        while True:
            item = await queue.get()
            yield item
            if item == "abort":
                return

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self._queues[request_id].put_nowait("abort")


def make_serving(engine: FakeEngine | None = None) -> OpenAIServing:
    return OpenAIServing(engine or FakeEngine())  # type: ignore[arg-type]


def start(serving: OpenAIServing, request_id: str) -> AsyncIterator[Any]:
    return serving.generate([1, 2], None, SamplingParams(), request_id, 0)


def test_streams_count_as_running_until_they_end():
    async def scenario() -> list[int]:
        serving = make_serving()
        stream = start(serving, "a")
        counts = [serving.num_running()]  # not submitted before it is first awaited
        await stream.__anext__()
        counts.append(serving.num_running())
        await stream.aclose()  # a client that went away
        counts.append(serving.num_running())
        return counts

    assert asyncio.run(scenario()) == [0, 1, 0]


def test_abort_running_ends_every_stream_and_refuses_new_requests():
    async def scenario() -> tuple[int, list[str], list[list[Any]], OpenAIError]:
        engine = FakeEngine(tokens=1)
        serving = make_serving(engine)
        streams = [start(serving, rid) for rid in ("a", "b")]
        for stream in streams:
            await stream.__anext__()
        aborted = serving.abort_running()
        rest = []
        for stream in streams:
            rest.append([out async for out in stream])
        with pytest.raises(OpenAIError) as refused:
            start(serving, "c")
        return aborted, engine.aborted, rest, refused.value

    aborted, engine_aborted, rest, refused = asyncio.run(scenario())
    assert aborted == 2 and sorted(engine_aborted) == ["a", "b"]
    assert rest == [["abort"], ["abort"]]  # each stream ended, none hangs
    assert refused.status == 503 and "shutting down" in refused.message


def test_any_served_name_is_accepted():
    serving = make_serving()
    serving.check_model(None)
    serving.check_model("fake")
    serving.check_model("alias")
    with pytest.raises(OpenAIError) as info:
        serving.check_model("other")
    assert info.value.status == 404


def test_aborted_error_says_why():
    serving = make_serving()
    assert serving.aborted_error().status == 500
    serving.abort_running()
    error = serving.aborted_error()
    assert error.status == 503 and "shutting down" in error.message
    serving.engine.errored, serving.engine.dead_error = True, "boom"  # type: ignore[attr-defined]
    assert serving.aborted_error().code == "engine_dead"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "text"}, "guided_json": {}}, "guided_json"),
    ],
)
def test_a_constraint_given_up_in_the_engine_names_the_clients_field(fields, param):
    reason = "structured_outputs: the constraint admits no token after 3 tokens"
    request = CompletionRequest(model="m", prompt="Hi", **fields)
    error = make_serving().aborted_error(reason, request)
    assert error.status == 400 and error.param == param
    assert error.message.startswith(f"{param}:")


def test_abort_running_with_nothing_running_aborts_nothing():
    engine = FakeEngine()
    assert make_serving(engine).abort_running() == 0 and engine.aborted == []


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


@pytest.mark.parametrize(
    ("request_", "limit", "prompt_word", "param"),
    [
        (CompletionRequest(prompt="x", max_tokens=100), 100, "prompt", "max_tokens"),
        (chat(max_tokens=100), 100, "messages", "max_tokens"),
        (chat(max_completion_tokens=100), 100, "messages", "max_completion_tokens"),
        (chat(max_tokens=5, max_completion_tokens=100), 100, "messages", "max_completion_tokens"),
    ],
    ids=["completions", "chat max_tokens", "chat max_completion_tokens", "chat both"],
)
def test_context_overflow_names_the_fields_the_client_sent(request_, limit, prompt_word, param):
    serving = make_serving()
    with pytest.raises(OpenAIError) as raised:
        serving.build_sampling_params(request_, 3, limit, None)
    error = raised.value
    assert error.status == 400 and error.param == param
    other = "messages" if prompt_word == "prompt" else "prompt"
    assert f"3 in the {prompt_word}, {limit} in the completion" in error.message
    assert f"the {other}" not in error.message and str(MAX_MODEL_LEN) in error.message


def test_a_request_that_fits_exactly_is_accepted():
    params = make_serving().build_sampling_params(
        CompletionRequest(prompt="x"), 4, MAX_MODEL_LEN - 4, None
    )
    assert params.max_tokens == MAX_MODEL_LEN - 4


def test_invalid_max_completion_tokens_is_reported_under_its_name():
    """The request model refuses it (the server's 400 names the field: test_errors.py); the
    sampling check behind it names the same field for a request built without validation."""
    with pytest.raises(ValidationError, match="max_completion_tokens"):
        chat(max_completion_tokens=0)
    request = ChatCompletionRequest.model_construct(
        messages=[{"role": "user", "content": "hi"}], max_completion_tokens=0
    )
    with pytest.raises(OpenAIError) as raised:
        make_serving().build_sampling_params(request, 3, 0, None)
    assert raised.value.param == "max_completion_tokens"
    assert "max_completion_tokens" in raised.value.message


def test_max_tokens_field():
    assert max_tokens_field(CompletionRequest(prompt="x", max_tokens=3)) == "max_tokens"
    assert max_tokens_field(chat()) == "max_tokens"
    assert max_tokens_field(chat(max_completion_tokens=3)) == "max_completion_tokens"


def test_logged_params_cut_long_lists():
    params = SamplingParams(bad_words=[f"w{i}" for i in range(1000)], allowed_token_ids=[1, 2])
    text = shown_params(params)
    assert "bad_words=['w0', " in text and "... (1000 in all)" in text and "w999" not in text
    assert "allowed_token_ids=[1, 2]," in text
    assert shown_params(SamplingParams()) == str(SamplingParams())


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=4),
                                    BeamSearchParams(beam_width=2, max_tokens=4)])
def test_the_request_log_shows_the_truncation_asked_for(caplog, params):
    """The server cuts the prompt itself, so the engine's params carry no truncation; the
    arrival line still shows the one the request asked for."""
    caplog.set_level(logging.INFO, "tokenmill.entrypoints.openai")
    logger = RequestLogger()
    logger.log_arrival("cmpl-1", None, [5, 6, 7, 8], params, truncate_prompt_tokens=4)
    logger.log_arrival("cmpl-2", "x", [5], params)
    cut, whole = (r.getMessage() for r in caplog.records)
    assert cut.count("truncate_prompt_tokens") == 1 and "truncate_prompt_tokens=4" in cut
    assert "truncate_prompt_tokens=4" not in whole
    assert shown_params(params) in whole

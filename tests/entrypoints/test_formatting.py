"""Unit tests (no server): logprob formatting, token bytes, error bodies, stat loggers."""

from __future__ import annotations

import asyncio
import json
import logging
import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tokenmill.core.engine_io import SchedulerStats
from tokenmill.engine.output_processor import FinishedRequestStats, IterationStats
from tokenmill.entrypoints.openai.errors import OpenAIError, model_not_found
from tokenmill.entrypoints.openai.logprobs import (
    MIN_LOGPROB,
    TokenBytes,
    clamp_logprob,
)
from tokenmill.entrypoints.openai.serving_chat import chat_logprobs
from tokenmill.entrypoints.openai.serving_completion import completion_logprobs
from tokenmill.entrypoints.openai.serving_engine import (
    merge_streams,
    parse_logit_bias,
)
from tokenmill.metrics import LoggingStatLogger, PrometheusStatLogger
from tokenmill.outputs import Logprob


def test_clamp_logprob_is_json_safe():
    assert clamp_logprob(float("-inf")) == MIN_LOGPROB
    assert clamp_logprob(float("nan")) == MIN_LOGPROB
    assert clamp_logprob(-1e30) == MIN_LOGPROB
    assert clamp_logprob(-0.5) == -0.5
    assert clamp_logprob(float("inf")) == -MIN_LOGPROB
    assert clamp_logprob(17.5) == 17.5  # a logit (--logprobs-mode raw_logits)


class _Bytes:
    def __call__(self, token_id: int, text: str) -> list[int]:
        return list(text.encode())


def test_chat_logprobs_clamps_and_orders_by_rank():
    entry = {
        7: Logprob(float("-inf"), 3, "c"),  # the chosen token, ranked third
        5: Logprob(-0.1, 1, "a"),
        6: Logprob(float("nan"), 2, "b"),
        8: Logprob(-9.0, 4, "d"),
    }
    result = chat_logprobs([7], [entry], 3, _Bytes())
    content = result.content[0]
    assert (content.token, content.logprob, content.bytes) == ("c", MIN_LOGPROB, [99])
    assert [t.token for t in content.top_logprobs] == ["a", "b", "c"]
    dumped = json.loads(result.model_dump_json())
    assert all(math.isfinite(t["logprob"]) for t in dumped["content"][0]["top_logprobs"])
    assert chat_logprobs([7], [entry], 0, _Bytes()).content[0].top_logprobs == []


def test_completion_logprobs_offsets_and_first_prompt_token():
    entries = [
        None,
        {4: Logprob(-1.0, 2, " b"), 3: Logprob(-0.5, 1, " a")},
        {9: Logprob(float("-inf"), 1, "!")},
    ]
    result, end = completion_logprobs([1, 4, 9], entries, 1, {1: "x"}, initial_offset=0)
    assert result.tokens == ["x", " b", "!"]
    assert result.token_logprobs == [None, -1.0, MIN_LOGPROB]
    assert result.top_logprobs == [None, {" a": -0.5, " b": -1.0}, {"!": MIN_LOGPROB}]
    assert result.text_offset == [0, 1, 3]
    assert end == 4


def test_logprobs_name_tokens_by_id_when_asked():
    """vLLM's return_tokens_as_token_ids: "token_id:<id>" in tokens and top_logprobs' keys,
    offsets still counted in the tokens' texts; bytes stay the text's."""
    entries = [None, {4: Logprob(-1.0, 2, " b"), 3: Logprob(-0.5, 1, " a")}]
    result, end = completion_logprobs([1, 4], entries, 1, {1: "x"}, 0, as_ids=True)
    assert result.tokens == ["token_id:1", "token_id:4"]
    assert result.top_logprobs == [None, {"token_id:3": -0.5, "token_id:4": -1.0}]
    assert result.text_offset == [0, 1] and end == 3
    entry = {7: Logprob(-0.1, 1, "hi"), 8: Logprob(-2.0, 2, "ho")}
    chat = chat_logprobs([7], [entry], 1, _Bytes(), as_ids=True).content[0]
    assert chat.token == "token_id:7" and chat.top_logprobs[0].token == "token_id:7"
    assert chat.bytes == list(b"hi")


def test_token_bytes_of_split_characters(smollm2_tokenizer):
    token_bytes = TokenBytes(smollm2_tokenizer)
    text = "héllo 😀 日本 <|im_end|>"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    pieces = [bytes(token_bytes(t, smollm2_tokenizer.decode([t]))) for t in ids]
    assert b"".join(pieces).decode("utf-8") == text
    assert any(_not_utf8(p) for p in pieces)  # some token holds part of a character


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_parse_logit_bias():
    assert parse_logit_bias({"5": 1, "10": -100}) == {5: 1.0, 10: -100.0}
    assert parse_logit_bias(None) is None
    with pytest.raises(OpenAIError) as e:
        parse_logit_bias({"five": 1})
    assert e.value.status == 400 and e.value.param == "logit_bias"


def test_error_body_shape():
    error = model_not_found("gpt-x")
    assert error.status == 404
    assert error.to_dict() == {
        "error": {
            "message": "The model `gpt-x` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert error.to_sse().startswith("data: {") and error.to_sse().endswith("\n\n")


def test_merge_streams_interleaves_and_closes():
    closed = []

    async def numbers(tag: str, count: int):
        try:
            for i in range(count):
                await asyncio.sleep(0)
                yield f"{tag}{i}"
        finally:
            closed.append(tag)

    async def collect(limit: int | None):
        items = []
        async for index, item in merge_streams([numbers("a", 3), numbers("b", 2)]):
            items.append((index, item))
            if limit is not None and len(items) == limit:
                break
        return items

    items = asyncio.run(collect(None))
    assert sorted(items) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    closed.clear()
    asyncio.run(collect(1))
    assert sorted(closed) == ["a", "b"]


def _step(running: int, usage: float, finished: list[str]) -> tuple:
    sched = SchedulerStats(
        num_running_reqs=running,
        num_waiting_reqs=1,
        kv_cache_usage=usage,
        prefix_cache_queries=32,
        prefix_cache_hits=16,
        num_preemptions=1,
        num_constraint_failures=1,
    )
    it = IterationStats(
        iteration_timestamp=0.0,
        num_prompt_tokens=10,
        num_generation_tokens=3,
        time_to_first_tokens=[0.2],
        inter_token_latencies=[0.01, 0.02],
    )
    it.finished_requests = [
        FinishedRequestStats("r", reason, 1.5, 0.1, 10, 3) for reason in finished
    ]
    return sched, it


def test_prometheus_stat_logger():
    registry = CollectorRegistry()
    stat_logger = PrometheusStatLogger("m", registry)
    stat_logger.record(*_step(2, 0.25, ["stop", "length"]))
    stat_logger.record(*_step(0, 0.0, ["stop"]))
    stat_logger.record(None, None)
    text = generate_latest(registry).decode()

    def value(sample: str) -> float:
        for line in text.splitlines():
            if line.startswith(sample + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{sample} missing from\n{text}")

    assert value('tokenmill:num_requests_running{model_name="m"}') == 0
    assert value('tokenmill:num_requests_waiting{model_name="m"}') == 1
    assert value('tokenmill:kv_cache_usage_perc{model_name="m"}') == 0
    assert value('tokenmill:prefix_cache_queries_total{model_name="m"}') == 64
    assert value('tokenmill:prefix_cache_hits_total{model_name="m"}') == 32
    assert value('tokenmill:num_preemptions_total{model_name="m"}') == 2
    assert value('tokenmill:structured_output_failures_total{model_name="m"}') == 2
    assert value('tokenmill:prompt_tokens_total{model_name="m"}') == 20
    assert value('tokenmill:generation_tokens_total{model_name="m"}') == 6
    assert value('tokenmill:request_success_total{finished_reason="stop",model_name="m"}') == 2
    assert value('tokenmill:request_success_total{finished_reason="length",model_name="m"}') == 1
    assert value('tokenmill:request_success_total{finished_reason="abort",model_name="m"}') == 0
    assert value('tokenmill:time_to_first_token_seconds_count{model_name="m"}') == 2
    assert value('tokenmill:inter_token_latency_seconds_count{model_name="m"}') == 4
    assert value('tokenmill:e2e_request_latency_seconds_count{model_name="m"}') == 3
    assert value('tokenmill:request_queue_time_seconds_count{model_name="m"}') == 3


def test_logging_stat_logger(caplog):
    stat_logger = LoggingStatLogger()
    with caplog.at_level(logging.INFO, logger="tokenmill.metrics"):
        stat_logger.record(*_step(2, 0.25, []))
        stat_logger.log()
        stat_logger.record(SchedulerStats(), None)
        stat_logger.log()  # becomes idle: logged once
        stat_logger.log()  # still idle: not logged again
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "Running: 2 reqs" in lines[0] and "Waiting: 1 reqs" in lines[0]
    assert "KV cache usage: 25.0%" in lines[0] and "Prefix cache hit rate: 50.0%" in lines[0]
    assert "Avg prompt throughput" in lines[0] and "Avg generation throughput" in lines[0]
    assert "Running: 0 reqs" in lines[1]


def test_api_key_middleware_under_a_root_path():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from tokenmill.entrypoints.auth import APIKeyMiddleware

    async def ok(_):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/health", ok), Route("/v1/models", ok)])
    app.add_middleware(APIKeyMiddleware, api_key="k")
    client = TestClient(app, root_path="/api")
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "bearer k"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Basic k"}).status_code == 401
    denied = client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert denied.json()["error"]["code"] == "invalid_api_key"

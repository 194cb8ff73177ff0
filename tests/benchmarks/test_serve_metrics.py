"""Serving metrics and the stream parser, on hand-made records and byte streams."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenmill.benchmarks.common import BenchmarkError, parse_percentiles
from tokenmill.benchmarks.serve_client import StreamError, StreamReader, arrival_offsets
from tokenmill.benchmarks.serve_metrics import (
    RequestRecord,
    compute_summary,
    format_summary,
    max_concurrent_requests,
    output_tokens_per_bucket,
    parse_goodput,
    parse_metric_names,
)


def _ok(index, start, ttft, itls, out, prompt=10):
    return RequestRecord(
        index,
        prompt,
        out,
        success=True,
        start_s=start,
        ttft_s=ttft,
        latency_s=ttft + sum(itls),
        itl_s=list(itls),
        prompt_tokens=prompt,
        output_tokens=out,
    )


RECORDS = [
    _ok(0, 0.0, 0.1, [0.02, 0.02, 0.02], 4),  # e2e 0.16, tpot 0.02
    _ok(1, 0.05, 0.3, [0.04, 0.06], 3, prompt=20),  # e2e 0.40, tpot 0.05
    _ok(2, 0.5, 0.2, [], 1),  # one token: no TPOT
    RequestRecord(3, 10, 4, success=False, error="HTTP 500: boom", start_s=0.6, latency_s=0.01),
    RequestRecord(4, 10, 4, success=False, error="HTTP 500: boom", start_s=0.7, latency_s=0.01),
]


def test_summary_values():
    s = compute_summary(RECORDS, duration_s=2.0, percentiles=[50, 99])
    assert (s["completed"], s["failed"]) == (3, 2)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (40, 8)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(24.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_tpot_ms"] == pytest.approx(35.0)  # (20 + 50) / 2; request 2 has none
    itls = np.array([20, 20, 20, 40, 60.0])
    assert s["mean_itl_ms"] == pytest.approx(itls.mean())
    assert s["p99_itl_ms"] == pytest.approx(np.percentile(itls, 99))
    assert s["mean_e2el_ms"] == pytest.approx((160 + 400 + 200) / 3)
    assert s["request_goodput"] is None
    assert s["error_counts"] == {"HTTP 500: boom": 2}


def test_goodput():
    assert compute_summary(RECORDS, 2.0, [99], {"ttft": 250})["request_goodput"] == 1.0
    assert compute_summary(RECORDS, 2.0, [99], {"ttft": 150})["request_goodput"] == 0.5
    both = compute_summary(RECORDS, 2.0, [99], {"ttft": 250, "tpot": 10})
    assert both["request_goodput"] == 0.5  # only request 2 (one token: no TPOT) of 2 s
    assert compute_summary(RECORDS, 2.0, [99], {"e2el": 1e9})["request_goodput"] == 1.5
    assert compute_summary(RECORDS, 2.0, [99], {"ttft": 0})["request_goodput"] == 0.0


def test_no_successful_request():
    s = compute_summary(RECORDS[3:], 1.0, [99])
    assert s["completed"] == 0 and s["mean_ttft_ms"] is None and s["p99_e2el_ms"] is None
    text = format_summary(s, ["ttft", "e2el"], [99])
    assert "Mean TTFT (ms):" in text and "n/a" in text
    assert "2 x HTTP 500: boom" in text


def test_concurrency_and_token_buckets():
    assert max_concurrent_requests(RECORDS) == 2
    back_to_back = [_ok(0, 0.0, 1.0, [], 1), _ok(1, 1.0, 1.0, [], 1)]
    assert max_concurrent_requests(back_to_back) == 1
    counts = output_tokens_per_bucket(RECORDS, duration_s=2.0)
    assert counts.sum() == pytest.approx(8.0)
    assert counts.tolist() == pytest.approx([8.0, 0.0])
    # chunks standing for several tokens are weighted: 6 tokens over 2 chunks
    packed = _ok(0, 0.0, 0.5, [1.0], 6)
    assert output_tokens_per_bucket([packed], 2.0).tolist() == pytest.approx([3.0, 3.0])


def test_format_summary_rows_are_vllms():
    s = compute_summary(RECORDS, 2.0, [90, 99.9], {"ttft": 250})
    text = format_summary(
        s, ["ttft", "tpot", "itl", "e2el"], [90, 99.9], max_concurrency=8, request_rate=4.0
    )
    for row in [
        "============ Serving Benchmark Result ============",
        "Successful requests:",
        "Failed requests:",
        "Maximum request concurrency:",
        "Request rate configured (RPS):",
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Request goodput (req/s):",
        "Output token throughput (tok/s):",
        "Peak output token throughput (tok/s):",
        "Peak concurrent requests:",
        "Total token throughput (tok/s):",
        "---------------Time to First Token----------------",
        "-----Time per Output Token (excl. 1st token)------",
        "---------------Inter-token Latency----------------",
        "----------------End-to-end Latency----------------",
        "Mean TTFT (ms):",
        "Median TPOT (ms):",
        "P90 ITL (ms):",
        "P99.9 E2EL (ms):",
    ]:
        assert row in text, row
    assert "p99.9_e2el_ms" in s and "p90_ttft_ms" in s


def test_flag_parsers():
    assert parse_goodput(["ttft:500", "TPOT:50", "e2el:1e3"]) == {
        "ttft": 500.0,
        "tpot": 50.0,
        "e2el": 1000.0,
    }
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(BenchmarkError):
            parse_goodput(bad)
    assert parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    for bad in ("", "0", "101", "x"):
        with pytest.raises(BenchmarkError):
            parse_percentiles(bad)
    assert parse_metric_names("ttft,e2el") == ["ttft", "e2el"]
    with pytest.raises(BenchmarkError, match="choose from"):
        parse_metric_names("ttft,latency")


def test_arrival_offsets():
    assert arrival_offsets(5, float("inf"), 1.0, 0).tolist() == [0.0] * 5
    a = arrival_offsets(4000, 50.0, 1.0, seed=7)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    assert a.tolist() == arrival_offsets(4000, 50.0, 1.0, seed=7).tolist()
    assert np.diff(a).mean() == pytest.approx(1 / 50.0, rel=0.1)
    # burstiness < 1 spreads the gaps more than Poisson; > 1 less
    assert np.diff(arrival_offsets(4000, 50.0, 0.25, 7)).std() > np.diff(a).std()
    assert np.diff(arrival_offsets(4000, 50.0, 4.0, 7)).std() < np.diff(a).std()


def _events(chunks: list[dict], chat: bool = False) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\r\n\r\n" for c in chunks) + (
        b"data: [DONE]\r\n\r\n"
    )


def _feed(stream: bytes, piece: int, chat: bool = False) -> RequestRecord:
    record = RequestRecord(0, 3, 3)
    reader = StreamReader(record, chat, start=0.0)
    for n, pos in enumerate(range(0, len(stream), piece)):
        reader.feed(stream[pos : pos + piece], now=float(n + 1))
    reader.feed(b"\n", now=1e6)
    assert reader.complete
    record.generated_text = "".join(reader.texts)
    return record


@pytest.mark.parametrize("piece", [1, 7, 10_000])
def test_stream_reader_survives_any_split(piece):
    stream = _events(
        [
            {"choices": [{"index": 0, "text": "Hel"}]},
            {"choices": [{"index": 0, "text": ""}]},  # no text: still a token arrival
            {"choices": [{"index": 0, "text": "lo"}]},
            {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3}},
        ]
    )
    record = _feed(stream, piece)
    assert record.generated_text == "Hello!"
    assert (record.prompt_tokens, record.output_tokens, record.usage_reported) == (11, 3, True)
    assert record.ttft_s is not None and len(record.itl_s) == 3


def test_stream_reader_chat_counts_the_role_chunk_as_the_first_arrival():
    """As vLLM's client: the role-only chunk (sent with the first token) starts TTFT."""
    stream = _events(
        [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "A"}}]},
            {"choices": [{"index": 0, "delta": {"content": "B"}, "finish_reason": "stop"}]},
        ]
    )
    record = _feed(stream, piece=10_000_000, chat=True)
    assert record.generated_text == "AB" and len(record.itl_s) == 2
    assert not record.usage_reported


def test_stream_reader_errors():
    reader = StreamReader(RequestRecord(0, 1, 1), chat=False, start=0.0)
    with pytest.raises(StreamError, match="error in the stream: worker died"):
        reader.feed(b'data: {"error": {"message": "worker died"}}\n\n', now=1.0)
    reader = StreamReader(RequestRecord(0, 1, 1), chat=False, start=0.0)
    with pytest.raises(StreamError, match="invalid JSON"):
        reader.feed(b"data: {oops\n\n", now=1.0)

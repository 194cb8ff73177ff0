"""The streaming client of ``tokenmill bench serve``: one request, and a whole scheduled run.

Requests go to an OpenAI-compatible completions or chat-completions endpoint with
``stream: true`` and ``stream_options.include_usage``; the server-sent events are parsed as
they arrive, so TTFT and the gaps between chunks are what a client sees. A failing request
(an HTTP error, an error event, a dropped connection, a timeout) becomes a record with a
one-line error; the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from tokenmill.benchmarks.datasets import SampleRequest
from tokenmill.benchmarks.serve_metrics import RequestRecord

if TYPE_CHECKING:
    import aiohttp

# A request may legitimately stream for a long time under heavy load.
REQUEST_TIMEOUT_S = 6 * 3600
# Resends of a request whose pooled connection the server had closed (``_post``).
STALE_RETRIES = 8
# The longest error text kept per failed request.
MAX_ERROR_CHARS = 300
# NOTE: no proxies from the environment, as for the aiohttp session (trust_env=False): the
# benchmark talks to the server directly.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class ClientConfig:
    """How to talk to the server.

    Attributes:
        api_url: full URL of the endpoint.
        chat: the endpoint is chat completions (messages) rather than completions (prompt).
        model_name: the ``model`` field of each request.
        sampling: sampling fields added to each request (temperature, top_p, ignore_eos...).
        headers: HTTP headers (authorization).
        request_models: the ``model`` of request ``i`` (a LoRA adapter's name, ``bench serve
            --lora-modules``) for ``i`` below its length; ``model_name`` for the others.
    """

    api_url: str
    chat: bool
    model_name: str
    sampling: dict[str, Any]
    headers: dict[str, str]
    request_models: tuple[str, ...] = ()


def auth_headers() -> dict[str, str]:
    """JSON content type, and ``Authorization: Bearer $OPENAI_API_KEY`` when that is set."""
    headers = {"Content-Type": "application/json"}
    api_key = os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


class ServerUnreachable(Exception):
    """No HTTP answer from the server: connection refused, unknown host, timeout."""


class ServerUnauthorized(Exception):
    """The server answered 401 or 403: it wants an API key that was not sent or is wrong."""


def list_models(base_url: str, timeout_s: float = 10.0) -> list[dict[str, Any]] | None:
    """The server's ``/v1/models`` entries, or None if it answers without a model list.

    Raises:
        ServerUnreachable: the server did not answer over HTTP at all (the message says why).
        ServerUnauthorized: the server answered 401 or 403.
    """
    request = urllib.request.Request(f"{base_url}/v1/models", headers=auth_headers())
    try:
        with _DIRECT.open(request, timeout=timeout_s) as response:
            data = json.loads(response.read())
    except urllib.error.HTTPError as e:  # an answer, just not a model list
        if e.code in (401, 403):
            raise ServerUnauthorized(f"HTTP {e.code}") from None
        return None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ServerUnreachable(getattr(reason, "strerror", None) or str(reason)) from None
    except ValueError:
        return None
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return None
    return [e for e in entries if isinstance(e, dict) and "id" in e]


def wait_until_ready(base_url: str, timeout_s: float) -> bool:
    """Poll ``/v1/models`` until the server answers over HTTP (any status) or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with _DIRECT.open(f"{base_url}/v1/models", timeout=5):
                return True
        except urllib.error.HTTPError:
            return True
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    return False


# ---- one request -----------------------------------------------------------------------------


def build_payload(config: ClientConfig, sample: SampleRequest, index: int = 0) -> dict[str, Any]:
    """The JSON body of streaming request number ``index``."""
    models = config.request_models
    body: dict[str, Any] = {
        "model": models[index] if 0 <= index < len(models) else config.model_name,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.chat:
        content: Any = sample.prompt
        if sample.images:
            content = [
                *({"type": "image_url", "image_url": {"url": u}} for u in sample.images),
                {"type": "text", "text": sample.prompt},
            ]
        body["messages"] = [{"role": "user", "content": content}]
        # NOTE: both names: newer servers read max_completion_tokens, older only max_tokens.
        body["max_completion_tokens"] = sample.expected_output_len
        body["max_tokens"] = sample.expected_output_len
    else:
        body["prompt"] = sample.prompt
        body["max_tokens"] = sample.expected_output_len
    body.update(config.sampling)
    return body


def _error_text(body: str) -> str:
    """The message of an OpenAI-style error body, else the body itself."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict):
            message = error.get("message") or error.get("detail")
            if message:
                return str(message)
        elif isinstance(error, str):
            return error
        if "detail" in data:
            return str(data["detail"])
    return " ".join(body.split()) or "(empty body)"


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _has_choice(event: dict[str, Any]) -> bool:
    choices = event.get("choices")
    return bool(choices) and isinstance(choices[0], dict)


def _chunk_text(event: dict[str, Any], chat: bool) -> tuple[str, bool]:
    """The text a stream event carries and whether it ends a choice."""
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return "", False
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or ""
    else:
        text = choice.get("text") or ""
    return str(text), choice.get("finish_reason") is not None


class StreamError(Exception):
    """The server reported an error inside a stream, or sent something unreadable."""


class StreamReader:
    """Parses server-sent events (``data: {...}`` lines) into a RequestRecord."""

    def __init__(self, record: RequestRecord, chat: bool, start: float) -> None:
        self.record = record
        self.chat = chat
        self.start = start
        self.last_chunk = start
        self.texts: list[str] = []
        self.buffer = b""
        self.complete = False

    def feed(self, data: bytes, now: float) -> None:
        """Take the bytes of one network read, received at ``now`` (perf_counter s)."""
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        for raw in lines:
            line = raw.strip()
            if line.startswith(b"data:"):
                self._event(line[5:].strip(), now)

    def _event(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.complete = True
            return
        try:
            event = json.loads(payload)
        except ValueError:
            raise StreamError(f"invalid JSON in the stream: {payload[:100]!r}") from None
        if not isinstance(event, dict):
            return
        if event.get("error"):
            error = event["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise StreamError(f"error in the stream: {message}")
        usage = event.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.record.prompt_tokens = usage.get("prompt_tokens")
            self.record.output_tokens = usage.get("completion_tokens")
            self.record.usage_reported = True
        if not _has_choice(event):
            return
        # Every chunk of a choice is a token arrival, with text or not (a token whose text
        # the detokenizer holds back, a special token): vLLM's client counts them alike.
        if self.record.ttft_s is None:
            self.record.ttft_s = now - self.start
        else:
            self.record.itl_s.append(now - self.last_chunk)
        self.last_chunk = now
        text, finished = _chunk_text(event, self.chat)
        self.complete |= finished
        if text:
            self.texts.append(text)


async def send_request(
    session: aiohttp.ClientSession,
    config: ClientConfig,
    sample: SampleRequest,
    index: int,
    bench_start: float,
) -> RequestRecord:
    """Send one streaming request and record its timings; never raises (but on cancel)."""
    record = RequestRecord(index, sample.prompt_len, sample.expected_output_len)
    start = time.perf_counter()
    record.start_s = start - bench_start
    reader = StreamReader(record, config.chat, start)
    try:
        async with await _post(session, config, sample, index) as response:
            if response.status != 200:
                body = await response.text(errors="replace")
                record.error = _one_line(f"HTTP {response.status}: {_error_text(body)}")
            else:
                async for data in response.content.iter_any():
                    reader.feed(data, time.perf_counter())
                reader.feed(b"\n", time.perf_counter())
                if not reader.complete:
                    record.error = "the stream ended before the response was complete"
    except StreamError as e:
        record.error = _one_line(str(e))
    except asyncio.TimeoutError:
        record.error = f"no complete response within {REQUEST_TIMEOUT_S} s"
    except Exception as e:  # one request's failure must not end the run
        record.error = _one_line(f"{type(e).__name__}: {e}")
    record.latency_s = time.perf_counter() - start
    record.generated_text = "".join(reader.texts)
    record.success = record.error is None
    if record.success and record.ttft_s is None:
        record.ttft_s = record.latency_s  # a response without text: first = last byte
    return record


async def _post(
    session: aiohttp.ClientSession, config: ClientConfig, sample: SampleRequest, index: int
) -> aiohttp.ClientResponse:
    """POST the request; sent again (up to ``STALE_RETRIES`` times) when a pooled keep-alive
    connection turns out to be closed by the server before the request was written
    (llama.cpp's server closes a connection after a few requests): that request never
    reached the server, so resending it is safe, and each failure drops one stale
    connection from the pool."""
    import aiohttp

    payload = build_payload(config, sample, index)
    for attempt in range(STALE_RETRIES + 1):
        try:
            return await session.post(config.api_url, json=payload, headers=config.headers)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as e:
            stale = isinstance(e, aiohttp.ServerDisconnectedError) or (
                "write request body" in str(e)
            )
            if not stale or attempt == STALE_RETRIES:
                raise
    raise AssertionError("unreachable")  # the loop returns or raises


# ---- the run ---------------------------------------------------------------------------------


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times (s after the start) of ``num`` requests.

    Gaps are gamma-distributed with shape ``burstiness`` and mean ``1 / request_rate``: shape
    1 is a Poisson process; ``request_rate = inf`` sends everything at time 0.

    Returns:
        float64 array of shape [num], non-decreasing, starting at 0.
    """
    if request_rate == float("inf"):
        return np.zeros(num)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def run_benchmark(
    config: ClientConfig,
    samples: list[SampleRequest],
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    num_warmups: int = 0,
    show_progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send all ``samples`` on their schedule and wait for every answer.

    Returns:
        One record per sample (in workload order) and the run's wall time (s).
    """
    import aiohttp

    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if num_warmups > 0:
            warm = [samples[i % len(samples)] for i in range(num_warmups)]
            await asyncio.gather(
                *(send_request(session, config, s, -1, time.perf_counter()) for s in warm)
            )
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(samples), disable=not show_progress, desc="Requests")

        async def one(index: int, sample: SampleRequest, start: float) -> RequestRecord:
            if limit is None:
                record = await send_request(session, config, sample, index, start)
            else:
                async with limit:
                    record = await send_request(session, config, sample, index, start)
            bar.update(1)
            return record

        offsets = arrival_offsets(len(samples), request_rate, burstiness, seed)
        start = time.perf_counter()
        tasks = []
        for index, (sample, offset) in enumerate(zip(samples, offsets, strict=True)):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index, sample, start)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(records), duration

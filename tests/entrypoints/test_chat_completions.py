"""Chat completions against the real default model (SmolLM2-135M-Instruct), via the openai SDK
and raw HTTP: answers, usage, streaming equivalence, stop strings, logprobs."""

from __future__ import annotations

import json
import math

import httpx
import pytest

pytestmark = pytest.mark.slow

# Greedy answers to this keep a clear margin between the top two tokens (>= 0.9 in log
# probability over the first eight) on CPUs whose bfloat16 kernels round differently.
PARIS = [{"role": "user", "content": "Name the capital of France."}]
MODEL = "SmolLM2-135M-Instruct"


def sse_events(server, path: str, body: dict) -> list[dict | str]:
    """POST with stream=true; the decoded `data:` events (``"[DONE]"`` kept as a string)."""
    events: list[dict | str] = []
    with httpx.stream(
        "POST", server.url + path, json=body, headers=server.headers, timeout=120.0
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_models_lists_the_default_model(default_server):
    models = default_server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_paris_with_usage_and_stream_equals_non_stream(default_server):
    client = default_server.openai()
    result = client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=32
    )
    text = result.choices[0].message.content
    assert "Paris" in text
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].finish_reason in ("stop", "length")
    tokens = default_server.post("/tokenize", {"messages": PARIS}).json()
    usage = result.usage
    assert usage.prompt_tokens == tokens["count"]
    assert 0 < usage.completion_tokens <= 32
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    stream = client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=32, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].choices[0].finish_reason == result.choices[0].finish_reason


def test_usage_in_stream_only_with_include_usage(default_server):
    body = {"messages": PARIS, "temperature": 0, "max_tokens": 8, "stream": True}
    plain = sse_events(default_server, "/v1/chat/completions", body)
    assert plain[-1] == "[DONE]"
    assert all(e.get("usage") is None for e in plain[:-1])
    assert all(e["choices"] for e in plain[:-1])

    with_usage = sse_events(
        default_server,
        "/v1/chat/completions",
        {**body, "stream_options": {"include_usage": True}},
    )
    assert with_usage[-1] == "[DONE]"
    *chunks, last = with_usage[:-1]
    assert all(c["usage"] is None for c in chunks)
    assert last["choices"] == []
    generated = sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))
    assert last["usage"]["completion_tokens"] >= generated > 0
    assert last["usage"]["total_tokens"] == (
        last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]
    )


def test_continuous_usage_counts_each_choice_on_its_own(default_server):
    """With continuous_usage_stats every chunk carries its own choice's counts (its prompt's
    tokens, its tokens so far), as vLLM reports them; the final chunk the request's totals."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = {"messages": PARIS, "max_tokens": 3, "n": 2, "seed": 1, "ignore_eos": True}
    completions = {"prompt": ["a", "b c d e"], "max_tokens": 3, "n": 2, "ignore_eos": True}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completions)):
        events = sse_events(
            default_server, path, {**body, "stream": True, "stream_options": options}
        )
        *chunks, last = [e for e in events if e != "[DONE]"]
        counts: dict[int, int] = {}
        prompts: dict[int, int] = {}
        for chunk in chunks:
            [choice] = chunk["choices"]
            usage = chunk["usage"]
            counts[choice["index"]] = usage["completion_tokens"]
            prompts.setdefault(choice["index"], usage["prompt_tokens"])
            assert usage["prompt_tokens"] == prompts[choice["index"]]
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        num_choices = 2 if path.endswith("chat/completions") else 4
        assert counts == {i: 3 for i in range(num_choices)}
        assert last["choices"] == []
        assert last["usage"]["completion_tokens"] == 3 * num_choices
        if path == "/v1/completions":  # choices 0-1 are the first prompt's, 2-3 the second's
            assert prompts[0] == prompts[1] < prompts[2] == prompts[3]
            assert last["usage"]["prompt_tokens"] == prompts[0] + prompts[2]


def test_n_choices_stream_interleaved_by_index(default_server):
    body = {
        "messages": PARIS,
        "temperature": 0.8,
        "seed": 7,
        "max_tokens": 6,
        "n": 3,
        "stream": True,
    }
    events = sse_events(default_server, "/v1/chat/completions", body)
    texts = {i: "" for i in range(3)}
    finished = set()
    roles = set()
    for event in events[:-1]:
        for choice in event["choices"]:
            if choice["delta"].get("role"):
                roles.add(choice["index"])
            texts[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                finished.add(choice["index"])
    assert roles == finished == {0, 1, 2}
    full = default_server.post("/v1/chat/completions", {**body, "stream": False}).json()
    assert {c["index"]: c["message"]["content"] for c in full["choices"]} == texts


def _greedy_tokens(server) -> tuple[str, list[str]]:
    result = server.post(
        "/v1/chat/completions",
        {
            "messages": PARIS,
            "temperature": 0,
            "max_tokens": 16,
            "logprobs": True,
        },
    ).json()
    choice = result["choices"][0]
    return choice["message"]["content"], [t["token"] for t in choice["logprobs"]["content"]]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(default_server, stream, include):
    """Regression: a stop string spanning a token boundary ends the answer exactly there,
    streamed or not; no stop text leaks and no text before it is lost."""
    text, tokens = _greedy_tokens(default_server)
    # The stop string takes the tail of token 1 and the head of token 2 (e.g. "al o").
    boundary = len(tokens[0]) + len(tokens[1])
    assert text.startswith("".join(tokens[:3]))
    stop = text[boundary - 2 : boundary + 2]
    assert len(tokens[1]) >= 2 and len(tokens[2]) >= 2 and text.find(stop) == boundary - 2
    expected = text[: boundary - 2] + (stop if include else "")
    body = {
        "messages": PARIS,
        "temperature": 0,
        "max_tokens": 16,
        "stop": [stop],
        "include_stop_str_in_output": include,
    }
    if stream:
        events = sse_events(default_server, "/v1/chat/completions", {**body, "stream": True})
        choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
        got = "".join(c["delta"].get("content") or "" for c in choices)
        final = choices[-1]
    else:
        final = default_server.post("/v1/chat/completions", body).json()["choices"][0]
        got = final["message"]["content"]
    assert got == expected
    assert final["finish_reason"] == "stop"
    assert final["stop_reason"] == stop


def _assert_finite(value):
    assert isinstance(value, float | int) and math.isfinite(value), value


def test_chat_logprobs_schema(default_server):
    client = default_server.openai()
    result = client.chat.completions.create(
        model=MODEL,
        messages=PARIS,
        temperature=0,
        max_tokens=10,
        logprobs=True,
        top_logprobs=5,
    )
    choice = result.choices[0]
    content = choice.logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        _assert_finite(entry.logprob)
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 5
        top = [t.logprob for t in entry.top_logprobs]
        assert top == sorted(top, reverse=True)
        for alt in entry.top_logprobs:
            _assert_finite(alt.logprob)
            assert all(0 <= b < 256 for b in alt.bytes)
        # Greedy decoding picks the most likely token.
        assert entry.token == entry.top_logprobs[0].token
    # The bytes of the tokens rebuild the text exactly (the EOS token is not in the text).
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8")
    assert joined.startswith(choice.message.content)

    raw = default_server.post(
        "/v1/chat/completions",
        {
            "messages": PARIS,
            "temperature": 0,
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 0,
            "stream": True,
        },
    )
    for line in raw.text.splitlines():
        if line.startswith("data: {"):
            assert "Infinity" not in line and "NaN" not in line
            event = json.loads(line[6:])
            for c in event["choices"]:
                for entry in (c["logprobs"] or {}).get("content") or []:
                    _assert_finite(entry["logprob"])
                    assert entry["top_logprobs"] == []


def test_generation_config_defaults_and_max_completion_tokens(default_server):
    body = {"messages": PARIS, "temperature": 0, "max_tokens": 30, "max_completion_tokens": 3}
    result = default_server.post("/v1/chat/completions", body).json()
    assert result["usage"]["completion_tokens"] == 3
    assert result["choices"][0]["finish_reason"] == "length"
    # Without either limit the answer may run to the end of the context: it ends on EOS.
    free = default_server.post("/v1/chat/completions", {"messages": PARIS, "temperature": 0})
    assert free.json()["choices"][0]["finish_reason"] == "stop"


def test_content_parts_and_system_message(default_server):
    parts = [
        {"role": "system", "content": "Answer briefly."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": "of France?"},
            ],
        },
    ]
    result = default_server.post(
        "/v1/chat/completions",
        {
            "messages": parts,
            "temperature": 0,
            "max_tokens": 16,
        },
    )
    assert result.status_code == 200, result.text
    assert result.json()["choices"][0]["message"]["content"]


def test_chat_prompt_logprobs_and_best_of(default_server):
    """vLLM's chat extras: prompt_logprobs at the response's top level (one entry per
    rendered prompt token, the first None) and best_of; neither with stream."""
    body = {"messages": PARIS, "temperature": 0, "max_tokens": 2, "prompt_logprobs": 1}
    result = default_server.post("/v1/chat/completions", body).json()
    entries = result["prompt_logprobs"]
    assert len(entries) == result["usage"]["prompt_tokens"] and entries[0] is None
    assert all(1 <= len(e) <= 2 for e in entries[1:])
    plain = default_server.post("/v1/chat/completions", {**body, "prompt_logprobs": None}).json()
    assert plain.get("prompt_logprobs") is None
    assert plain["choices"][0]["message"] == result["choices"][0]["message"]

    best = {"messages": PARIS, "temperature": 1.0, "max_tokens": 3, "n": 2, "best_of": 3}
    assert len(default_server.post("/v1/chat/completions", best).json()["choices"]) == 2
    streamed = [({"best_of": 3, "n": 1}, "best_of"), ({"prompt_logprobs": 1}, "prompt_logprobs")]
    for extra, param in streamed:
        response = default_server.post(
            "/v1/chat/completions", {"messages": PARIS, "stream": True, **extra}
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == param

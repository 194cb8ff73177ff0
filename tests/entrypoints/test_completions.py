"""Legacy completions against the real default model: echo, logprobs, several prompts,
streaming, and a stream of emoji / CJK text that never carries a broken character."""

from __future__ import annotations

import math

import pytest

from tests.entrypoints.test_chat_completions import MODEL, sse_events

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def test_completion_usage_and_stream_equivalence(default_server):
    client = default_server.openai()
    result = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8)
    choice = result.choices[0]
    assert choice.finish_reason in ("stop", "length")
    tokens = default_server.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    assert result.usage.prompt_tokens == len(tokens)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == choice.text


def test_default_max_tokens_is_16(default_server):
    result = default_server.post(
        "/v1/completions",
        {
            "prompt": PROMPT,
            "temperature": 0,
            "ignore_eos": True,
        },
    ).json()
    assert result["usage"]["completion_tokens"] == 16


def test_echo_with_logprobs(default_server):
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 4, "echo": True, "logprobs": 2}
    result = default_server.post("/v1/completions", body).json()
    choice = result["choices"][0]
    assert choice["text"].startswith(PROMPT)
    logprobs = choice["logprobs"]
    num_tokens = result["usage"]["prompt_tokens"] + result["usage"]["completion_tokens"]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert len(logprobs[name]) == num_tokens, name
    # The first prompt token has nothing before it, hence no logprob.
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for value, top in zip(
        logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True
    ):
        assert math.isfinite(value) and value <= 0
        assert 1 <= len(top) <= 3 and all(math.isfinite(v) for v in top.values())
    # text_offset indexes the choice's text.
    assert "".join(logprobs["tokens"]) == choice["text"]
    for offset, token in zip(logprobs["text_offset"], logprobs["tokens"], strict=True):
        assert choice["text"][offset : offset + len(token)] == token

    events = sse_events(default_server, "/v1/completions", {**body, "stream": True})
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert chunks[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in chunks) == choice["text"]
    streamed_tokens = [t for c in chunks for t in (c["logprobs"] or {}).get("tokens", [])]
    assert streamed_tokens == logprobs["tokens"]
    streamed_offsets = [o for c in chunks for o in (c["logprobs"] or {}).get("text_offset", [])]
    assert streamed_offsets == logprobs["text_offset"]


def test_echo_with_logprobs_of_a_one_token_prompt(default_server):
    ids = default_server.post("/tokenize", {"prompt": "Hi", "add_special_tokens": False})
    [token] = ids.json()["tokens"]
    body = {"prompt": [token], "temperature": 0, "max_tokens": 2, "echo": True, "logprobs": 1}
    choice = default_server.post("/v1/completions", body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == 3 and logprobs["tokens"][0] == "Hi"
    assert logprobs["token_logprobs"][0] is None and logprobs["text_offset"][:2] == [0, 2]
    assert "".join(logprobs["tokens"]) == choice["text"]


def test_echo_offsets_do_not_overlap_after_a_split_character(default_server):
    """A character split over tokens (an emoji: three tokens, each decoding to a replacement
    character alone) makes the prompt tokens' texts longer than the prompt; the generated
    tokens' offsets go on from them, streamed or not."""
    ids = default_server.post("/tokenize", {"prompt": "Héllo 🌍 w",
                                            "add_special_tokens": False}).json()["tokens"]
    body = {"prompt": ids, "temperature": 0, "max_tokens": 3, "echo": True, "logprobs": 0}
    logprobs = default_server.post("/v1/completions", body).json()["choices"][0]["logprobs"]
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    for i in range(1, len(tokens)):
        assert offsets[i] == offsets[i - 1] + len(tokens[i - 1]), (tokens, offsets)
    events = sse_events(default_server, "/v1/completions", {**body, "stream": True})
    streamed = [o for e in events[:-1] if e["choices"]
                for o in (e["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert streamed == offsets


def test_prompt_logprobs(default_server):
    ids = default_server.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 2, "prompt_logprobs": 1}
    choice = default_server.post("/v1/completions", body).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token_id) in entry and 1 <= len(entry) <= 2
        chosen = entry[str(token_id)]
        assert math.isfinite(chosen["logprob"]) and chosen["logprob"] <= 0 and chosen["rank"] >= 1
    events = sse_events(default_server, "/v1/completions", {**body, "stream": True})
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert chunks[0]["prompt_logprobs"] == entries
    assert all("prompt_logprobs" not in c for c in chunks[1:])


def test_prompt_logprobs_of_a_cached_prompt(default_server):
    # The second request's prompt is in the prefix cache: its logprobs must still cover
    # every position, as if the cache were cold.
    prompt = "A long shared prefix about the history of the river city. " * 6
    body = {"prompt": prompt, "temperature": 0, "max_tokens": 1, "prompt_logprobs": 0}
    default_server.post("/v1/completions", {**body, "prompt_logprobs": None})
    choice = default_server.post("/v1/completions", body).json()["choices"][0]
    assert choice["prompt_logprobs"][0] is None
    assert all(entry is not None for entry in choice["prompt_logprobs"][1:])
    echo = {**body, "prompt_logprobs": None, "echo": True, "logprobs": 0}
    echoed = default_server.post("/v1/completions", echo).json()["choices"][0]
    assert all(v is not None for v in echoed["logprobs"]["token_logprobs"][1:])


def test_echo_uses_an_explicit_prompt_logprobs(default_server):
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 1, "echo": True, "logprobs": 1}
    choice = default_server.post("/v1/completions", {**body, "prompt_logprobs": 3}).json()
    entries = choice["choices"][0]["prompt_logprobs"]
    assert all(3 <= len(entry) <= 4 for entry in entries[1:])
    bad = default_server.post("/v1/completions", {**body, "prompt_logprobs": 1000})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_several_prompts_and_token_id_prompts(default_server):
    ids = default_server.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    body = {"prompt": [PROMPT, "Once upon a time"], "temperature": 0, "max_tokens": 5, "n": 2}
    result = default_server.post("/v1/completions", body).json()
    assert [c["index"] for c in result["choices"]] == [0, 1, 2, 3]
    by_ids = default_server.post(
        "/v1/completions",
        {
            "prompt": ids,
            "temperature": 0,
            "max_tokens": 5,
        },
    ).json()
    assert by_ids["choices"][0]["text"] == result["choices"][0]["text"]
    assert result["choices"][0]["text"] == result["choices"][1]["text"]  # greedy: n alike

    events = sse_events(default_server, "/v1/completions", {**body, "stream": True})
    texts = ["", "", "", ""]
    for event in events[:-1]:
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in result["choices"]]


def _whole_characters(token_bytes: list[bytes]) -> int:
    """The most leading tokens whose bytes decode to whole UTF-8 characters."""
    best = 0
    for k in range(1, len(token_bytes) + 1):
        try:
            b"".join(token_bytes[:k]).decode("utf-8")
            best = k
        except UnicodeDecodeError:
            pass
    return best


@pytest.mark.parametrize(
    "prompt",
    [
        "😀😃😄😁😆😅🤣😂🙂🙃😉😊😇🥰😍",
        "東京は日本の首都です。大阪は",
    ],
)
def test_emoji_and_cjk_stream_never_breaks_a_character(default_server, prompt):
    """Regression: multi-byte characters split over several tokens reach the client whole."""
    probe = default_server.post(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": 16,
            "logprobs": True,
        },
    ).json()
    content = probe["choices"][0]["logprobs"]["content"]
    token_bytes = [bytes(e["bytes"]) for e in content]
    # End on a whole character so that no truncation at max_tokens is involved.
    k = _whole_characters(token_bytes)
    assert k > 0
    split = [b for b in token_bytes[:k] if _broken(b)]
    assert split, "the answer should contain characters spread over several tokens"
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": k,
        "stream": True,
    }
    events = sse_events(default_server, "/v1/chat/completions", body)
    pieces = [e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]]
    for piece in pieces:
        assert "\ufffd" not in piece
    expected = b"".join(token_bytes[:k]).decode("utf-8")
    text = "".join(pieces)
    if events[-2]["choices"][0]["finish_reason"] == "stop":
        expected = expected.split("<|im_end|>")[0]
    assert text == expected
    assert any(ord(ch) > 0x2E80 for ch in text)


def _broken(token: bytes) -> bool:
    try:
        token.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_allowed_token_ids_limit_what_is_sampled(default_server):
    words = {"prompt": " Paris Lyon", "add_special_tokens": False}
    allowed = default_server.post("/tokenize", words).json()["tokens"]
    texts = {default_server.post("/detokenize", {"tokens": [t]}).json()["prompt"] for t in allowed}
    body = {
        "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 0, "ignore_eos": True,
        "allowed_token_ids": allowed, "logprobs": 1,
    }  # fmt: skip
    result = default_server.post("/v1/completions", body).json()
    tokens = result["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 and set(tokens) <= texts, (tokens, texts)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(default_server):
    prompt = "one two three four five six seven eight nine ten"
    ids = default_server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 1, "echo": True, "truncate_prompt_tokens": 4}
    result = default_server.post("/v1/completions", body).json()
    assert result["usage"]["prompt_tokens"] == 4
    tail = default_server.post("/detokenize", {"tokens": ids[-4:]}).json()["prompt"]
    assert result["choices"][0]["text"].startswith(tail)
    # Shorter prompts, and -1, keep every token.
    for k in (len(ids), -1):
        body = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": k}
        result = default_server.post("/v1/completions", body).json()
        assert result["usage"]["prompt_tokens"] == len(ids)


def test_truncate_prompt_tokens_minus_one_leaves_room_for_max_tokens(default_server):
    max_len = default_server.get("/v1/models").json()["data"][0]["max_model_len"]
    body = {"prompt": [100] * (max_len + 10), "max_tokens": 16, "truncate_prompt_tokens": -1}
    result = default_server.post("/v1/completions", body).json()
    assert result["usage"]["prompt_tokens"] == max_len - 16, result


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_the_request_log_shows_the_truncation_asked_for(default_server, route):
    """The server cuts the prompt before the engine sees it; the request's log line still
    shows the truncation the request asked for (as vLLM's does)."""
    seed = 7_000_001 if route == "/v1/completions" else 7_000_002  # finds the request's line
    body = {"max_tokens": 1, "seed": seed, "truncate_prompt_tokens": 4}
    if route == "/v1/completions":
        body["prompt"] = "one two three four five six seven eight nine ten"
    else:
        body["messages"] = [{"role": "user", "content": "one two three four five six"}]
    result = default_server.post(route, body).json()
    assert result["usage"]["prompt_tokens"] == 4, result
    [line] = [ln for ln in default_server.log_text(1_000_000).splitlines()
              if "Received request" in ln and f"seed={seed}," in ln]
    assert "truncate_prompt_tokens=4" in line, line


def test_bad_words_are_never_generated(default_server):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0}
    first = default_server.post("/v1/completions", body).json()["choices"][0]
    word = first["logprobs"]["tokens"][0].strip()  # the greedy first word, e.g. "Paris"
    again = default_server.post("/v1/completions", {**body, "bad_words": [word]}).json()
    tokens = again["choices"][0]["logprobs"]["tokens"]
    assert word not in [t.strip() for t in tokens], (word, tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_zero_scores_the_prompt(default_server, stream):
    """OpenAI's and vLLM's legacy way to score a prompt: the echoed prompt with its
    logprobs, nothing generated; max_tokens 0 without echo stays a 400."""
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    ids = default_server.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    if stream:
        events = sse_events(default_server, "/v1/completions", {**body, "stream": True})
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
        assert "".join(c["text"] for c in chunks) == PROMPT
        logprobs = chunks[0]["logprobs"]
        assert chunks[-1]["finish_reason"] == "length"
    else:
        result = default_server.post("/v1/completions", body).json()
        choice = result["choices"][0]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        assert result["usage"]["completion_tokens"] == 0
        logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
    assert all(math.isfinite(v) and v <= 0 for v in logprobs["token_logprobs"][1:])
    plain = default_server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "max_tokens"
    assert "only with echo" in plain.json()["error"]["message"]

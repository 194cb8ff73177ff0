"""Malformed and invalid requests: each gets the right status and OpenAI's error body, and the
server keeps serving."""

from __future__ import annotations

import json
import math

import httpx
import pytest

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# (name, path, body (dict, or raw bytes), expected status, expected `param` or None to skip,
#  a word the message must contain)
CASES = [
    ("malformed json", CHAT, b'{"messages": [', 400, None, "JSON"),
    (
        "chat_template_kwargs overriding the rendering",
        CHAT,
        {"messages": MSG, "chat_template_kwargs": {"tokenize": True, "conversation": []}},
        400,
        "chat_template_kwargs",
        "conversation, tokenize",
    ),
    (
        "chat_template_kwargs naming the messages",
        CHAT,
        {"messages": MSG, "chat_template_kwargs": {"messages": [], "self": 1}},
        400,
        "chat_template_kwargs",
        "messages, self",
    ),
    ("empty body", CHAT, b"", 400, None, "body"),
    ("body is a list", CHAT, b"[1, 2]", 400, None, "object"),
    ("missing messages", CHAT, {"model": "SmolLM2-135M-Instruct"}, 400, "messages", "messages"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages", "messages"),
    ("messages not a list", CHAT, {"messages": "Hi"}, 400, "messages", "list"),
    (
        "unknown role",
        CHAT,
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
        "role",
    ),
    (
        "message without role",
        CHAT,
        {"messages": [{"content": "x"}]},
        400,
        "messages.0.role",
        "role",
    ),
    (
        "content of the wrong type",
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages.0.content",
        "content",
    ),
    (
        "user message without content",
        CHAT,
        {"messages": [{"role": "user"}]},
        400,
        "messages.0.content",
        "content",
    ),
    (
        "image content part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages.0.content.0.image_url",  # a text-only model: the part is named
        "image_url",
    ),
    (
        "temperature is a string",
        CHAT,
        {"messages": MSG, "temperature": "hot"},
        400,
        "temperature",
        "number",
    ),
    (
        "max_tokens is a string",
        CHAT,
        {"messages": MSG, "max_tokens": "10"},
        400,
        "max_tokens",
        "integer",
    ),
    (
        "negative max_tokens",
        CHAT,
        {"messages": MSG, "max_tokens": -1},
        400,
        "max_tokens",
        "max_tokens",
    ),
    (
        "zero max_completion_tokens",
        CHAT,
        {"messages": MSG, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",  # the field the client sent
        "max_completion_tokens",
    ),
    (
        "negative temperature",
        CHAT,
        {"messages": MSG, "temperature": -0.5},
        400,
        "temperature",
        "temperature",
    ),
    ("NaN temperature", CHAT, json.dumps({"messages": MSG, "temperature": math.nan}).encode(),
     400, "temperature", "temperature must be a finite number"),  # fmt: skip
    ("top_p zero", CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p", "top_p"),
    ("top_p above one", CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p", "top_p"),
    ("n zero", CHAT, {"messages": MSG, "n": 0}, 400, "n", "n must"),
    # Each of n copies is an engine request: 2**70 took the server down (out of memory).
    ("n huge", COMPLETIONS, {"prompt": "Hi", "max_tokens": 1, "n": 2**70}, 400, "n", "n must"),
    (
        "text part without text",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        400,
        "messages.0.content",
        "needs its 'text'",
    ),
    (
        "allowed_token_ids out of the vocabulary",
        COMPLETIONS,
        {"prompt": "Hi", "max_tokens": 1, "allowed_token_ids": [10**9]},
        400,
        "allowed_token_ids",
        "out of the vocabulary",
    ),
    (
        "allowed_token_ids empty",
        CHAT,
        {"messages": MSG, "allowed_token_ids": []},
        400,
        "allowed_token_ids",
        "must not be empty",
    ),
    (
        "truncate_prompt_tokens zero",
        CHAT,
        {"messages": MSG, "truncate_prompt_tokens": 0},
        400,
        "truncate_prompt_tokens",
        "between 1 and",
    ),
    (
        "truncate_prompt_tokens past the context",
        COMPLETIONS,
        {"prompt": "Hi", "truncate_prompt_tokens": 10**6},
        400,
        "truncate_prompt_tokens",
        "between 1 and",
    ),
    (
        "min_tokens with only stop tokens allowed",
        COMPLETIONS,
        {"prompt": "Hi", "max_tokens": 5, "min_tokens": 3, "allowed_token_ids": [2]},
        400,
        "allowed_token_ids",
        "no token could be sampled",
    ),
    (
        "tool_choice without tools",
        CHAT,
        {"messages": MSG, "tool_choice": "required"},
        400,
        "tool_choice",
        "needs tools",
    ),
    (
        "legacy functions",
        CHAT,
        {"messages": MSG, "functions": [{"name": "f", "parameters": {}}]},
        400,
        "functions",
        "use tools and tool_choice",
    ),
    (
        "a chat template in the request (was ignored)",
        CHAT,
        {"messages": MSG, "chat_template": "{{ raise_exception('boom') }}"},
        400,
        "chat_template",
        "not accepted",
    ),
    (
        "chat echo (was ignored)",
        CHAT,
        {"messages": MSG, "echo": True},
        400,
        "echo",
        "does not implement echo",
    ),
    (
        "tool_choice not a choice",
        CHAT,
        {"messages": MSG, "tool_choice": False},
        400,
        "tool_choice",
        "must be 'none', 'auto', 'required' or a function",
    ),
    (
        "bad_words too many",
        COMPLETIONS,
        {"prompt": "Hi", "max_tokens": 1, "bad_words": ["w"] * 1025},
        400,
        "bad_words",
        "at most 1024 words",
    ),
    (
        "allowed tokens all bad words",
        COMPLETIONS,
        {"prompt": "Hi", "max_tokens": 1, "allowed_token_ids": [7042], "bad_words": ["Paris"]},
        400,
        "allowed_token_ids",
        "no token could be sampled",
    ),
    (
        "use_beam_search with stream",
        COMPLETIONS,
        {"prompt": "Hi", "use_beam_search": True, "stream": True},
        400,
        "stream",
        "cannot be used with stream",
    ),
    (
        "use_beam_search with logprobs",
        CHAT,
        {"messages": MSG, "use_beam_search": True, "logprobs": True},
        400,
        "logprobs",
        "cannot be used with use_beam_search",
    ),
    (
        "use_beam_search with tools",
        CHAT,
        {
            "messages": MSG,
            "use_beam_search": True,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        },
        400,
        "tools",
        "cannot be used with use_beam_search",
    ),
    (
        "use_beam_search with stop",
        COMPLETIONS,
        {"prompt": "Hi", "use_beam_search": True, "stop": ["."]},
        400,
        "stop",
        "cannot be used with use_beam_search",
    ),
    (
        "use_beam_search early_stopping",
        COMPLETIONS,
        {"prompt": "Hi", "use_beam_search": True, "early_stopping": "sometimes"},
        400,
        "early_stopping",
        "",
    ),
    (
        "return_tokens_as_token_ids",
        CHAT,
        {"messages": MSG, "return_tokens_as_token_ids": True},
        400,
        "return_tokens_as_token_ids",
        "does not implement",
    ),
    (
        "prompt_embeds",
        COMPLETIONS,
        {"prompt": "Hi", "prompt_embeds": "AAAA"},
        400,
        "prompt_embeds",
        "does not implement",
    ),
    (
        "bad_words blank",
        CHAT,
        {"messages": MSG, "bad_words": ["x", " "]},
        400,
        "bad_words",
        "non-blank strings",
    ),
    # Structured outputs: a constraint that cannot be served is refused with its field.
    (
        "guided_json invalid schema",
        COMPLETIONS,
        {"prompt": "Hi", "max_tokens": 1, "guided_json": {"type": "nonsense"}},
        400,
        "guided_json",
        "invalid JSON schema",
    ),
    (
        "response_format without a type",
        CHAT,
        {"messages": MSG, "response_format": {}},
        400,
        "response_format",
        "type",
    ),
    (
        "min_tokens when echo scores the prompt (max_tokens 0)",
        COMPLETIONS,
        {"prompt": "hello world", "max_tokens": 0, "echo": True, "min_tokens": 3},
        400,
        "min_tokens",
        "max_tokens 0",
    ),
    (
        "response_format unknown type",
        CHAT,
        {"messages": MSG, "response_format": {"type": "xml"}},
        400,
        "response_format",
        "json_schema",
    ),
    (
        "response_format json_schema without schema",
        CHAT,
        {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {}}},
        400,
        "response_format",
        "json_schema.schema",
    ),
    (
        "two output constraints",
        CHAT,
        {"messages": MSG, "guided_regex": "a+", "response_format": {"type": "json_object"}},
        400,
        "guided_regex",
        "not several",
    ),
    (
        "structured_outputs with two constraints",
        COMPLETIONS,
        {"prompt": "Hi", "structured_outputs": {"regex": "a+", "choice": ["a"]}},
        400,
        "structured_outputs",
        "exactly one",
    ),
    (
        "structured_outputs unknown key",
        COMPLETIONS,
        {"prompt": "Hi", "structured_outputs": {"xml": "<a/>"}},
        400,
        "structured_outputs",
        "unknown keys",
    ),
    (
        "guided_regex invalid",
        COMPLETIONS,
        {"prompt": "Hi", "guided_regex": "(unclosed"},
        400,
        "guided_regex",
        "invalid regular expression",
    ),
    (
        "allowed_token_ids with a constraint",
        COMPLETIONS,
        {"prompt": "Hi", "guided_choice": ["yes", "no"], "allowed_token_ids": [100, 101]},
        400,
        "allowed_token_ids",
        "cannot be combined",
    ),
    (
        "schema keyword xgrammar would not enforce",
        CHAT,
        {"messages": MSG, "guided_json": {"type": "array", "uniqueItems": True}},
        400,
        "guided_json",
        "'uniqueItems' is not supported",
    ),
    (
        "too many choices",
        COMPLETIONS,
        {"prompt": "Hi", "guided_choice": [f"o{i}" for i in range(300)]},
        400,
        "guided_choice",
        "at most 256",
    ),
    (
        "guided_regex of the wrong type",
        COMPLETIONS,
        {"prompt": "Hi", "guided_regex": 5},
        400,
        "guided_regex",
        "guided_regex has the wrong type",
    ),
    (
        "guided_choice empty",
        COMPLETIONS,
        {"prompt": "Hi", "guided_choice": []},
        400,
        "guided_choice",
        "choice",
    ),
    (
        "too many top_logprobs",
        CHAT,
        {"messages": MSG, "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs",
        "top_logprobs",
    ),
    (
        "top_logprobs without logprobs",
        CHAT,
        {"messages": MSG, "top_logprobs": 3},
        400,
        "top_logprobs",
        "logprobs",
    ),
    (
        "presence_penalty out of range",
        CHAT,
        {"messages": MSG, "presence_penalty": 3},
        400,
        "presence_penalty",
        "presence_penalty",
    ),
    (
        "logit_bias key not a token id",
        CHAT,
        {"messages": MSG, "logit_bias": {"x": 1}},
        400,
        "logit_bias",
        "logit_bias",
    ),
    (
        "logit_bias token out of vocabulary",
        CHAT,
        {"messages": MSG, "logit_bias": {"999999": 1}},
        400,
        "logit_bias",
        "vocabulary",
    ),
    (
        "stream_options without stream",
        CHAT,
        {"messages": MSG, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "stream",
    ),
    ("context overflow", CHAT, {"messages": MSG, "max_tokens": 4000}, 400, "max_tokens", "2048"),
    ("unknown model", CHAT, {"messages": MSG, "model": "gpt-4o"}, 404, "model", "gpt-4o"),
    (
        "a tool without its function",
        CHAT,
        {"messages": MSG, "tools": [{"type": "function"}]},
        400,
        "tools.0.function",
        "Field required",
    ),
    ("completions: missing prompt", COMPLETIONS, {"max_tokens": 5}, 400, "prompt", "prompt"),
    ("completions: empty prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt", "empty"),
    ("completions: empty prompt list", COMPLETIONS, {"prompt": []}, 400, "prompt", "empty"),
    (
        "completions: token id out of vocabulary",
        COMPLETIONS,
        {"prompt": [1, 10**7]},
        400,
        "prompt",
        "vocabulary",
    ),
    (
        "completions: prompt longer than the context",
        COMPLETIONS,
        {"prompt": "hello " * 2100, "max_tokens": None},
        400,
        "prompt",
        "2048",
    ),
    (
        "completions: unknown model",
        COMPLETIONS,
        {"prompt": "x", "model": "davinci"},
        404,
        "model",
        "davinci",
    ),
    ("completions: suffix", COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, "suffix", "suffix"),
    (
        "completions: too many sequences",
        COMPLETIONS,
        {"prompt": [[1, 2, 3]] * 33, "n": 128, "max_tokens": 1},
        400,
        "prompt",
        "at most 4096 sequences",
    ),
    ("tokenize: neither prompt nor messages", "/tokenize", {}, 400, "prompt", "prompt"),
    (
        "detokenize: token out of vocabulary",
        "/detokenize",
        {"tokens": [-1]},
        400,
        "tokens",
        "vocabulary",
    ),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "param", "word"), CASES, ids=[c[0] for c in CASES]
)
def test_invalid_request(default_server, name, path, body, status, param, word):
    if isinstance(body, bytes):
        response = default_server.post(
            path, content=body, headers={"Content-Type": "application/json"}
        )
    else:
        response = default_server.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert word.lower() in error["message"].lower(), error
    if param is not None:
        assert error["param"] == param, error


def test_server_still_serves_after_bad_requests(default_server):
    assert len(CASES) >= 20
    response = default_server.post(CHAT, {"messages": MSG, "temperature": 0, "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] > 0
    assert default_server.get("/health").status_code == 200


def test_body_without_a_json_content_type_says_so(default_server):
    """``curl -d '{...}'`` sends a form content type: the body reaches validation as text."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    response = default_server.post(
        CHAT, content=body, headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert response.status_code == 400, response.text
    assert "application/json" in response.json()["error"]["message"]


def test_unknown_route_and_method(default_server):
    missing = default_server.get("/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = default_server.get(CHAT)
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_openai_sdk_raises_typed_errors(default_server):
    import openai

    client = default_server.openai()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MSG, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)


def test_model_name_with_a_lone_surrogate_is_a_404(default_server):
    body = b'{"model": "x\\ud800", "messages": [{"role": "user", "content": "Hi"}]}'
    response = default_server.post(CHAT, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "\\ud800" in error["message"]


def test_retrieve_model_and_head_health(default_server):
    served = default_server.get("/v1/models").json()["data"][0]
    card = default_server.get(f"/v1/models/{served['id']}")
    assert card.status_code == 200
    assert {**card.json(), "created": 0} == {**served, "created": 0}
    missing = default_server.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    head = httpx.head(default_server.url + "/health", headers=default_server.headers, timeout=30)
    assert head.status_code == 200 and head.content == b""


def test_tokenize_messages_with_a_lone_surrogate_is_a_400(default_server):
    body = b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}'
    response = default_server.post(
        "/tokenize", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"


def test_long_model_names_are_quoted_shortened(default_server):
    response = default_server.post(CHAT, {"model": "m" * 100_000, "messages": MSG})
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert len(message) < 400 and "100000 characters" in message


def test_untokenizable_prompt_names_the_field(default_server):
    body = b'{"prompt": "fine \\ud800", "max_tokens": 1}'
    response = default_server.post(
        COMPLETIONS, content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "Unicode" in error["message"]

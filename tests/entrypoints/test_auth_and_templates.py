"""API keys, and models without a chat template (with and without ``--chat-template FILE``),
on a tiny random Llama."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def test_api_key_required_on_v1_routes(template_server):
    url = template_server.url
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ):
        missing = httpx.post(url + path, json=body, timeout=60)
        assert missing.status_code == 401
        error = missing.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        wrong = httpx.post(
            url + path, json=body, timeout=60, headers={"Authorization": f"Bearer {API_KEY}x"}
        )
        assert wrong.status_code == 401
        right = httpx.post(
            url + path, json=body, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
        )
        assert right.status_code == 200, right.text
    assert httpx.get(url + "/v1/models", timeout=60).status_code == 401
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}, timeout=60).status_code == 401


def test_open_routes_need_no_key(template_server):
    url = template_server.url
    assert httpx.get(url + "/health", timeout=60).status_code == 200
    assert httpx.get(url + "/version", timeout=60).json()["version"]
    assert "tokenmill:num_requests_running" in httpx.get(url + "/metrics", timeout=60).text


def test_openai_sdk_with_and_without_key(template_server, tiny_model_dir):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=template_server.url + "/v1", api_key="wrong", max_retries=0
        ).models.list()
    models = template_server.openai().models.list()
    assert models.data[0].id == os.path.basename(tiny_model_dir)


def test_cors_preflight_needs_no_key(template_server):
    response = httpx.options(
        template_server.url + "/v1/chat/completions",
        timeout=60,
        headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"},
    )
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] in ("*", "http://example.com")


def test_no_chat_template_is_a_clear_400_and_completions_work(no_template_server):
    """Regression: a model without a chat template rejects chat with a 400 that says what to
    do, and still serves completions."""
    chat = no_template_server.post("/v1/chat/completions", CHAT)
    assert chat.status_code == 400
    error = chat.json()["error"]
    assert "chat template" in error["message"] and "--chat-template" in error["message"]
    assert error["param"] == "messages"
    completion = no_template_server.post(
        "/v1/completions",
        {
            "prompt": "Hello",
            "max_tokens": 5,
            "ignore_eos": True,
        },
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 5


def test_chat_template_file(template_server, tiny_model_dir):
    tokens = template_server.post("/tokenize", {"messages": CHAT["messages"]}).json()["tokens"]
    text = template_server.post("/detokenize", {"tokens": tokens}).json()["prompt"]
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    result = template_server.openai().chat.completions.create(
        model=os.path.basename(tiny_model_dir),
        messages=CHAT["messages"],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert result.usage.prompt_tokens == len(tokens)
    assert result.usage.completion_tokens == 4

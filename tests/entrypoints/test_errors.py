"""Malformed and invalid requests: each gets the right status and OpenAI's error body, and the
server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.error_cases import CASES, CHAT, COMPLETIONS, MSG

pytestmark = pytest.mark.slow

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

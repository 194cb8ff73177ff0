"""The request body cap: a 413 in OpenAI's error format (Anthropic's on /v1/messages), from a
declared Content-Length or from a chunked body as it crosses the cap, and nothing refused
below it."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from tokenmill.entrypoints.anthropic.errors import error_response_for
from tokenmill.entrypoints.anthropic.router import router as messages_router
from tokenmill.entrypoints.openai.body_limit import BodySizeLimitMiddleware
from tokenmill.entrypoints.openai.server import add_error_handlers

LIMIT = 1000


class Echo(BaseModel):
    text: str


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: Echo) -> dict:
        return {"length": len(body.text)}

    add_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=LIMIT)
    return TestClient(app)


def body_of(size: int) -> bytes:
    """A JSON body of exactly ``size`` bytes."""
    overhead = len(b'{"text": ""}')
    return b'{"text": "' + b"x" * (size - overhead) + b'"}'


def chunks(data: bytes, size: int = 100):
    for i in range(0, len(data), size):
        yield data[i : i + size]


def assert_too_large(response) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert str(LIMIT) in error["message"]


def test_a_body_at_the_limit_is_served(client):
    response = client.post(
        "/echo", content=body_of(LIMIT), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 200 and response.json() == {"length": LIMIT - 12}


def test_a_declared_length_over_the_limit_is_refused_before_reading(client):
    response = client.post(
        "/echo", content=body_of(LIMIT + 1), headers={"Content-Type": "application/json"}
    )
    assert_too_large(response)


def test_a_chunked_body_is_refused_as_it_crosses_the_limit(client):
    headers = {"Content-Type": "application/json"}
    assert client.post("/echo", content=chunks(body_of(LIMIT)), headers=headers).status_code == 200
    assert_too_large(client.post("/echo", content=chunks(body_of(3 * LIMIT)), headers=headers))


def test_the_limit_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        BodySizeLimitMiddleware(FastAPI(), 0)


class _AnyMessage:
    """Stands in for the Messages handler: every request it gets is answered."""

    async def create(self, request) -> dict:
        return {"ok": True}


def test_the_messages_api_answers_its_413s_in_anthropics_shape():
    app = FastAPI()
    app.include_router(messages_router)
    app.state.serving_messages = _AnyMessage()
    add_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=LIMIT, error_response=error_response_for)
    client = TestClient(app)
    message = {"role": "user", "content": "x" * 3 * LIMIT}
    body = json.dumps({"model": "m", "max_tokens": 1, "messages": [message]}).encode()
    headers = {"Content-Type": "application/json"}
    for content in (body, chunks(body)):  # declared, then chunked
        response = client.post("/v1/messages", content=content, headers=headers)
        assert response.status_code == 413, response.text
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "request_too_large"
        assert str(LIMIT) in error["error"]["message"]
    small = json.dumps({"model": "m", "max_tokens": 1, "messages": [{"role": "user"}]})
    assert client.post("/v1/messages", content=small, headers=headers).json() == {"ok": True}

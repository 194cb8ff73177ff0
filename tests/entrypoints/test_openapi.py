"""The OpenAPI document matches the server: schemathesis generates requests from it (a fixed
number per operation, derandomized), and every answer must be no server error, with a status,
content type, headers and body (each event of a stream) that the document describes; answers
of the Responses and Messages APIs are checked on requests that reach them too. Plus what the
document itself must say: the request bounds the server enforces, and the content types of
/health, /metrics, /tokenize and the streams."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.entrypoints.conftest import server_fixture, tiny_args

pytestmark = pytest.mark.slow

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def small_context_server(tiny_model_dir, chat_template_file):
    """The tiny random model with a 32-token context, so that any generated request is
    answered fast (a longer one is a 400), and a chat template, so that chat requests get
    answers too."""
    args = [*tiny_args(tiny_model_dir), "--max-model-len", "32"]
    yield from server_fixture([*args, "--chat-template", chat_template_file])


def test_every_answer_matches_the_document(small_context_server):
    """Each operation, 10 generated requests (schemathesis' strategies under Hypothesis,
    driven here rather than by its pytest plugin)."""
    url = small_context_server.url
    api = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=10,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def answers_match(case) -> None:
            case.call_and_validate(base_url=url, checks=CHECKS, timeout=120)

        answers_match()


def test_the_agent_apis_answers_match_the_document(small_context_server):
    """Generated requests seldom reach an answer on the Responses and Messages routes (a
    random model name is a 404): these do, streamed and not, and a stored response is read
    back and deleted; every answer must match the document."""
    url = small_context_server.url
    api = schemathesis.openapi.from_url(url + "/openapi.json")
    model = small_context_server.get("/v1/models").json()["data"][0]["id"]

    def call(path: str, method: str = "POST", **kwargs):
        case = api[path][method].Case(**kwargs)
        return case.call_and_validate(base_url=url, checks=CHECKS, timeout=120)

    for stream in (False, True):
        body = {"model": model, "input": "Hi", "max_output_tokens": 3, "stream": stream}
        created = call("/v1/responses", body=body, media_type="application/json")
        assert created.status_code == 200
        body = {"model": model, "max_tokens": 3, "stream": stream,
                "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
        answer = call("/v1/messages", body=body, media_type="application/json")
        assert answer.status_code == 200
    counted = call("/v1/messages/count_tokens", body=body, media_type="application/json")
    assert counted.json()["input_tokens"] > 0
    body = {"model": model, "input": "Hi", "max_output_tokens": 3}
    response_id = call("/v1/responses", body=body, media_type="application/json").json()["id"]
    path = "/v1/responses/{response_id}"
    assert call(path, "GET", path_parameters={"response_id": response_id}).status_code == 200
    assert call(path, "DELETE", path_parameters={"response_id": response_id}).json()["deleted"]
    assert call(path, "GET", path_parameters={"response_id": response_id}).status_code == 404
    body = {"model": "claude-x", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    unknown = call("/v1/messages", body=body, media_type="application/json")
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


def test_the_document_carries_bounds_and_content_types(small_context_server):
    doc = httpx.get(small_context_server.url + "/openapi.json").json()
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]

    def bounds(name: str) -> dict:
        [number] = [s for s in props[name]["anyOf"] if s["type"] != "null"]
        return {k: v for k, v in number.items() if "imum" in k}

    assert bounds("temperature") == {"minimum": 0.0}
    assert bounds("top_p") == {"exclusiveMinimum": 0.0, "maximum": 1.0}
    assert bounds("n") == {"minimum": 1, "maximum": 128}
    assert bounds("presence_penalty") == {"minimum": -2.0, "maximum": 2.0}
    assert "422" not in str(doc["paths"])

    def content(path: str, method: str = "post") -> set:
        return set(doc["paths"][path][method]["responses"]["200"].get("content", {}))

    assert content("/health", "get") == set()
    assert content("/metrics", "get") == {"text/plain"}
    assert content("/tokenize") == {"application/json"}
    assert content("/v1/chat/completions") == {"application/json", "text/event-stream"}
    assert content("/v1/completions") == {"application/json", "text/event-stream"}
    assert "429" in doc["paths"]["/v1/completions"]["post"]["responses"]
    # The agent APIs: bounds, streams, and Anthropic's errors and request body on /v1/messages.
    props = doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert bounds("max_output_tokens") == {"minimum": 1}
    assert content("/v1/responses") == {"application/json", "text/event-stream"}
    assert content("/v1/messages") == {"application/json", "text/event-stream"}
    messages = doc["paths"]["/v1/messages"]["post"]
    error = messages["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
    assert error.endswith("/AnthropicErrorResponse")
    request = messages["requestBody"]["content"]["application/json"]["schema"]
    assert request["properties"]["max_tokens"]["minimum"] == 1
    assert {"model", "max_tokens", "messages"} <= set(request["required"])

"""Structured outputs through the server, on the real default model: a JSON schema (chat,
OpenAI's response_format), JSON mode, a regex, a choice and a grammar (vLLM's fields),
streamed and not; each output is checked against its constraint."""

from __future__ import annotations

import json
import re

import pytest

from tests.entrypoints.test_chat_completions import MODEL

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_chat_json_schema_output_is_valid(default_server):
    client = default_server.openai()
    result = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    person = json.loads(choice.message.content)
    assert set(person) == {"name", "age"}
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 120
    assert isinstance(person["name"], str) and len(person["name"]) <= 12


def test_json_mode_gives_an_object(default_server):
    result = default_server.post(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Reply in JSON."}],
            "temperature": 0,
            "max_tokens": 40,
            "response_format": {"type": "json_object"},
        },
    ).json()
    text = result["choices"][0]["message"]["content"]
    if result["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert text.lstrip().startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_completion_regex_choice_and_grammar(default_server, stream):
    client = default_server.openai()
    cases = [
        ({"guided_regex": "[a-z]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t)),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        (
            {"structured_outputs": {"grammar": 'root ::= "ok" | "not ok"'}},
            lambda t: t in ("ok", "not ok"),
        ),
    ]
    for extra, check in cases:
        kwargs = dict(model=MODEL, prompt="Answer:", temperature=0, max_tokens=20)
        if stream:
            chunks = client.completions.create(**kwargs, stream=True, extra_body=extra)
            chunks = list(chunks)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.completions.create(**kwargs, extra_body=extra).choices[0]
            text, finish = choice.text, choice.finish_reason
        assert check(text), (extra, text)
        assert finish == "stop"


def test_sampled_outputs_keep_to_the_constraint(default_server):
    result = default_server.post(
        "/v1/completions",
        {
            "prompt": "Pick a colour:",
            "n": 4,
            "temperature": 1.5,
            "seed": 3,
            "max_tokens": 10,
            "guided_choice": ["red", "green", "blue"],
        },
    ).json()
    assert {c["text"] for c in result["choices"]} <= {"red", "green", "blue"}


@pytest.mark.parametrize(
    "constraint",
    [
        {"regex": "[^\\s\\S]"},  # admits no output: its first token breaks it
        {"json": {"type": "string", "minLength": -5}},  # refused before the engine
        {"choice": ["\ud800"]},  # not encodable for the engine: refused before it
    ],
)
def test_a_constraint_that_fails_is_a_bad_request(default_server, constraint):
    body = {"prompt": "Hi", "max_tokens": 5, "structured_outputs": constraint}
    response = default_server.post(  # ASCII JSON: a lone surrogate travels as an escape
        "/v1/completions", content=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "structured_outputs"
    assert error["message"].startswith("structured_outputs:")
    ok = default_server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_constraint_that_fails_in_the_engine_names_the_clients_field(default_server, path):
    # Accepted (the regex compiles), then given up in the engine: its first token breaks it.
    body = {"max_tokens": 5, "guided_regex": "[^\\s\\S]"}
    if path == "/v1/completions":
        body["prompt"] = "Hi"
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    response = default_server.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_regex"
    assert error["message"].startswith("guided_regex:")

"""Request fields the API does not know: ignored, as OpenAI's and vLLM's servers ignore them,
and named in a warning so that a misspelt or misplaced field is visible in the log."""

from __future__ import annotations

import logging

from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


def test_unknown_fields_are_ignored_and_named_in_the_log(caplog):
    caplog.set_level(logging.WARNING, "tokenmill.entrypoints.openai.protocol")
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi", "nmae": "x"}],
        "foo_unknown": 1, "disable_any_whitespace": True, "max_tokens": 4,
    })  # fmt: skip
    assert request.max_tokens == 4
    logged = [r.getMessage() for r in caplog.records]
    assert any("ChatCompletionRequest" in m and "'foo_unknown', 'disable_any_whitespace'" in m
               for m in logged)  # fmt: skip
    assert any("'nmae'" in m for m in logged)


def test_known_fields_and_many_unknown_ones(caplog):
    caplog.set_level(logging.WARNING, "tokenmill.entrypoints.openai.protocol")
    CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": 3})
    assert not caplog.records
    many = {f"f{i}": i for i in range(20)}
    CompletionRequest.model_validate({"model": "m", "prompt": "x", **many})
    [record] = caplog.records
    assert "'f7'" in record.getMessage() and "and 12 more" in record.getMessage()


def test_a_response_message_sent_back_is_not_warned_about(caplog):
    """OpenAI's SDK sends an answer's message back in the next turn with its ``refusal``
    (null): a field of OpenAI's API, so no warning."""
    caplog.set_level(logging.WARNING, "tokenmill.entrypoints.openai.protocol")
    ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None},
        {"role": "user", "content": "again"},
    ]})  # fmt: skip
    assert not caplog.records

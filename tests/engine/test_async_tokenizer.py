"""AsyncTokenizer gives transformers' ids, encoded off the event loop in a thread pool."""

from __future__ import annotations

import asyncio

from tokenmill.engine.async_tokenizer import AsyncTokenizer


def test_threaded_encode_equals_encode(smollm2_tokenizer):
    texts = ["Hello world", "emoji 😀 and 你好", "<|im_start|>user\nhi<|im_end|>", "", "x " * 500]

    async def run():
        tok = AsyncTokenizer(smollm2_tokenizer, num_workers=2)
        try:
            with_special = await asyncio.gather(*(tok.encode(t) for t in texts))
            without = await asyncio.gather(*(tok.encode(t, False) for t in texts))
        finally:
            tok.shutdown()
        return with_special, without

    with_special, without = asyncio.run(run())
    assert with_special == [smollm2_tokenizer.encode(t) for t in texts]
    assert without == [smollm2_tokenizer.encode(t, add_special_tokens=False) for t in texts]


def test_one_untokenizable_text_fails_only_its_own_request(smollm2_tokenizer):
    from tokenmill.engine.input_processor import InvalidRequestError

    texts = ["fine", "evil \ud800", "also fine"]

    async def run():
        tok = AsyncTokenizer(smollm2_tokenizer)
        try:
            return await asyncio.gather(*(tok.encode(t) for t in texts), return_exceptions=True)
        finally:
            tok.shutdown()

    good, bad, also_good = asyncio.run(run())
    assert good == smollm2_tokenizer.encode("fine")
    assert also_good == smollm2_tokenizer.encode("also fine")
    assert isinstance(bad, InvalidRequestError)


def test_text_too_long_for_any_context_is_rejected_without_tokenizing(smollm2_tokenizer):
    from tokenmill.engine.async_tokenizer import max_prompt_chars
    from tokenmill.engine.input_processor import InvalidRequestError

    limit = max_prompt_chars(smollm2_tokenizer, 16)
    # No token of this vocabulary is longer than 81 characters.
    assert limit == 2 * 81 * 16

    async def run():
        tok = AsyncTokenizer(smollm2_tokenizer, max_model_len=16)
        tok._encode = None  # tokenizing the long text would fail differently
        try:
            return await asyncio.gather(tok.encode("a" * (limit + 1), param="prompt"),
                                        return_exceptions=True)  # fmt: skip
        finally:
            tok.shutdown()

    [error] = asyncio.run(run())
    assert isinstance(error, InvalidRequestError) and error.param == "prompt"
    assert "16 tokens" in str(error)
    # At the bound the text is tokenized (and then judged by its token count).
    tok = AsyncTokenizer(smollm2_tokenizer, max_model_len=16)
    try:
        ids = asyncio.run(tok.encode("a" * limit))
    finally:
        tok.shutdown()
    assert ids == smollm2_tokenizer.encode("a" * limit)


def test_a_conversation_too_large_for_the_context_is_refused_before_rendering(smollm2_tokenizer):
    """More messages than the context has tokens, or more characters than any text of it can
    hold, are refused without calling the renderer; the rest is rendered on a pool thread,
    and what the renderer raises reaches the caller."""
    import threading

    from tokenmill.engine.async_tokenizer import max_prompt_chars
    from tokenmill.engine.input_processor import InvalidRequestError

    limit = max_prompt_chars(smollm2_tokenizer, 16)
    calls: list[str] = []

    def render() -> str:
        calls.append(threading.current_thread().name)
        return "rendered"

    def broken() -> str:
        raise ValueError("template failed")

    async def run():
        tok = AsyncTokenizer(smollm2_tokenizer, max_model_len=16)
        try:
            return await asyncio.gather(
                tok.render(render, 17, 10, "messages"),
                tok.render(render, 16, limit + 1, "messages"),
                tok.render(render, 16, limit, "messages"),
                tok.render(broken, 1, 1, "messages"),
                return_exceptions=True,
            )
        finally:
            tok.shutdown()

    too_many, too_long, fits, failed = asyncio.run(run())
    assert isinstance(too_many, InvalidRequestError) and too_many.param == "messages"
    assert "17 messages" in str(too_many) and "16 tokens" in str(too_many)
    assert isinstance(too_long, InvalidRequestError) and f"{limit + 1:,} characters" in str(
        too_long
    )
    assert fits == "rendered" and isinstance(failed, ValueError)
    assert len(calls) == 1 and calls[0].startswith("tokenmill-tokenizer")

"""Tokenizer loading (GGUF + on-disk cache), chat templates and token decoding."""

from __future__ import annotations

import copy
import os

import pytest

from tokenmill import tokenizer as tokenizer_mod
from tokenmill.hf_config import ModelLoadError
from tokenmill.tokenizer import (
    ChatTemplateError,
    apply_chat_template,
    decode_token_texts,
    decode_with_context,
    get_tokenizer,
    gguf_tokenizer_cache_key,
    load_chat_template,
)

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
SAMPLES = ["Hello world!", "naïve café 😀 世界", "<|im_start|>user\nhi<|im_end|>"]


def _assert_same_tokenizer(a, b) -> None:
    assert a.get_vocab() == b.get_vocab()
    assert a.chat_template == b.chat_template
    assert a.all_special_ids == b.all_special_ids
    assert (a.bos_token_id, a.eos_token_id) == (b.bos_token_id, b.eos_token_id)
    for text in SAMPLES:
        assert a.encode(text) == b.encode(text)


def test_gguf_tokenizer_loads(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.is_fast
    assert len(tok) == 49152
    assert tok.eos_token == "<|im_end|>"
    assert "<|im_start|>" in tok.chat_template  # the template embedded in the GGUF survives
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_gguf_cache_built_then_hit(smollm2_gguf_path, smollm2_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    calls: list[dict] = []
    real = tokenizer_mod._from_pretrained

    def spy(path, **kwargs):
        calls.append({"path": path, **kwargs})
        return real(path, **kwargs)

    monkeypatch.setattr(tokenizer_mod, "_from_pretrained", spy)
    built = get_tokenizer(smollm2_gguf_path)  # empty cache: converted from the GGUF
    assert [c.get("gguf_file") for c in calls] == [os.path.basename(smollm2_gguf_path)]
    entry = tmp_path / "tokenizers" / gguf_tokenizer_cache_key(smollm2_gguf_path)
    assert (entry / "tokenizer.json").is_file()
    assert (entry / "chat_template.jinja").is_file()
    # Only the finished entry is left: the temporary folder was renamed into place.
    assert os.listdir(tmp_path / "tokenizers") == [entry.name]

    calls.clear()
    cached = get_tokenizer(smollm2_gguf_path)
    assert calls == [{"path": str(entry)}]  # read from the cache, no GGUF conversion
    _assert_same_tokenizer(built, cached)
    _assert_same_tokenizer(smollm2_tokenizer, cached)


def test_cache_key_changes_with_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"abc")
    key = gguf_tokenizer_cache_key(str(path))
    assert key == gguf_tokenizer_cache_key(str(path))
    path.write_bytes(b"abcd")
    assert gguf_tokenizer_cache_key(str(path)) != key


def test_save_atomically_keeps_the_winner(tmp_path):
    class FakeTokenizer:
        def __init__(self, marker: str):
            self.marker = marker

        def save_pretrained(self, path: str) -> None:
            with open(os.path.join(path, "marker"), "w") as f:
                f.write(self.marker)

    target = tmp_path / "entry"
    tokenizer_mod._save_atomically(FakeTokenizer("first"), str(tmp_path), str(target))
    # A second writer (another process that raced) loses: the complete entry is kept
    # and its temporary folder is cleaned up.
    tokenizer_mod._save_atomically(FakeTokenizer("second"), str(tmp_path), str(target))
    assert (target / "marker").read_text() == "first"
    assert os.listdir(tmp_path) == ["entry"]


def test_missing_paths_raise(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        get_tokenizer(str(tmp_path / "nope"))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        get_tokenizer(str(not_gguf))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="holds no tokenizer .*pass --tokenizer") as e:
        get_tokenizer(str(tmp_path))  # a model folder without tokenizer files
    assert "\n" not in str(e.value)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot load a tokenizer"):
        get_tokenizer(str(tmp_path))


def test_any_tokenizer_load_failure_is_one_line(tmp_path, monkeypatch):
    """transformers also validates a GGUF file's metadata as a model config while it builds
    the tokenizer, and huggingface_hub's validation errors are neither OSError nor
    ValueError: whatever it raises becomes a one-line ModelLoadError."""
    import transformers

    class StrictValidationError(Exception):  # as huggingface_hub's, multi-line
        pass

    def fail(*args, **kwargs):
        raise StrictValidationError("Class validation error for validator 'x':\n  The "
                                    "hidden size (512) is not a multiple of the heads (9).")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="hidden size .512. is not a multiple") as e:
        get_tokenizer(str(tmp_path))
    assert "\n" not in str(e.value)


def test_chat_template_renders_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = apply_chat_template(tok, MESSAGES)
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert ids == tok.encode(text, add_special_tokens=False)
    no_prompt = apply_chat_template(tok, MESSAGES, add_generation_prompt=False)
    assert not tok.decode(no_prompt).endswith("assistant\n")


def test_chat_template_list_of_parts(smollm2_tokenizer):
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}],
        }
    ]
    joined = [{"role": "user", "content": "What is\n2 + 2?"}]
    assert apply_chat_template(smollm2_tokenizer, parts) == apply_chat_template(
        smollm2_tokenizer, joined
    )
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ChatTemplateError, match="image_url"):
        apply_chat_template(smollm2_tokenizer, image)


def test_chat_template_missing(smollm2_tokenizer):
    tok = copy.copy(smollm2_tokenizer)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        apply_chat_template(tok, MESSAGES)
    # A template given explicitly works without the tokenizer's own.
    ids = apply_chat_template(tok, MESSAGES, chat_template="{{ messages[0]['content'] }}")
    assert tok.decode(ids) == "What is 2 + 2?"


def test_chat_template_error_is_clear(smollm2_tokenizer):
    with pytest.raises(ChatTemplateError, match="failed"):
        apply_chat_template(smollm2_tokenizer, MESSAGES, chat_template="{{ raise_me( }}")
    with pytest.raises(ChatTemplateError, match="role"):
        apply_chat_template(smollm2_tokenizer, [{"content": "no role"}])


def test_load_chat_template_file_or_text(tmp_path):
    text = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(text)
    assert load_chat_template(str(path)) == text
    assert load_chat_template(text) == text
    with pytest.raises(ChatTemplateError, match="neither an existing file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    # A syntax error fails at start-up, not as a 400 on every chat request.
    broken = "{% for m in messages %}{{ m.content }}{% endfor %"
    with pytest.raises(ChatTemplateError, match="not valid Jinja: line 1"):
        load_chat_template(broken)
    path.write_text(broken)
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        load_chat_template(str(path))
    # transformers' own tags compile.
    assert load_chat_template("{% generation %}{{ x }}{% endgeneration %}")


def test_decode_helpers(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("Hello world 😀")
    texts = decode_token_texts(tok, ids)
    assert texts[:2] == ["Hello", " world"]
    assert "\ufffd" in texts[-1]  # one byte of the emoji on its own
    assert decode_token_texts(tok, [tok.eos_token_id]) == ["<|im_end|>"]
    assert decode_with_context(tok, ids[:1], ids[1:], skip_special_tokens=True) == " world 😀"


def test_encode_prompt_equals_transformers_encode(smollm2_tokenizer):
    from tokenmill.tokenizer import encode_prompt

    texts = [
        "Hello world",
        " leading space",
        "emoji 😀🎉 and CJK 你好世界",
        "<|im_start|>user\nhi<|im_end|>",
        "tabs\tand\nnewlines\n\n",
        "",
        "a" * 3000,
    ]
    for text in texts:
        for special in (True, False):
            assert encode_prompt(smollm2_tokenizer, text, special) == smollm2_tokenizer.encode(
                text, add_special_tokens=special
            ), text

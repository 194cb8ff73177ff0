"""IncrementalDetokenizer: exact incremental text, stop strings, held-back stream text."""

from __future__ import annotations

import json
import random
import tempfile

import pytest

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.sampling_params import SamplingParams

TEXTS = [
    "Hello world, the answer is 42.",
    "Emoji: 😀👍🏽🇫🇷🧑‍🚀 and more 🎉!",
    "中文文本：你好，世界。日本語のテキストです。한국어 텍스트",
    "Accents: naïve café résumé Ωμέγα e\u0301 ñ ß Ünïcödé",
    "code:\n\tdef f(x):\n\t\treturn x  # 😀 tail",
]


def run(
    tok,
    prompt_ids: list[int],
    output_ids: list[int],
    params: SamplingParams,
    chunk_sizes: list[int] | None = None,
    stop_terminated: bool = False,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ``output_ids`` in chunks; return the detokenizer, the deltas and any stop."""
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas, i, stop = [], 0, None
    sizes = iter(chunk_sizes or [])
    while i < len(output_ids):
        n = next(sizes, 1)
        chunk, i = output_ids[i : i + n], i + n
        last = i >= len(output_ids)
        stop = detok.update(chunk, stop_terminated=stop_terminated and last, finished=last)
        finished = last or stop is not None
        deltas.append(detok.get_next_output_text(finished=finished, delta=True))
        if stop is not None:
            break
    return detok, deltas, stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_increments_equal_full_decode(smollm2_tokenizer, text, skip):
    tok = smollm2_tokenizer
    ids = tok.encode("<|im_start|>assistant\n" + text + "<|im_end|> trailing")
    rng = random.Random(len(text))
    for cut in range(1, len(ids)):
        prompt, output = ids[:cut], ids[cut:]
        sizes = [rng.randint(1, 3) for _ in output]
        detok, deltas, _ = run(tok, prompt, output, SamplingParams(skip_special_tokens=skip), sizes)
        expected = tok.decode(output, skip_special_tokens=skip)
        assert "".join(deltas) == expected
        assert detok.output_text == expected
        if "\ufffd" not in expected:  # (a cut inside a character leaves stray bytes)
            assert all("\ufffd" not in d for d in deltas)


def test_emoji_bytes_held_until_complete(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.encode("Say:")
    output = tok.encode(" 😀")
    assert len(output) == 2  # byte-level BPE splits the emoji over two tokens
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    detok.update(output[:1], stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    detok.update(output[1:], stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=True) == " 😀"


def test_random_token_ids_equal_full_decode(smollm2_tokenizer):
    """Byte soup, special tokens and incomplete characters at the end (flushed as U+FFFD)."""
    tok = smollm2_tokenizer
    rng = random.Random(0)
    vocab = len(tok)
    byte_ids = [i for i in range(vocab) if len(tok.convert_ids_to_tokens(i)) == 1]
    for trial in range(300):
        pool = byte_ids if trial % 2 else range(vocab)
        prompt = [rng.choice(pool) for _ in range(rng.randint(1, 8))]
        output = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        skip = rng.random() < 0.5
        sizes = [rng.randint(1, 3) for _ in output]
        _, deltas, _ = run(tok, prompt, output, SamplingParams(skip_special_tokens=skip), sizes)
        assert "".join(deltas) == tok.decode(output, skip_special_tokens=skip)


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A Llama-2-style tokenizer: SentencePiece spaces, byte fallback, a Strip decoder."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    corpus = ["Hello world, the quick brown fox jumps over the lazy dog.", "naïve café"] * 10
    base.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120))
    with tempfile.TemporaryDirectory() as d:
        vocab_file, merges_file = base.model.save(d)
        with open(vocab_file) as f:
            trained = json.load(f)
        with open(merges_file) as f:
            merges = [tuple(line.split()) for line in f.read().splitlines()[1:] if line]
    vocab = {"<s>": 0, "</s>": 1} | {f"<0x{i:02X}>": 2 + i for i in range(256)}
    for piece in sorted(trained, key=trained.get):
        vocab.setdefault(piece, len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tk.pre_tokenizer = base.pre_tokenizer
    tk.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tk.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")


def test_first_token_space_kept_after_prompt(metaspace_tokenizer):
    tok = metaspace_tokenizer
    ids = tok.encode("Hello world", add_special_tokens=False)
    prompt, output = ids[:1], ids[1:]
    assert tok.decode(output) == "world"  # decoded alone, the word-start space is stripped
    detok, deltas, _ = run(tok, prompt, output, SamplingParams())
    assert "".join(deltas) == " world"


def test_byte_fallback_increments(metaspace_tokenizer):
    """Valid text split anywhere: exact. Invalid byte runs: no error, no token's text lost."""
    tok = metaspace_tokenizer
    rng = random.Random(1)
    for _trial in range(200):
        ids = tok.encode(rng.choice(TEXTS) + " " + rng.choice(TEXTS), add_special_tokens=False)
        cut = rng.randrange(1, len(ids))
        prompt, output = ids[:cut], ids[cut:]
        detok, deltas, _ = run(tok, prompt, output, SamplingParams(), [2] * len(output))
        context = detok._context
        full = tok.decode(context + output)
        assert "".join(deltas) == full[len(tok.decode(context)) :]
    prompt = tok.encode("Hello", add_special_tokens=False)
    for _trial in range(300):
        output = [rng.randrange(len(tok)) for _ in range(30)]
        _, deltas, _ = run(tok, prompt, output, SamplingParams(), [1] * 30)
        # ByteFallback turns a whole invalid byte run into U+FFFD after the fact, which a
        # stream cannot take back: every other character of the full decode must be
        # streamed, in order.
        full = tok.decode(prompt + output, skip_special_tokens=True)[len("Hello") :]
        streamed = iter("".join(deltas))
        assert all(ch in streamed for ch in full.replace("\ufffd", ""))


def _stream_prefix_invariant(deltas: list[str], final: str) -> None:
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert final.startswith(streamed)
    assert streamed == final


def test_stop_string_split_across_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.encode("Q:")
    output = tok.encode(" Hello world, the answer is 42.")
    params = SamplingParams(stop=["answer is"])
    detok, deltas, stop = run(tok, prompt, output, params)
    assert stop == "answer is"
    assert detok.output_text == " Hello world, the "
    _stream_prefix_invariant(deltas, detok.output_text)
    assert not any("answer" in d or d.endswith("ans") for d in deltas)
    # Every token up to the one completing the stop string is kept in the ids.
    assert detok.token_ids == output[: len(tok.encode(" Hello world, the answer is"))]


def test_stop_string_include_in_output(smollm2_tokenizer):
    tok = smollm2_tokenizer
    output = tok.encode(" Hello world, the answer is 42.")
    params = SamplingParams(stop=["answer is"], include_stop_str_in_output=True)
    detok, deltas, stop = run(tok, tok.encode("Q:"), output, params)
    assert stop == "answer is"
    assert detok.output_text == " Hello world, the answer is"
    _stream_prefix_invariant(deltas, detok.output_text)


def test_stop_string_inside_one_token_cuts_the_rest(smollm2_tokenizer):
    tok = smollm2_tokenizer
    output = tok.encode(" Hello world, the answer")
    detok, _, stop = run(tok, tok.encode("Q:"), output, SamplingParams(stop=["wor"]))
    assert stop == "wor"
    assert detok.output_text == " Hello "


def test_multiple_stop_strings_earliest_wins(smollm2_tokenizer):
    tok = smollm2_tokenizer
    output = tok.encode(" Hello world, the answer is 42.")
    for stops in (["42", "answer", "world"], ["world", "answer", "42"]):
        detok, _, stop = run(tok, tok.encode("Q:"), output, SamplingParams(stop=stops))
        assert stop == "world"
        assert detok.output_text == " Hello "
    # All text in one update: the stop string that is complete first wins ("wor" is
    # complete before "hello world" is), so the result does not depend on token boundaries.
    output = tok.encode(" say hello world")
    params = SamplingParams(stop=["hello world", "wor"])
    detok, _, stop = run(tok, [1], output, params, chunk_sizes=[len(output)])
    assert (stop, detok.output_text) == ("wor", " say hello ")


def test_stop_strings_random_streams(smollm2_tokenizer):
    """Streamed deltas always add up to the final text, and the cut is at the first match."""
    tok = smollm2_tokenizer
    rng = random.Random(2)
    for _trial in range(200):
        text = " " + rng.choice(TEXTS) + " " + rng.choice(TEXTS)
        start = rng.randrange(1, len(text) - 4)
        stop_str = text[start : start + rng.randint(1, 4)]
        include = rng.random() < 0.3
        output = tok.encode(text)
        params = SamplingParams(stop=[stop_str], include_stop_str_in_output=include)
        sizes = [rng.randint(1, 3) for _ in output]
        detok, deltas, stop = run(tok, [1, 2], output, params, sizes)
        assert stop == stop_str
        first = text.find(stop_str)
        assert detok.output_text == text[: first + (len(stop_str) if include else 0)]
        _stream_prefix_invariant(deltas, detok.output_text)


def test_several_tokens_at_once_keep_only_those_up_to_the_stop(smollm2_tokenizer):
    """Speculative decoding hands over several tokens per step: the ids and text after a stop
    string are those of one token at a time."""
    tok = smollm2_tokenizer
    rng = random.Random(5)
    for _trial in range(100):
        text = " " + rng.choice(TEXTS)
        start = rng.randrange(1, len(text) - 3)
        params = SamplingParams(stop=[text[start : start + rng.randint(1, 3)]],
                                include_stop_str_in_output=rng.random() < 0.3)  # fmt: skip
        output = tok.encode(text)
        one, _, stop_one = run(tok, [1, 2], output, params)
        sizes = [rng.randint(2, 5) for _ in output]
        many, _, stop_many = run(tok, [1, 2], output, params, sizes)
        assert stop_many == stop_one
        assert (many.token_ids, many.output_text) == (one.token_ids, one.output_text)


def test_hold_back_only_while_unfinished(smollm2_tokenizer):
    tok = smollm2_tokenizer
    output = tok.encode(" Hello world")
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(stop=["xyz12"]))
    assert detok.stop_buffer_length == 4
    detok.update(output, stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=False) == " Hello w"
    assert detok.get_next_output_text(finished=True, delta=False) == " Hello world"
    keep = IncrementalDetokenizer(
        tok, [1], SamplingParams(stop=["xyz12"], include_stop_str_in_output=True)
    )
    keep.update(output, stop_terminated=False)
    assert keep.get_next_output_text(finished=False, delta=False) == " Hello world"


def test_min_tokens_ignores_early_stop_strings(smollm2_tokenizer):
    tok = smollm2_tokenizer
    output = tok.encode(" a b a b")  # " a", " b", " a", " b"
    assert len(output) == 4
    params = SamplingParams(stop=["a"], min_tokens=2)
    detok, _, stop = run(tok, [1], output, params)
    assert stop == "a"
    assert detok.output_text == " a b "


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(smollm2_tokenizer, skip):
    tok = smollm2_tokenizer
    output = tok.encode(" Hi<|im_start|> there")
    detok, deltas, _ = run(tok, [1], output, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == (" Hi there" if skip else " Hi<|im_start|> there")


@pytest.mark.parametrize("skip", [True, False])
def test_stop_terminated_token_left_out_of_text(smollm2_tokenizer, skip):
    tok = smollm2_tokenizer
    output = tok.encode(" Hi there") + [tok.eos_token_id]
    params = SamplingParams(skip_special_tokens=skip)
    detok, deltas, _ = run(tok, [1], output, params, stop_terminated=True)
    assert "".join(deltas) == " Hi there"
    assert detok.token_ids[-1] == tok.eos_token_id
    # A stop token id that is an ordinary token is left out too ...
    stop_id = tok.encode(" there")
    detok, _, _ = run(tok, [1], tok.encode(" Hi") + stop_id, params, stop_terminated=True)
    assert detok.output_text == " Hi"
    # ... unless the stop is to be included.
    params = SamplingParams(skip_special_tokens=skip, include_stop_str_in_output=True)
    detok, _, _ = run(tok, [1], tok.encode(" Hi") + stop_id, params, stop_terminated=True)
    assert detok.output_text == " Hi there"


def test_no_detokenize(smollm2_tokenizer):
    tok = smollm2_tokenizer
    output = tok.encode(" Hello world")
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(detokenize=False))
    assert detok.update(output, stop_terminated=False, finished=True) is None
    assert detok.token_ids == output
    assert detok.get_next_output_text(finished=True, delta=False) == ""


def test_cumulative_and_delta_agree(smollm2_tokenizer):
    tok = smollm2_tokenizer
    output = tok.encode(" Hello world, the answer is 42.")
    params = SamplingParams(stop=["42"])
    cumulative = IncrementalDetokenizer(tok, [1], params)
    delta = IncrementalDetokenizer(tok, [1], params)
    streamed = ""
    for token_id in output:
        stop = cumulative.update([token_id], stop_terminated=False)
        delta.update([token_id], stop_terminated=False)
        done = stop is not None
        streamed += delta.get_next_output_text(finished=done, delta=True)
        assert cumulative.get_next_output_text(finished=done, delta=False) == streamed
        if done:
            break
    assert streamed == " Hello world, the answer is "

"""Benchmark workloads: exact prompt lengths (ids and text), seeds, ShareGPT, prefixes."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from tokenmill.benchmarks.common import BenchmarkError
from tokenmill.benchmarks.datasets import (
    add_dataset_args,
    encode,
    fit_text,
    prefix_repetition_requests,
    random_requests,
    sample_requests,
    sharegpt_requests,
    token_pool,
)


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    return parser.parse_args(list(argv))


def test_flag_defaults_are_vllms():
    args = _args()
    assert args.dataset_name is None  # random, or sharegpt when a --dataset-path is given
    assert (args.num_prompts, args.seed) == (1000, 0)
    assert (args.random_input_len, args.random_output_len) == (1024, 128)
    assert (args.random_range_ratio, args.random_prefix_len) == (0.0, 0)


def test_token_pool_leaves_out_special_tokens(tok):
    pool = token_pool(tok)
    assert not set(pool.tolist()) & set(tok.all_special_ids)
    assert pool.max() < tok.vocab_size
    assert pool.size == tok.vocab_size - len(set(tok.all_special_ids))


def test_random_ids_have_exact_lengths_and_depend_on_the_seed(tok):
    reqs = random_requests(tok, 20, input_len=37, output_len=9, seed=3)
    assert [r.prompt_len for r in reqs] == [37] * 20
    assert all(len(r.prompt_token_ids) == 37 and r.prompt is None for r in reqs)
    assert [r.expected_output_len for r in reqs] == [9] * 20
    again = random_requests(tok, 20, input_len=37, output_len=9, seed=3)
    other = random_requests(tok, 20, input_len=37, output_len=9, seed=4)
    assert [r.prompt_token_ids for r in reqs] == [r.prompt_token_ids for r in again]
    assert [r.prompt_token_ids for r in reqs] != [r.prompt_token_ids for r in other]
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 20  # no accidental sharing


@pytest.mark.parametrize("input_len", [1, 7, 64, 300])
def test_random_text_encodes_back_to_the_exact_length(tok, input_len):
    reqs = random_requests(
        tok, 12, input_len=input_len, output_len=4, seed=input_len, need_text=True
    )
    for r in reqs:
        assert r.prompt_len == input_len
        assert encode(tok, r.prompt) == r.prompt_token_ids
        assert tok.encode(r.prompt, add_special_tokens=False) == r.prompt_token_ids


def test_range_ratio_bounds(tok):
    reqs = random_requests(tok, 200, input_len=40, output_len=10, range_ratio=0.5, seed=0)
    ins = [r.prompt_len for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert min(ins) >= 20 and max(ins) <= 60 and len(set(ins)) > 10
    assert min(outs) >= 5 and max(outs) <= 15 and len(set(outs)) > 3


def test_random_prefix_is_shared(tok):
    ids_reqs = random_requests(tok, 6, input_len=10, output_len=2, prefix_len=50, seed=1)
    assert all(r.prompt_len == 60 for r in ids_reqs)
    assert len({tuple(r.prompt_token_ids[:50]) for r in ids_reqs}) == 1
    text_reqs = random_requests(
        tok, 6, input_len=10, output_len=2, prefix_len=50, seed=1, need_text=True
    )
    assert all(r.prompt_len == 60 for r in text_reqs)
    common = 0
    first = text_reqs[0].prompt_token_ids
    while all(r.prompt_token_ids[common] == first[common] for r in text_reqs):
        common += 1
    # Only the prefix's last word may merge with each prompt's own tokens.
    assert common >= 45


def test_fit_text_repairs_round_trips(tok):
    rng = np.random.default_rng(0)
    pool = token_pool(tok)
    for seed in range(30):
        ids = np.random.default_rng(seed).choice(pool, size=25).tolist()
        text, fitted = fit_text(tok, "", ids, 25, pool, rng)
        assert len(fitted) == 25 and encode(tok, text) == fitted


def test_random_rejects_bad_lengths(tok):
    with pytest.raises(BenchmarkError, match="random-output-len"):
        random_requests(tok, 2, input_len=4, output_len=0)
    with pytest.raises(BenchmarkError, match="range-ratio"):
        random_requests(tok, 2, input_len=4, output_len=4, range_ratio=1.0)
    with pytest.raises(BenchmarkError, match="num-prompts"):
        sample_requests(_args("--num-prompts", "0"), tok, need_text=False)


def test_prefix_repetition(tok):
    reqs = prefix_repetition_requests(
        tok, 10, prefix_len=20, suffix_len=8, num_prefixes=3, output_len=5, seed=0
    )
    assert len(reqs) == 10
    assert all(r.prompt_len == 28 and r.expected_output_len == 5 for r in reqs)
    prefixes = [tuple(r.prompt_token_ids[:20]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [3, 3, 4]
    text = prefix_repetition_requests(
        tok, 6, prefix_len=20, suffix_len=8, num_prefixes=2, output_len=5, seed=0, need_text=True
    )
    assert all(len(encode(tok, r.prompt)) == 28 for r in text)


def _sharegpt_file(tmp_path, tok) -> tuple[str, list[tuple[str, str]]]:
    pairs = [
        ("What is the capital of France? Answer briefly.", "Paris is the capital of France."),
        ("Write a haiku about the sea and its endless waves.", "Waves fold into foam, " * 3),
        ("Hi", "Hello there, how can I help you today?"),  # prompt too short: skipped
        ("Tell me a long story about a robot learning to paint.", "Once upon a time " * 10),
    ]
    data = [
        {
            "id": str(i),
            "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": r}],
        }
        for i, (p, r) in enumerate(pairs)
    ]
    data.append({"id": "x", "conversations": [{"from": "human", "value": "alone"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return str(path), pairs


def test_sharegpt(tmp_path, tok):
    path, pairs = _sharegpt_file(tmp_path, tok)
    reqs = sharegpt_requests(tok, path, 3, seed=0, shuffle=False)
    usable = [p for p in pairs if len(encode(tok, p[0])) >= 4]
    assert [r.prompt for r in reqs] == [p for p, _ in usable]
    assert [r.prompt_len for r in reqs] == [len(encode(tok, p)) for p, _ in usable]
    assert [r.expected_output_len for r in reqs] == [len(encode(tok, r)) for _, r in usable]
    # oversampling repeats conversations; --sharegpt-output-len overrides the reply length
    more = sharegpt_requests(tok, path, 7, seed=0, output_len=5)
    assert len(more) == 7 and {r.expected_output_len for r in more} == {5}
    assert {r.prompt for r in more} <= {p for p, _ in usable}
    assert len(sharegpt_requests(tok, path, 7, oversample=False)) == 3
    # too long for the model: skipped
    longest = max(r.prompt_len + r.expected_output_len for r in reqs)
    assert len(sharegpt_requests(tok, path, 3, max_model_len=longest - 1, oversample=False)) == 2


def test_a_dataset_path_alone_means_sharegpt(tmp_path, tok):
    path, _ = _sharegpt_file(tmp_path, tok)
    got = sample_requests(_args("--dataset-path", path, "--num-prompts", "2"), tok, True)
    assert got == sharegpt_requests(tok, path, 2, need_text=True)
    assert len(sample_requests(_args("--num-prompts", "2"), tok, True)) == 2  # random
    with pytest.raises(BenchmarkError, match="sharegpt only"):
        sample_requests(_args("--dataset-name", "random", "--dataset-path", path), tok, True)


def test_sharegpt_errors(tmp_path, tok):
    with pytest.raises(BenchmarkError, match="needs --dataset-path"):
        sample_requests(_args("--dataset-name", "sharegpt"), tok, need_text=True)
    with pytest.raises(BenchmarkError, match="cannot read"):
        sharegpt_requests(tok, str(tmp_path / "missing.json"), 3)
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    with pytest.raises(BenchmarkError, match="JSON list"):
        sharegpt_requests(tok, str(bad), 3)


def test_sample_requests_dispatch(tok):
    args = _args(
        "--num-prompts",
        "5",
        "--random-input-len",
        "12",
        "--random-output-len",
        "3",
        "--random-range-ratio",
        "0.25",
        "--seed",
        "9",
    )
    reqs = sample_requests(args, tok, need_text=True)
    assert len(reqs) == 5
    assert all(math.floor(12 * 0.75) <= r.prompt_len <= math.ceil(12 * 1.25) for r in reqs)
    assert all(len(encode(tok, r.prompt)) == r.prompt_len for r in reqs)

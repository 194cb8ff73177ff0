"""SamplingParams rejects values that would crash or silently break the engine."""

from __future__ import annotations

import math

import pytest

from tokenmill.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature="0.5"), "temperature"),
        (dict(presence_penalty=None), "presence_penalty"),
        (dict(top_p=math.nan), "top_p"),
        (dict(repetition_penalty=1e-46), "repetition_penalty"),
        (dict(n="2"), "n"),
        (dict(n=True), "n"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(seed=2**64 - 1), "seed"),
        (dict(seed=2**63 - 1, n=2), "seed"),
        # One request fans out into n (best_of) engine requests: 2**70 exhausted memory.
        (dict(n=2**70), "n"),
        (dict(n=129), "n"),
        (dict(n=2, best_of=129), "best_of"),
        (dict(temperature=1e39), "temperature"),  # inf once stored as float32
        (dict(stop=["a\ud800"]), "stop"),  # a lone surrogate cannot be matched as text
        # Every step's text is matched against each stop string, on the event loop.
        (dict(stop=["x"] * 1025), "stop"),
        (dict(stop=["x" * 20000, "y" * 20000]), "stop"),
        # Bad words are tokenized on the event loop: 10 MB of them froze it for 11 s.
        (dict(bad_words=["x" * 100000] * 100), "bad_words"),
    ],
)
def test_rejected_with_the_field_named(kwargs, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_the_most_sequences_per_request():
    assert SamplingParams(n=128).best_of == 128


def test_top_k_beyond_any_vocabulary_disables_truncation():
    assert SamplingParams(top_k=2**63).top_k == 0
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)

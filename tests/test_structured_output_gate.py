"""AfterReasoningGrammar: every token allowed until the reasoning's end tokens, with masks
known without a mask worker; then the wrapped grammar from its start, whose mask worker is
told only the tokens after the end."""

from __future__ import annotations

import numpy as np
import pytest

from tests.core.grammar_fakes import FakeGrammar, start_fake_worker
from tokenmill.core.grammar_masks import GrammarMaskFiller
from tokenmill.sampling_params import SamplingParamsError, StructuredOutputsParams
from tokenmill.structured_output_gate import AfterReasoningGrammar


class OneTokenGrammar(FakeGrammar):
    """Allows token 7 only, then is complete; its first mask (from its compile) is [7]."""

    def __init__(self) -> None:
        super().__init__(first_mask=np.array([7]))
        self.failure: str | None = None

    def accept(self, token_id: int) -> bool:
        if self.failure is not None or token_id != 7:
            return False
        self._first = None
        self.accepted.append(token_id)
        return True

    @property
    def is_complete(self) -> bool:
        return self.accepted == [7]

    def fail(self, reason: str) -> None:
        self.failure = reason


def test_free_until_the_end_tokens_then_the_grammar():
    inner = OneTokenGrammar()
    gate = AfterReasoningGrammar(inner, [3, 4], vocab_size=40)
    assert gate.text == "compiled"
    first = gate.take_first_mask()
    assert first.shape == (2,) and first.dtype == np.int32 and (first == -1).all()
    for token in (4, 3, 9, 3):  # 3 then 9: not the end
        assert gate.accept(token) and not gate.reasoning_ended and not gate.is_complete
        assert (gate.take_first_mask() == -1).all()
    assert gate.accept(4) and gate.reasoning_ended and inner.accepted == []
    assert gate.take_first_mask().tolist() == [7]  # the compile's, once
    assert gate.take_first_mask() is None  # from here on, a mask worker's
    assert not gate.accept(8) and not gate.is_complete  # the grammar decides now
    assert gate.accept(7) and gate.is_complete and gate.accepted == [7]


def test_masks_while_reasoning_need_no_worker_and_the_worker_sees_only_later_tokens():
    """Reasoning masks come back all ones with no mask worker started; after the end, the
    compile's first mask, then the worker's, built from the tokens after the end only (the
    fake worker's mask is the list of tokens it was told)."""
    started = []

    def start_worker():
        started.append(start_fake_worker())
        return started[-1]

    filler = GrammarMaskFiller(start_worker, max_workers=1)
    try:
        gate = AfterReasoningGrammar(OneTokenGrammar(), [3, 4], vocab_size=64)
        for token in (5, 3, 4):
            masks, given_up = filler.fill({"r": gate})
            assert given_up == {} and masks["r"].tolist() == [-1, -1]
            gate.accept(token)
        assert started == [] and filler._home == {}
        masks, _ = filler.fill({"r": gate})
        assert masks["r"].tolist() == [7] and started == []
        gate.accepted.extend([10, 11])  # what the wrapped grammar accepted after the end
        masks, given_up = filler.fill({"r": gate})
        assert given_up == {} and masks["r"].tolist() == [10, 11] and len(started) == 1
    finally:
        filler.shutdown()


def test_a_grammar_given_up_stops_the_reasoning_too():
    gate = AfterReasoningGrammar(OneTokenGrammar(), [3], vocab_size=64)
    gate.fail("too slow")
    assert gate.failure == "too slow" and not gate.accept(1)


@pytest.mark.parametrize("ids", [[], [-1], ["3"], 3])
def test_the_end_tokens_must_be_token_ids(ids):
    with pytest.raises(SamplingParamsError, match="reasoning_end_token_ids"):
        StructuredOutputsParams(regex="a", reasoning_end_token_ids=ids)

"""AfterReasoningGrammar: every token allowed until the reasoning's end tokens, then the
wrapped grammar from its start."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.sampling_params import SamplingParamsError, StructuredOutputsParams
from tokenmill.structured_output_gate import AfterReasoningGrammar


class FakeGrammar:
    """Allows token 7 only, then is complete."""

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.failure = None

    def token_bitmask(self) -> np.ndarray:
        mask = np.zeros(2, dtype=np.int32)
        mask[0] = 1 << 7
        return mask

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id == 7

    @property
    def is_complete(self) -> bool:
        return self.accepted == [7]

    def fail(self, reason: str) -> None:
        self.failure = reason


def test_free_until_the_end_tokens_then_the_grammar():
    inner = FakeGrammar()
    gate = AfterReasoningGrammar(inner, [3, 4], vocab_size=40)
    assert (gate.token_bitmask() == -1).all() and gate.token_bitmask().shape == (2,)
    for token in (4, 3, 9, 3):  # 3 then 9: not the end
        assert gate.accept(token) and not gate.reasoning_ended and not gate.is_complete
    assert gate.accept(4) and gate.reasoning_ended and inner.accepted == []
    assert gate.token_bitmask()[0] == 1 << 7
    assert not gate.accept(8)  # the grammar decides now
    inner.accepted.clear()
    assert gate.accept(7) and gate.is_complete


def test_a_grammar_given_up_stops_the_reasoning_too():
    gate = AfterReasoningGrammar(FakeGrammar(), [3], vocab_size=64)
    gate.fail("too slow")
    assert gate.failure == "too slow" and not gate.accept(1)


@pytest.mark.parametrize("ids", [[], [-1], ["3"], 3])
def test_the_end_tokens_must_be_token_ids(ids):
    with pytest.raises(SamplingParamsError, match="reasoning_end_token_ids"):
        StructuredOutputsParams(regex="a", reasoning_end_token_ids=ids)

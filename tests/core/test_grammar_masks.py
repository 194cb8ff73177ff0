"""Token masks filled beside the engine loop: every mask within the bounds comes back; a mask
past the wall-time or CPU-time bound, or one that raises, gives its request up alone; the
threads still finishing given-up fills are capped; a filler shut down refuses new fills."""

from __future__ import annotations

import threading
import time

import pytest

from tokenmill import structured_output
from tokenmill.core.grammar_masks import GrammarMaskFiller


class FakeGrammar:
    """A mask that blocks until ``gate`` opens, or spins ``cpu_s`` of CPU time first."""

    def __init__(self, mask: str, gate: threading.Event | None = None, cpu_s: float = 0.0):
        self.mask, self.gate, self.cpu_s = mask, gate, cpu_s
        self.threads: list[str] = []

    def token_bitmask(self) -> str:
        self.threads.append(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        start = time.thread_time()
        while time.thread_time() - start < self.cpu_s:
            pass
        if self.mask == "raise":
            raise RuntimeError("bitmask shape mismatch")
        return self.mask


def test_masks_come_back_for_every_request():
    filler = GrammarMaskFiller(max_workers=2)
    try:
        grammars = {f"r{i}": FakeGrammar(f"m{i}") for i in range(20)}
        for _ in range(3):  # the same threads serve later steps
            masks, given_up = filler.fill(grammars)
            assert masks == {f"r{i}": f"m{i}" for i in range(20)} and given_up == {}
        assert filler.fill({}) == ({}, {})
        used = {name for g in grammars.values() for name in g.threads}
        assert len(used) <= 2 and threading.current_thread().name not in used
    finally:
        filler.shutdown()


def test_a_mask_past_the_wall_bound_gives_up_its_request_alone():
    """One worker: the stuck fill is given up and a new thread fills the masks queued behind
    it, in this step and the next, while the stuck one still runs."""
    gate = threading.Event()
    filler = GrammarMaskFiller(max_workers=1, max_wall_s=0.05)
    try:
        stuck = FakeGrammar("never", gate=gate)
        masks, given_up = filler.fill({"stuck": stuck, "a": FakeGrammar("ma")})
        assert masks == {"a": "ma"}
        assert list(given_up) == ["stuck"] and "too costly to follow" in given_up["stuck"]
        assert "over 50 ms" in given_up["stuck"]
        masks, given_up = filler.fill({"b": FakeGrammar("mb")})
        assert masks == {"b": "mb"} and given_up == {}
    finally:
        gate.set()
        filler.shutdown()


def test_a_mask_past_the_cpu_bound_or_raising_gives_up_its_request(monkeypatch):
    monkeypatch.setattr(structured_output, "MAX_MASK_S", 0.005)
    filler = GrammarMaskFiller(max_workers=2)
    try:
        grammars = {
            "costly": FakeGrammar("mc", cpu_s=0.02),
            "broken": FakeGrammar("raise"),
            "fine": FakeGrammar("mf"),
        }
        masks, given_up = filler.fill(grammars)
        assert masks == {"fine": "mf"}
        assert "of CPU time (at most 5 ms" in given_up["costly"]
        assert given_up["broken"] == "the token mask failed: bitmask shape mismatch"
    finally:
        filler.shutdown()


def test_threads_given_up_beyond_the_cap_are_not_replaced_until_one_ends():
    """Costly constraints sent together take at most max_workers + max_retired threads: past
    that, masks wait for a given-up fill to end instead of starting another thread."""
    gates = [threading.Event(), threading.Event()]
    filler = GrammarMaskFiller(max_workers=1, max_wall_s=0.05, max_retired=1)
    try:
        for i, gate in enumerate(gates):
            masks, given_up = filler.fill({f"stuck{i}": FakeGrammar("never", gate=gate)})
            assert masks == {} and list(given_up) == [f"stuck{i}"]
        result = {}
        waiting = threading.Thread(
            target=lambda: result.update(filler.fill({"a": FakeGrammar("ma")})[0])
        )
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive() and result == {}
        gates[0].set()
        waiting.join(10)
        assert result == {"a": "ma"}
    finally:
        for gate in gates:
            gate.set()
        filler.shutdown()


def test_a_filler_shut_down_refuses_new_fills():
    filler = GrammarMaskFiller(max_workers=1)
    assert filler.fill({"a": FakeGrammar("ma")}) == ({"a": "ma"}, {})
    filler.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        filler.fill({"b": FakeGrammar("mb")})

"""Token masks filled beside the engine loop: every mask within the bounds comes back, and a
mask past the wall-time or CPU-time bound, or one that raises, gives its request up alone."""

from __future__ import annotations

import threading
import time

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

"""Token masks filled in worker processes: every mask within the bounds comes back; a mask
past the wall-time bound kills its worker (the fill stops) and gives its request up alone,
the others moving to a fresh worker with their tokens; one past the CPU bound gives its
request up; finished requests' matchers are dropped."""

from __future__ import annotations

import numpy as np
import psutil

from tests.core.grammar_fakes import FakeGrammar, start_fake_worker
from tokenmill.core import grammar_masks
from tokenmill.core.grammar_masks import GrammarMaskFiller


def as_lists(masks: dict) -> dict:
    return {k: v.tolist() for k, v in masks.items()}


def test_masks_come_back_for_every_request_with_the_tokens_accepted_so_far():
    filler = GrammarMaskFiller(start_fake_worker, max_workers=2)
    try:
        grammars = {f"r{i}": FakeGrammar([i]) for i in range(6)}
        grammars["new"] = FakeGrammar(first_mask=np.array([7]))  # from its compile
        masks, given_up = filler.fill(grammars)
        assert given_up == {} and masks.pop("new").tolist() == [7]
        assert as_lists(masks) == {f"r{i}": [i] for i in range(6)}
        for g in grammars.values():
            g.accepted.append(9)
        masks, _ = filler.fill(grammars)  # only the new token crosses
        assert as_lists(masks)["r3"] == [3, 9] and as_lists(masks)["new"] == [9]
        assert len({w.process.pid for w in filler._workers}) == 2
        filler.forget({"r0"})
        assert list(filler._home) == ["r0"]
        assert filler.fill({}) == ({}, {})
    finally:
        filler.shutdown()


def test_a_mask_past_the_wall_bound_kills_its_worker_and_gives_up_its_request_alone():
    """One worker: the stuck fill is given up, its worker killed; the masks queued behind it
    and the worker's other requests move to a fresh worker with every accepted token."""
    filler = GrammarMaskFiller(start_fake_worker, max_workers=1, max_wall_s=0.3)
    try:
        grammars = {"a": FakeGrammar([1]), "b": FakeGrammar([2])}
        filler.fill(grammars)
        [old] = filler._workers
        grammars["a"].accepted.append(3)
        stuck = {"sleep": FakeGrammar([5]), "a": grammars["a"]}
        masks, given_up = filler.fill(stuck)
        assert as_lists(masks) == {"a": [1, 3]}
        assert list(given_up) == ["sleep"] and "over 300 ms" in given_up["sleep"]
        assert "too costly to follow" in given_up["sleep"]
        [new] = filler._workers
        assert new is not old and not _running(old.process.pid)
        grammars["b"].accepted.append(4)
        masks, given_up = filler.fill({"b": grammars["b"]})  # rebuilt on the new worker
        assert as_lists(masks) == {"b": [2, 4]} and given_up == {}
    finally:
        filler.shutdown()


def _running(pid: int | None) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_mask_past_the_cpu_bound_gives_up_its_request(monkeypatch):
    """60 ms of CPU against a 10 ms bound; the wall bound is out of the way, so that a busy
    machine (the spin taking seconds of wall time) still tests the CPU bound."""
    monkeypatch.setattr(grammar_masks, "MAX_MASK_S", 0.01)
    filler = GrammarMaskFiller(start_fake_worker, max_workers=1, max_wall_s=60.0)
    try:
        masks, given_up = filler.fill({"spin": FakeGrammar([1]), "fine": FakeGrammar([2])})
        assert as_lists(masks) == {"fine": [2]}
        assert "of CPU time (at most 10 ms" in given_up["spin"]
        assert "spin" not in filler._home
    finally:
        filler.shutdown()

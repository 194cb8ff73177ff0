"""The router's routing rules and prompt segmentation, without I/O."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tokenmill.router.backends import normalize_url
from tokenmill.router.policy import (
    PrefixAwarePolicy,
    RoutingKey,
    RoutingPolicy,
    SessionPolicy,
    make_policy,
)
from tokenmill.router.proxy import prompt_segments


@dataclass
class FakeBackend:
    url: str
    in_flight: int = 0


def backends(n: int = 3) -> list[FakeBackend]:
    return [FakeBackend(f"http://b{i}") for i in range(n)]


def chat(*contents: str) -> RoutingKey:
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return RoutingKey("m", prompt_segments({"messages": messages}, 64))


def test_round_robin_takes_backends_in_turn():
    pool = backends()
    policy = RoutingPolicy()
    assert [policy.choose(RoutingKey(), pool).backend for _ in range(6)] == [
        b.url for b in pool * 2
    ]


def test_prefix_keeps_a_conversation_and_spreads_new_ones():
    pool = backends()
    policy = PrefixAwarePolicy()
    first = [policy.choose(chat(f"question {i}"), pool) for i in range(3)]
    assert len({d.backend for d in first}) == 3  # nothing shared: least loaded, in turn
    assert all(d.reason == "load" for d in first)
    for i, d in enumerate(first):
        later = policy.choose(chat(f"question {i}", "an answer", "a follow-up"), pool)
        assert later.backend == d.backend and later.reason == "prefix"
        assert later.matched_chars == len(f"user\nquestion {i}")


def test_prefix_gives_way_to_load():
    pool = backends(2)
    policy = PrefixAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    owner = policy.choose(chat("hello"), pool).backend
    busy = next(b for b in pool if b.url == owner)
    busy.in_flight = 4  # 4 above the other: not past the threshold
    assert policy.choose(chat("hello", "hi", "more"), pool).backend == owner
    busy.in_flight = 5  # past both thresholds: the other backend takes it, and keeps it
    moved = policy.choose(chat("hello", "hi", "more"), pool)
    assert moved.backend != owner and moved.reason == "load"
    assert policy.choose(chat("hello", "hi", "more", "ok", "again"), pool).backend == moved.backend


def test_prefix_ignores_backends_that_left():
    pool = backends()
    policy = PrefixAwarePolicy()
    owner = policy.choose(chat("hello"), pool).backend
    rest = [b for b in pool if b.url != owner]
    assert policy.choose(chat("hello", "hi", "again"), rest).backend != owner
    policy.forget(owner)
    assert owner not in policy._owner.values()


def test_prefix_models_do_not_share():
    pool = backends()
    policy = PrefixAwarePolicy()
    a = policy.choose(RoutingKey("a", ("x" * 64,)), pool)
    b = policy.choose(RoutingKey("b", ("x" * 64,)), pool)
    assert b.reason == "load" and a.backend != b.backend


def test_prefix_memory_is_bounded():
    policy = PrefixAwarePolicy(max_blocks=10)
    for i in range(20):
        policy.choose(chat(f"q{i}", "a", "b"), backends())
    assert len(policy._owner) == 10


def test_session_sticks_and_only_moves_when_its_backend_leaves():
    pool = backends(4)
    policy = SessionPolicy()
    homes = {s: policy.choose(RoutingKey(session=s), pool).backend for s in map(str, range(40))}
    assert len(set(homes.values())) > 1
    assert all(policy.choose(RoutingKey(session=s), pool).backend == h for s, h in homes.items())
    gone = pool[0].url
    rest = pool[1:]
    for session, home in homes.items():
        now = policy.choose(RoutingKey(session=session), rest).backend
        assert now == home or home == gone  # rendezvous hashing: only the gone one's move
    assert policy.choose(RoutingKey(), pool).reason == "load"  # no session header


def test_prompt_segments():
    assert prompt_segments({"prompt": "a" * 130}, 64) == ("a" * 64, "a" * 64)
    assert prompt_segments({"prompt": ["x" * 64, "y"]}, 64) == ("x" * 64,)
    assert prompt_segments({"prompt": [1, 2, 3]}, 4) == ("[1, ", "2, 3")
    parts = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    assert prompt_segments({"messages": [parts]}, 64) == ("user\nhi",)
    assert prompt_segments({"system": "be brief", "messages": [parts]}, 64) == (
        "system\nbe brief",
        "user\nhi",
    )
    assert prompt_segments({"input": "z" * 64}, 64) == ("z" * 64,)
    assert prompt_segments({"model": "m"}, 64) == ()
    assert prompt_segments(["not", "a", "dict"], 64) == ()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown routing logic"):
        make_policy("random")
    with pytest.raises(ValueError, match="not an http"):
        normalize_url("ftp://host")
    assert normalize_url("host:8000/") == "http://host:8000"

"""``tokenmill router`` in front of three CPU replicas of the embedded model.

Checked on the replicas' own metrics: each of three ten-turn conversations is served by one
replica, whose prefix cache then hits the earlier turns, and the three go to different
replicas (balanced while idle); a streamed response reaches the client while the replica
still generates it; a client that leaves aborts its request on the replica; a replica that
stops drops out and its conversation moves on to another one.
"""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOPICS = (
    "the history of lighthouses on rocky coasts",
    "how bees choose a place for a new hive",
    "why bread rises when yeast is added",
)
TURNS = 10


def counters(replica) -> dict[str, float]:
    m = replica.metrics()
    return {
        "prompt": m["tokenmill:prompt_tokens_total"],
        "queries": m["tokenmill:prefix_cache_queries_total"],
        "hits": m["tokenmill:prefix_cache_hits_total"],
        "running": m["tokenmill:num_requests_running"],
        "aborted": m["tokenmill:request_success_total{finished_reason=abort}"],
    }


def chat_turn(router, messages: list[dict[str, str]], session: httpx.Client) -> str:
    response = session.post(
        router.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def converse(router, topic: str, turns: int, messages=None) -> list[dict[str, str]]:
    messages = messages if messages is not None else []
    with httpx.Client() as session:
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Tell me about {topic}, part {turn}."})
            messages.append({"role": "assistant", "content": chat_turn(router, messages, session)})
    return messages


def served_by(replicas, before, after) -> list[int]:
    """Indices of the replicas that prefilled prompt tokens between two snapshots."""
    return [i for i in range(len(replicas)) if after[i]["prompt"] > before[i]["prompt"]]


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


def test_conversations_stay_on_one_replica_each(replicas, router):
    used = []
    for topic in TOPICS:
        before = [counters(r) for r in replicas]
        converse(router, topic, TURNS)
        after = [counters(r) for r in replicas]
        owners = served_by(replicas, before, after)
        assert len(owners) == 1, (topic, before, after)
        delta = {k: after[owners[0]][k] - before[owners[0]][k] for k in ("queries", "hits")}
        # turns 2..10 find the earlier turns in that replica's prefix cache
        assert delta["hits"] > 0.4 * delta["queries"], delta
        used.append(owners[0])
    assert len(set(used)) == len(TOPICS), used  # three idle replicas: one conversation each
    metrics = httpx.get(router.url + "/metrics").text
    assert 'tokenmill:router_routing_decisions_total{backend="' in metrics
    assert 'reason="prefix"' in metrics


def test_stream_passes_through_token_by_token(replicas, router):
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 48,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    chunks = 0
    running_at_first_chunk = None
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks += 1
            if chunks == 1:  # the replica is still generating the other 47 tokens
                running_at_first_chunk = sum(counters(r)["running"] for r in replicas)
    assert chunks >= 40
    assert running_at_first_chunk == 1


def test_client_disconnect_aborts_on_the_replica(replicas, router):
    before = [counters(r) for r in replicas]
    body = {
        "model": MODEL,
        "prompt": "Count slowly:",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first token

    def all_idle() -> bool:
        # A replica reports an abort with its next step: give each one a step to take.
        for replica in replicas:
            replica.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        return sum(counters(r)["running"] for r in replicas) == 0

    wait_for(all_idle)
    after = [counters(r) for r in replicas]
    assert sum(a["aborted"] - b["aborted"] for a, b in zip(after, before, strict=True)) == 1


def test_stopped_replica_drops_out(replicas, router):
    before = [counters(r) for r in replicas]
    messages = converse(router, "a conversation about rivers", 2)
    owner = served_by(replicas, before, [counters(r) for r in replicas])
    assert len(owner) == 1
    stopped = replicas[owner[0]]
    stopped.stop()
    others = [r for r in replicas if r is not stopped]
    before = [counters(r) for r in others]
    converse(router, "a conversation about rivers", 2, messages)  # goes on elsewhere
    assert len(served_by(others, before, [counters(r) for r in others])) == 1

    def stopped_is_unhealthy() -> bool:
        backends = httpx.get(router.url + "/router/backends").json()["backends"]
        return not next(b for b in backends if b["url"] == stopped.url)["healthy"]

    wait_for(stopped_is_unhealthy)
    assert httpx.get(router.url + "/health").status_code == 200

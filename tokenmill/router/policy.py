"""Routing policies: which healthy backend serves a request.

Plain Python, no I/O: a policy sees the request's routing key (its prompt text, its session
header) and the backends' health and in-flight counts, and returns a ``Decision``.

- ``roundrobin``: healthy backends in turn.
- ``session``: requests with the same session header go to the same backend, chosen by
  rendezvous hashing (Thaler and Ravishankar, "Using Name-Based Mappings to Increase Hit
  Rates", 1998): when a backend leaves, only its sessions move. Requests without the header
  go to the least loaded backend.
- ``prefixaware``: the request's prompt is a sequence of segments — each chat message, or
  each ``block_chars`` characters of a completion prompt (``proxy.prompt_segments``) — whose
  chained hashes (a segment's hash covers every segment before it and the model's name, as
  the engine's KV block hashes do) map to the backend that last served them. A request goes
  to the backend holding its longest matching prefix, unless that backend is overloaded
  against the least loaded one (SGLang's cache-aware rule: more than
  ``balance_abs_threshold`` requests more in flight *and* more than
  ``balance_rel_threshold`` times as many); else, and without a match, to the least loaded
  backend. Either way the request's segments then map to the chosen backend, so a
  conversation, whose every turn repeats the messages of the last one, stays where its KV
  cache is, while conversations that share nothing are spread over idle backends.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

ROUTING_LOGICS = ("roundrobin", "session", "prefixaware")


class BackendView(Protocol):
    """What a policy reads of a backend."""

    url: str
    in_flight: int


@dataclass(frozen=True)
class RoutingKey:
    """What a policy may route on.

    Attributes:
        model: the requested model's name (prefixes of different models never match).
        segments: the request's prompt in order: chat messages (role and content), or
            blocks of a completion prompt's text; empty without a prompt.
        session: the session header's value, if the request carried one.
    """

    model: str = ""
    segments: tuple[str, ...] = ()
    session: str | None = None


@dataclass(frozen=True)
class Decision:
    """A routing decision.

    Attributes:
        backend: the chosen backend's URL.
        reason: ``prefix`` (longest cached prefix), ``session``, ``roundrobin`` or ``load``
            (least loaded), for metrics and logs.
        matched_chars: characters of the prompt's segments found in the prefix map.
    """

    backend: str
    reason: str
    matched_chars: int = 0


class RoutingPolicy:
    """Round-robin, and the base of the others (least-loaded choice with a rotating tie
    break, so equal backends take new work in turn)."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, key: RoutingKey, backends: Sequence[BackendView]) -> Decision:
        """The backend for a request, among ``backends`` (healthy, non-empty)."""
        return Decision(self._next(backends).url, "roundrobin")

    def _next(self, backends: Sequence[BackendView]) -> BackendView:
        return backends[next(self._counter) % len(backends)]

    def least_loaded(self, backends: Sequence[BackendView]) -> BackendView:
        """The backend with the fewest requests in flight; ties go round the ring."""
        low = min(b.in_flight for b in backends)
        idle = [b for b in backends if b.in_flight == low]
        return self._next(idle)


class SessionPolicy(RoutingPolicy):
    """The same backend for the same session, by rendezvous hashing."""

    def choose(self, key: RoutingKey, backends: Sequence[BackendView]) -> Decision:
        if key.session is None:
            return Decision(self.least_loaded(backends).url, "load")
        best = max(backends, key=lambda b: _weight(key.session or "", b.url))
        return Decision(best.url, "session")


def _weight(session: str, url: str) -> bytes:
    return hashlib.blake2b(f"{session}\0{url}".encode(), digest_size=8).digest()


class PrefixAwarePolicy(RoutingPolicy):
    """Longest cached prompt prefix, balanced against load (see the module docstring).

    Args:
        max_blocks: the most segment hashes remembered (least recently used ones go first).
        balance_abs_threshold: a matched backend with more than this many requests in flight
            above the least loaded one may be passed over...
        balance_rel_threshold: ...if it also has more than this many times as many.
    """

    def __init__(
        self,
        max_blocks: int = 1 << 18,
        balance_abs_threshold: int = 16,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        super().__init__()
        if max_blocks < 1:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._owner: OrderedDict[int, str] = OrderedDict()  # block hash -> backend URL

    @staticmethod
    def segment_hashes(key: RoutingKey) -> list[int]:
        """Chained hashes of ``key``'s segments, the first seeded with the model's name.

        NOTE: Python's ``hash`` of strings is salted per process, which is enough for a map
        that lives in one process; a collision costs a cache miss, not a wrong answer.
        """
        hashes: list[int] = []
        parent = hash(key.model)
        for segment in key.segments:
            parent = hash((parent, segment))
            hashes.append(parent)
        return hashes

    def choose(self, key: RoutingKey, backends: Sequence[BackendView]) -> Decision:
        hashes = self.segment_hashes(key)
        by_url = {b.url: b for b in backends}
        matched, owner, chars = 0, None, 0
        for block_hash, segment in zip(hashes, key.segments, strict=True):
            url = self._owner.get(block_hash)
            if url is None:
                break
            chars += len(segment)
            if url in by_url:  # (a segment of a backend that left is no match)
                matched, owner = chars, by_url[url]
        if owner is not None and not self._overloaded(owner, backends):
            decision = Decision(owner.url, "prefix", matched)
        else:
            decision = Decision(self.least_loaded(backends).url, "load")
        self._remember(hashes, decision.backend)
        return decision

    def _overloaded(self, backend: BackendView, backends: Sequence[BackendView]) -> bool:
        low = min(b.in_flight for b in backends)
        return (
            backend.in_flight - low > self.balance_abs_threshold
            and backend.in_flight > low * self.balance_rel_threshold
        )

    def _remember(self, hashes: list[int], url: str) -> None:
        owner = self._owner
        for block_hash in hashes:
            owner[block_hash] = url
            owner.move_to_end(block_hash)
        while len(owner) > self.max_blocks:
            owner.popitem(last=False)

    def forget(self, url: str) -> None:
        """Drop every block of a backend that left the pool."""
        for block_hash in [h for h, u in self._owner.items() if u == url]:
            del self._owner[block_hash]


def make_policy(
    logic: str,
    max_blocks: int = 1 << 18,
    balance_abs_threshold: int = 16,
    balance_rel_threshold: float = 1.5,
) -> RoutingPolicy:
    """The policy named ``logic`` (one of ROUTING_LOGICS).

    Raises:
        ValueError: an unknown name, or invalid prefix settings.
    """
    if logic == "roundrobin":
        return RoutingPolicy()
    if logic == "session":
        return SessionPolicy()
    if logic == "prefixaware":
        return PrefixAwarePolicy(max_blocks, balance_abs_threshold, balance_rel_threshold)
    raise ValueError(f"unknown routing logic {logic!r}; expected one of {ROUTING_LOGICS}")

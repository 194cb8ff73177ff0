"""The encoder cache, as the scheduler sees it, and the encoder budget of a step.

The worker keeps the vision encoder's outputs by image content hash
(``MultiModalFeature.identifier``); ``EncoderCacheManager`` mirrors which ones it holds,
decides which images a step must encode and which entries to drop (the scheduler sends
both in the ``SchedulerOutput``), and counts hits for the metrics.

Scheduling rule (vLLM's encoder budget): a step encodes images of at most
``encoder_budget`` placeholder tokens in all; an image that is not cached is never split
across two chunks: the chunk stops before it and the image is encoded whole in a later step
(with its placeholders in one chunk), unless the image starts the chunk and does not fit it
(then it is encoded whole and its remaining placeholders read the cached output next step).

With ``whole_images`` (``SchedulerConfig.disable_chunked_mm_input``), no chunk ends inside
an image, cached or not: the chunk ends before it, and a chunk that starts inside one (after
a prefix-cache hit) takes the rest of it whole, beyond the chunk's soft limits
(``long_prefill_token_threshold``, prefill pacing) if the step's token budget holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tokenmill.core.request import Request


@dataclass
class EncoderStep:
    """The encoder work a step has planned so far."""

    budget: int
    # request id -> indices (into request.mm_features) of the images it encodes this step
    inputs: dict[str, list[int]] = field(default_factory=dict)
    # identifiers read or encoded this step: they may not be evicted by it
    pinned: set[str] = field(default_factory=set)
    # identifier -> (request id, index) of the requests that read it this step, encoded
    # by another request of the step or cached
    readers: dict[str, list[tuple[str, int]]] = field(default_factory=dict)


class EncoderCacheManager:
    """Which encoder outputs the worker holds, LRU-evicted within ``capacity`` tokens
    (rows of encoder output).

    Args:
        capacity: placeholder tokens the cache holds (an image larger than that is still
            encoded, and held alone).
        encoder_budget: placeholder tokens of the images one step may encode.
        whole_images: never end a chunk inside an image (module docstring).
    """

    def __init__(self, capacity: int, encoder_budget: int, whole_images: bool = False) -> None:
        self.capacity = capacity
        self.encoder_budget = encoder_budget
        self.whole_images = whole_images
        self._entries: OrderedDict[str, int] = OrderedDict()  # id -> tokens, LRU first
        self._used = 0
        self._freed: list[str] = []
        self.queries = self.hits = 0  # images looked up / found, since the last stats

    def begin_step(self) -> EncoderStep:
        return EncoderStep(self.encoder_budget)

    def contains(self, identifier: str) -> bool:
        return identifier in self._entries

    def clip(
        self, request: Request, num_computed: int, num_new: int, step: EncoderStep,
        token_budget: int | None = None,
    ) -> tuple[int, list[int]]:  # fmt: skip
        """Shorten a chunk ``[num_computed, num_computed + num_new)`` of ``request`` to the
        rule above (with ``whole_images``, possibly lengthen it, to at most
        ``token_budget`` tokens: what the step has left; ``num_new`` when None).

        Returns:
            ``(tokens to schedule, indices of the images to encode for them)``: the chunk
            as it is for a request without images.
        """
        if not request.mm_features or num_new == 0:
            return num_new, []
        to_encode: list[int] = []
        encoding: set[str] = set()  # an image repeated in the prompt is encoded once
        budget = step.budget
        end = num_computed + num_new
        if self.whole_images:
            end = self._whole_image_end(request, num_computed, end, token_budget or num_new)
            if end == num_computed:
                return 0, []
        # The cached outputs the chunk reads may not make room for the ones it encodes.
        keep = step.pinned | self._read_by(request, num_computed, end)
        for i, f in enumerate(request.mm_features):
            if f.offset >= end:
                break
            if f.end <= num_computed or f.identifier in step.pinned | encoding:
                continue
            if self.contains(f.identifier):
                continue
            starts_chunk = f.offset <= num_computed
            fits = f.end <= end and f.length <= budget and self._fits(f.length, keep)
            if not fits and not (starts_chunk and not to_encode and budget == self.encoder_budget):
                end = max(f.offset, num_computed)
                break
            to_encode.append(i)
            encoding.add(f.identifier)
            budget -= f.length
        return end - num_computed, to_encode

    @staticmethod
    def _whole_image_end(request: Request, num_computed: int, end: int, token_budget: int) -> int:
        """The chunk's end moved off any image it would end inside: before the image, or
        past it where the chunk starts inside it and ``token_budget`` allows (else the chunk
        is empty)."""
        for f in request.mm_features:
            if f.offset >= end:
                break
            if f.end <= end or f.end <= num_computed:
                continue
            if f.offset > num_computed:
                return f.offset
            return f.end if f.end - num_computed <= token_budget else num_computed
        return end

    def commit(
        self, request: Request, num_computed: int, num_new: int, to_encode: list[int],
        step: EncoderStep,
    ) -> None:  # fmt: skip
        """Record a scheduled chunk: count lookups, pin what it reads, allocate what it
        encodes (nothing for a request without images)."""
        end = num_computed + num_new
        # Pinned before anything is allocated: encoding an image of the chunk must not
        # evict an output that a later image of the same chunk reads.
        step.pinned |= self._read_by(request, num_computed, end)
        for i, f in enumerate(request.mm_features):
            if f.offset >= end:
                break
            if f.end <= num_computed:
                continue
            if f.offset >= num_computed:  # its first chunk: one lookup per image
                self.queries += 1
                self.hits += self.contains(f.identifier) and i not in to_encode
            # (Not cached although the chunk was planned to read it: the request that
            # was to encode it was preempted meanwhile; this one encodes it.)
            if i in to_encode or not self.contains(f.identifier):
                self._allocate(f.identifier, f.length, step.pinned)
                step.budget -= f.length
                step.inputs.setdefault(request.request_id, []).append(i)
            else:
                self._entries.move_to_end(f.identifier)
                step.readers.setdefault(f.identifier, []).append((request.request_id, i))
            step.pinned.add(f.identifier)

    def uncommit(self, request: Request, step: EncoderStep) -> None:
        """A request scheduled earlier in the step is preempted: the images it was to
        encode are encoded for a request of the step that reads them, or not at all (nor
        held by the worker)."""
        for readers in step.readers.values():
            readers[:] = [r for r in readers if r[0] != request.request_id]
        for i in step.inputs.pop(request.request_id, []):
            f = request.mm_features[i]
            readers = step.readers.get(f.identifier)
            if readers:
                req_id, index = readers.pop(0)
                step.inputs.setdefault(req_id, []).append(index)
                continue
            if self._entries.pop(f.identifier, None) is not None:
                self._used -= f.length
            step.pinned.discard(f.identifier)
            step.budget += f.length

    def take_freed(self) -> list[str]:
        """Identifiers evicted since the last call (the worker drops them)."""
        freed, self._freed = self._freed, []
        return freed

    def reset(self) -> None:
        self._freed.extend(self._entries)
        self._entries.clear()
        self._used = 0

    def _read_by(self, request: Request, start: int, end: int) -> set[str]:
        """The cached outputs that the chunk ``[start, end)`` of ``request`` reads."""
        return {
            f.identifier for f in request.mm_features
            if f.offset < end and f.end > start and f.identifier in self._entries
        }  # fmt: skip

    def _fits(self, size: int, keep: set[str]) -> bool:
        evictable = sum(n for k, n in self._entries.items() if k not in keep)
        return self._used - evictable + size <= self.capacity

    def _allocate(self, identifier: str, size: int, pinned: set[str]) -> None:
        for key in list(self._entries):
            if self._used + size <= self.capacity:
                break
            if key not in pinned:
                self._used -= self._entries.pop(key)
                self._freed.append(key)
        self._entries[identifier] = size
        self._used += size

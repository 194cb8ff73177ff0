"""Building blocks of the paged KV cache: block hashes, the block record and the free list.

A KV block holds the keys and values of ``block_size`` consecutive tokens of one sequence
(PagedAttention, Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention"). A *full* block is identified for prefix caching by its block
hash: sha256 over the parent block's hash, the block's token ids and extra keys (a cache
salt, later a LoRA id). Chaining through the parent makes the hash stand for the whole
prefix up to and including the block, so equal hashes mean equal prefixes.

Torch-free: this module reasons about token ids and block ids only.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.core.request import Request

BlockHash = bytes
"""A 32-byte sha256 digest naming a full block and, through its parent, the whole prefix."""

# The parent of a sequence's first block. Any fixed 32 bytes serve; a digest of a
# product-specific string keeps it obviously distinct from a real block hash.
_ROOT_PARENT_HASH: BlockHash = hashlib.sha256(b"tokenmill.prefix-cache.root").digest()

# Type tags of the extra-key encoding (one byte each).
_TAG_NONE, _TAG_BOOL, _TAG_INT, _TAG_STR, _TAG_BYTES, _TAG_TUPLE = b"NBISYT"


def _encode_extra_key(key: object) -> bytes:
    """A self-delimiting byte encoding of one extra key (type tag, length, payload).

    Stable across processes and Python versions (unlike ``hash()`` or ``pickle``), and
    unambiguous: distinct key tuples never encode to the same bytes.

    Raises:
        TypeError: the key is not None, bool, int, str, bytes or a tuple of those.
    """
    if key is None:
        return bytes([_TAG_NONE])
    if isinstance(key, bool):
        return bytes([_TAG_BOOL, int(key)])
    if isinstance(key, int):
        payload = str(key).encode("ascii")
        tag = _TAG_INT
    elif isinstance(key, str):
        payload = key.encode("utf-8")
        tag = _TAG_STR
    elif isinstance(key, bytes):
        payload = key
        tag = _TAG_BYTES
    elif isinstance(key, tuple):
        payload = b"".join(_encode_extra_key(k) for k in key)
        tag = _TAG_TUPLE
    else:
        raise TypeError(f"unsupported prefix-cache extra key {key!r} of type {type(key)}")
    return bytes([tag]) + struct.pack("<Q", len(payload)) + payload


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """Hash one full block for the prefix cache.

    The digest is sha256 (FIPS 180-4) over: the parent block's hash (or a fixed root seed
    for a sequence's first block), the number of tokens and the token ids as int32
    little-endian, then a tagged encoding of ``extra_keys``. sha256 is collision
    resistant, so a hit can be trusted without comparing the token ids.

    Args:
        parent_block_hash: hash of the previous block of the sequence; None for the first.
        token_ids: the block's ``block_size`` token ids (each in [-2**31, 2**31)).
        extra_keys: values that must also match for two blocks to share KV (cache salt,
            LoRA id); None or ``()`` when there are none.

    Returns:
        The 32-byte digest.

    Raises:
        struct.error: a token id does not fit in int32.
        TypeError: an extra key has an unsupported type.
    """
    hasher = hashlib.sha256()
    hasher.update(parent_block_hash if parent_block_hash is not None else _ROOT_PARENT_HASH)
    hasher.update(struct.pack(f"<I{len(token_ids)}i", len(token_ids), *token_ids))
    hasher.update(_encode_extra_key(tuple(extra_keys) if extra_keys else ()))
    return hasher.digest()


def _first_block_keys(request: Request) -> tuple | None:
    """The first block's extra keys: the cache salt and the LoRA adapter id, when set."""
    keys: tuple = ()
    if request.cache_salt:
        keys += (request.cache_salt,)
    lora_id = getattr(request, "lora_int_id", 0)
    if lora_id:
        keys += (("lora", lora_id),)
    return keys or None


def update_block_hashes(request: Request, block_size: int) -> None:
    """Append to ``request.block_hashes`` the hashes of its full blocks not hashed yet.

    Full blocks are taken over ``request.all_token_ids`` (prompt and output), so the
    cost is O(new full blocks). The first block's extra keys hold ``request.cache_salt``
    when it is set and the request's LoRA adapter id when it has one, which separates the
    prefix caches of different salts and adapters entirely (every later block chains from
    the first): two adapters never share KV. A block holding image placeholders has the
    images' content hashes among its extra keys.

    Args:
        request: the request; its ``block_hashes`` grows in place.
        block_size: tokens per KV block.
    """
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    if len(hashes) >= num_full_blocks:
        return
    token_ids = request.all_token_ids
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full_blocks):
        start = i * block_size
        keys: list[object] = list(_first_block_keys(request) or ()) if i == 0 else []
        # The images whose placeholders the block holds: two prompts with the same
        # placeholder tokens but different images never share KV.
        keys += [
            f.identifier
            for f in request.mm_features
            if f.offset < start + block_size and f.end > start
        ]
        parent = hash_block_tokens(
            parent, token_ids[start : start + block_size], tuple(keys) if keys else None
        )
        hashes.append(parent)


class KVCacheBlock:
    """One KV block's bookkeeping (the KV tensors themselves live on the worker).

    Attributes:
        block_id: index of the block in the KV cache tensors, in [0, num_blocks).
        ref_cnt: number of requests whose block table holds the block; 0 means the block
            is in the free queue (and may still hold a cached prefix until evicted).
        block_hash: the block's hash while it is in the prefix cache; None otherwise
            (partly filled, not cached yet, or evicted).
        prev_free_block: previous node of the free queue (None when not in it).
        next_free_block: next node of the free queue (None when not in it).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeKVCacheBlockQueue:
    """The free blocks, in eviction order: an intrusive doubly-linked list.

    The links live in the blocks themselves, so removing a block from the middle (a
    prefix-cache hit on a free block) is O(1), as are popping the head (the least recently
    used block, evicted first) and appending at the tail. Sentinel head and tail nodes keep
    every operation free of end-of-list cases.

    Args:
        blocks: the initially free blocks, head (evicted first) to tail.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (least recently freed) block.

        Raises:
            ValueError: the queue is empty.
        """
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free KV cache block left")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the ``n`` head blocks, head first.

        Raises:
            ValueError: fewer than ``n`` blocks are free (nothing is removed then).
        """
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free KV cache blocks, only {self.num_free_blocks}")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Remove ``block`` from wherever it is in the queue, in O(1).

        Raises:
            ValueError: the block is not in the queue.
        """
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"{block} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last).

        Raises:
            ValueError: the block is already in the queue.
        """
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append ``blocks`` at the tail in the given order."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks head to tail (O(n); for tests and integrity checks)."""
        blocks = []
        node = self._head.next_free_block
        # Bounded walk: a corrupted (cyclic) list must not hang an integrity check.
        while node is not None and node is not self._tail and len(blocks) <= self.num_free_blocks:
            blocks.append(node)
            node = node.next_free_block
        return blocks

    def check_links(self) -> None:
        """Check that the list is well formed (both directions agree with the count).

        Raises:
            AssertionError: describing the first broken link found.
        """
        forward = self.get_all_free_blocks()
        assert len(forward) == self.num_free_blocks, (
            f"free queue holds {len(forward)} blocks walking forward but counts "
            f"{self.num_free_blocks}"
        )
        prev = self._head
        for block in forward:
            assert block.prev_free_block is prev, f"{block} has a broken prev link"
            prev = block
        assert self._tail.prev_free_block is prev, "free queue tail has a broken prev link"

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

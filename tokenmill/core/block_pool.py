"""BlockPool: every KV block of the cache, their ref counts, the free queue and the
prefix-cache map (block hash -> block).

A block is in exactly one of two states: in use (``ref_cnt > 0``, held by that many
requests' block tables) or free (``ref_cnt == 0``, in the free queue). A free block may
still be cached (it keeps its hash and its KV) until it is handed out again; the free
queue is ordered so that the least recently freed block is evicted first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from tokenmill.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from tokenmill.core.request import Request


class BlockPool:
    """Owns the ``num_blocks`` KV blocks: allocation, ref counting, LRU eviction, caching.

    Args:
        num_blocks: blocks in the KV cache (ids ``0 .. num_blocks - 1``).
        enable_caching: keep full blocks in the prefix cache after their requests end.
        on_evict: called with each cached free block just before it is handed out again
            (its hash and KV still intact): the offload tiers save it there.

    Raises:
        ValueError: ``num_blocks`` is not positive.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        on_evict: Callable[[KVCacheBlock], None] | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # NOTE: one block per hash. When a second block is filled with the same prefix
        # (e.g. two requests computed it before either could hit), the first one stays
        # cached and the second simply stays uncached; it is freed like any other block.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.on_evict = on_evict

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue (LRU first).

        A taken block that was still cached is evicted from the prefix cache first.

        Returns:
            The blocks, each with ``ref_cnt == 1``.

        Raises:
            ValueError: fewer than ``num_blocks`` blocks are free (nothing changes then).
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if self.on_evict is not None and block.block_hash is not None:
                self.on_evict(block)
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` into the prefix cache.

        Args:
            request: the owner; ``request.block_hashes`` must cover ``num_full_blocks``.
            blocks: the request's block table.
            num_cached_blocks: leading blocks already handled by an earlier call.
            num_full_blocks: leading blocks that are full of known tokens.
        """
        if not self.enable_caching:
            return
        assert len(request.block_hashes) >= num_full_blocks, "block hashes lag the tokens"
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a prefix-cache hit: cached already
            block_hash = request.block_hashes[i]
            if block_hash in self.cached_block_hash_to_block:
                continue  # an equal block is cached already; keep that one
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block cached under ``block_hash`` (in use or free), or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (prefix-cache hits).

        A free block (``ref_cnt == 0``) is taken out of the free queue, so it cannot be
        evicted while in use.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue's tail.

        Args:
            ordered_blocks: blocks in the order they should be evicted later; callers
                pass a request's chain tail first, so its last blocks (least likely to
                be shared) go before the prefix they extend.

        Raises:
            ValueError: a block is already free (a double free).
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop ``blocks`` from the prefix cache (their KV stays but is never matched)."""
        for block in blocks:
            self._evict(block)

    def get_num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0`` (cached or not)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (``ref_cnt > 0``), in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, if no block is in use.

        Returns:
            True if the cache was reset; False (nothing changed) when some block is in
            use, because a running request may still be matched against its blocks.
        """
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def check_integrity(self) -> None:
        """Check every invariant of the pool.

        Raises:
            AssertionError: describing the first violation found: a negative ref count,
                a malformed free queue, a block free twice or free while in use, a block
                with ref 0 missing from the free queue, or a hash map out of step with
                the blocks' hashes.
        """
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref count: {block}"
        self.free_block_queue.check_links()
        free = self.free_block_queue.get_all_free_blocks()
        free_ids = [b.block_id for b in free]
        assert len(set(free_ids)) == len(free_ids), f"a block is free twice: {free_ids}"
        for block in free:
            assert self.blocks[block.block_id] is block, f"foreign block in free queue: {block}"
            assert block.ref_cnt == 0, f"block in the free queue while in use: {block}"
        zero_ref = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert zero_ref == set(free_ids), (
            f"blocks with ref 0 {sorted(zero_ref)} differ from the free queue {sorted(free_ids)}"
        )
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"hash map entry points at {block}"
        num_hashed = sum(b.block_hash is not None for b in self.blocks)
        assert num_hashed == len(self.cached_block_hash_to_block), (
            f"{num_hashed} blocks carry a hash but the map holds "
            f"{len(self.cached_block_hash_to_block)}"
        )
        if not self.enable_caching:
            assert num_hashed == 0, "a block is cached while caching is disabled"

    def _evict(self, block: KVCacheBlock) -> None:
        """Remove ``block`` from the prefix cache if it is cached."""
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

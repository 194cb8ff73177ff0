"""KVCacheManager: per-request block tables over a BlockPool, with automatic prefix caching.

Each request holds a list of blocks (its block table): block ``i`` holds the KV of tokens
``[i * block_size, (i + 1) * block_size)``. Full blocks whose tokens are known are entered
into the prefix cache under their chained block hash, so a later request with the same
prefix (and cache salt) reuses them instead of recomputing: automatic prefix caching, as
in vLLM (the hash-chain form of RadixAttention's prefix reuse, Zheng et al. 2023,
"SGLang: Efficient Execution of Structured Language Model Programs").

NOTE: blocks are entered into the prefix cache when they are *scheduled*, before the
worker has written their KV, so a request admitted later in the same step may hit them.
That is sound because the model runs each step as one forward pass in which every layer
writes the KV of all scheduled tokens into the cache before its attention reads from it:
the hitting request reads, at each layer, KV that the same layer has just written. This is
also how the ``n`` sequences of a parallel-sampling request share their prompt: the front
end submits them as separate requests with the same prompt, the first computes the prompt
blocks and the others hit them, in the same step or later. Such a same-step hit is
recorded (``reads_step_kv``, cleared by ``begin_step``): kernels that read earlier tokens'
KV before the step's KV write has finished (the decode attention kernel as a dependent
launch) are only sound without one.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_utils import BlockHash, KVCacheBlock, update_block_hashes
from tokenmill.core.kv_offload import KVOffloadManager
from tokenmill.core.request import Request
from tokenmill.math_utils import cdiv


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters since the last snapshot (deltas).

    Attributes:
        requests: lookups made (one per admission attempt).
        queries: tokens looked up (the requests' full lengths).
        hits: of those, tokens served from the cache.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Block tables of the live requests, over one pool of KV blocks.

    Args:
        num_blocks: blocks in the KV cache.
        block_size: tokens per block.
        max_model_len: the longest context (tokens) a request may allocate.
        enable_caching: automatic prefix caching on or off.
        log_stats: count prefix-cache queries and hits.
        offload: the offload tiers behind the prefix cache (``core/kv_offload.py``), or
            None; needs ``enable_caching``.
        drop_last_hit_block: never reuse the last block of a prefix-cache hit, recompute it
            (EAGLE-style proposers: their KV at a position also depends on the next token,
            which the hitting request may not share).

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` is not positive.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        log_stats: bool = True,
        offload: KVOffloadManager | None = None,
        drop_last_hit_block: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if offload is not None and not enable_caching:
            raise ValueError("the offload tiers extend the prefix cache: enable caching")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.offload = offload
        self.block_pool = BlockPool(
            num_blocks, enable_caching, on_evict=self._offload_block if offload else None
        )
        # request id -> the blocks of its prefix found in the offload tiers by the last
        # get_computed_blocks, loaded by the allocate_slots that admits it.
        self._offload_hits: dict[str, list[BlockHash]] = {}
        self.drop_last_hit_block = drop_last_hit_block
        # request id -> its block table, in token order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> tokens its blocks were sized for (the largest allocation so far).
        self.req_to_num_allocated_tokens: dict[str, int] = {}
        # request id -> leading blocks already passed to BlockPool.cache_full_blocks.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Ids of the blocks entered into the prefix cache since ``begin_step``: the step
        # being planned writes their (last) KV.
        self._blocks_filled_this_step: set[int] = set()
        self.reads_step_kv = False

    def begin_step(self) -> None:
        """Start planning a step: forget which blocks the previous step fills, and clear
        ``reads_step_kv`` (set once a request admitted in this step hits one of the blocks
        this step fills, whose KV it would read before or while it is written)."""
        self._blocks_filled_this_step.clear()
        self.reads_step_kv = False
        self._offload_hits.clear()
        if self.offload is not None:
            self.offload.begin_step()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (cached or not)."""
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Look up the longest cached prefix of ``request`` (full blocks only).

        At most ``request.num_tokens - 1`` tokens may be hits: the last token must be
        computed to produce the logits of the next one. A request that asks for prompt
        logprobs gets no hits at all: every prompt position needs its logits computed.

        Args:
            request: a request that holds no blocks yet (new, or resumed after preemption).

        Returns:
            The hit blocks in order (not yet referenced: pass them to ``allocate_slots``)
            and the number of hit tokens (``len(blocks) * block_size``).
        """
        hits = self._cached_prefix(request)
        if hits is None:
            return [], 0
        num_hit_tokens = len(hits) * self.block_size
        if self.offload is not None:
            offloaded = self._offloaded_prefix(request, len(hits))
            self._offload_hits[request.request_id] = offloaded
            num_hit_tokens += len(offloaded) * self.block_size
        if self.log_stats:
            self.prefix_cache_stats.requests += 1
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """The tokens ``get_computed_blocks`` would find cached now, without counting the
        lookup in the prefix-cache statistics (a look ahead, not an admission)."""
        hits = self._cached_prefix(request)
        if hits is None:
            return 0
        num_offloaded = len(self._offloaded_prefix(request, len(hits))) if self.offload else 0
        return (len(hits) + num_offloaded) * self.block_size

    def _offloaded_prefix(self, request: Request, num_device_hits: int) -> list[BlockHash]:
        """The hashes of the request's blocks after its device hits that the offload tiers
        hold (the same cap: at least the last token is computed)."""
        assert self.offload is not None
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        rest = request.block_hashes[num_device_hits:max_hit_blocks]
        return self.offload.lookup(rest)

    def _cached_prefix(self, request: Request) -> list[KVCacheBlock] | None:
        """The cached blocks of the request's prefix, or None if it may not use any."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return None
        update_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.drop_last_hit_block and hits:
            hits.pop()
        return hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``request.num_computed_tokens + num_new_computed_tokens +
        num_new_tokens`` tokens in the request's block table, and for up to
        ``num_lookahead_tokens`` more within ``max_model_len`` (slots where a speculative
        proposer writes its drafts' KV).

        Prefix-cache hit blocks are referenced first, then only the missing blocks are
        taken from the pool (so a request has at most one partly filled block). Finally
        the request's full blocks of known tokens (up to ``min(that total,
        request.num_tokens)``) are entered into the prefix cache. The caller then advances
        ``request.num_computed_tokens`` by the hit and new tokens once the step is planned
        (``free`` relies on it).

        Blocks of the prefix found in the offload tiers get fresh blocks, right after the
        hits, which the worker fills from there before the step's forward pass.

        Args:
            request: the request.
            num_new_tokens: tokens to compute in this step (>= 0).
            num_new_computed_tokens: prefix-cache hit tokens (from ``get_computed_blocks``,
                offloaded ones included).
            new_computed_blocks: the hit blocks (from ``get_computed_blocks``); only for a
                request that holds no blocks yet.
            num_lookahead_tokens: slots wanted past the computed ones (never cached).

        Returns:
            The ids of the blocks added to the request's block table by this call, hit
            blocks first; None if the pool is short of blocks, in which case nothing
            changed.

        Raises:
            ValueError: negative ``num_new_tokens``, hits for a request that already
                holds blocks, hits not matching their blocks, or more than
                ``max_model_len`` tokens.
        """
        if not new_computed_blocks and num_new_computed_tokens == 0 and num_new_tokens >= 0:
            if self._allocate_in_place(request, num_new_tokens, num_lookahead_tokens):
                return []
        hit_blocks = new_computed_blocks or []
        req_id = request.request_id
        offloaded = self._offload_hits.pop(req_id, []) if num_new_computed_tokens else []
        num_device_hit_tokens = num_new_computed_tokens - len(offloaded) * self.block_size
        blocks = self.req_to_blocks.get(req_id, [])
        self._check_allocation(request, blocks, num_new_tokens, num_device_hit_tokens, hit_blocks)
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_slots = self._with_lookahead(num_tokens, num_lookahead_tokens)
        num_new_blocks = max(0, cdiv(num_slots, self.block_size) - len(blocks) - len(hit_blocks))
        # NOTE: a hit on a free block takes it out of the free pool, so it counts here.
        num_free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.block_pool.get_num_free_blocks():
            return None
        if hit_blocks and self._blocks_filled_this_step:
            filled = self._blocks_filled_this_step
            self.reads_step_kv |= any(b.block_id in filled for b in hit_blocks)
        # Touch the hits before taking new blocks, so that those cannot evict them.
        self.block_pool.touch(hit_blocks)
        load_slots = []
        if offloaded:  # before taking blocks: their evictions must not reuse these slots
            assert self.offload is not None
            load_slots = self.offload.reserve_loads(offloaded, self.block_size)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        if load_slots:
            assert self.offload is not None
            targets = [b.block_id for b in new_blocks[: len(load_slots)]]
            self.offload.add_loads(load_slots, targets)
        blocks = self.req_to_blocks.setdefault(req_id, [])
        blocks.extend(hit_blocks)
        blocks.extend(new_blocks)
        num_allocated = max(num_slots, self.req_to_num_allocated_tokens.get(req_id, 0))
        self.req_to_num_allocated_tokens[req_id] = num_allocated
        if self.enable_caching:
            self._cache_known_blocks(request, blocks, len(hit_blocks), num_tokens)
        return [b.block_id for b in hit_blocks] + [b.block_id for b in new_blocks]

    def _with_lookahead(self, num_tokens: int, num_lookahead_tokens: int) -> int:
        """Slots for ``num_tokens`` and the lookahead past them, within ``max_model_len``."""
        return max(num_tokens, min(num_tokens + num_lookahead_tokens, self.max_model_len))

    def _allocate_in_place(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> bool:
        """The common decode case of ``allocate_slots``: a request whose new tokens fit in
        the blocks it already holds. Updates its bookkeeping exactly as the general path
        would and returns True; returns False (nothing changed) when that path is needed."""
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        num_tokens = request.num_computed_tokens + num_new_tokens
        num_slots = self._with_lookahead(num_tokens, num_lookahead_tokens)
        if (
            blocks is None
            or num_slots > len(blocks) * self.block_size
            or num_tokens > self.max_model_len
        ):
            return False
        if num_slots > self.req_to_num_allocated_tokens[req_id]:
            self.req_to_num_allocated_tokens[req_id] = num_slots
        if self.enable_caching:
            # _cache_known_blocks' own test, made here: most decode steps fill no block, and
            # skipping the call is ~10% of a 512-request step's scheduling.
            num_full = min(num_tokens, request.num_tokens) // self.block_size
            if num_full > self.num_cached_blocks.get(req_id, 0):
                self._cache_known_blocks(request, blocks, 0, num_tokens)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so that its last blocks are evicted
        before the prefix they extend. A request holding no blocks is ignored.

        Blocks that were entered into the prefix cache but whose KV was never computed
        (beyond ``request.num_computed_tokens``: the request was preempted or aborted in
        the step that scheduled them) are dropped from the prefix cache first, so no later
        request can hit KV that was never written. Call this before resetting
        ``num_computed_tokens``.
        """
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, None)
        self.req_to_num_allocated_tokens.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        if blocks is None:
            return
        num_computed_blocks = request.num_computed_tokens // self.block_size
        self.block_pool.uncache_blocks(blocks[num_computed_blocks:])
        self.block_pool.free_blocks(reversed(blocks))

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """Give ``child`` (a copy of ``parent``'s tokens) ``parent``'s KV by reference.

        The full blocks of the ``parent.num_computed_tokens`` computed tokens are shared
        (one more reference each); the partly filled last block, in which the two diverge
        as soon as each appends its own token, gets a fresh block for ``child``, to be
        copied from the parent's by the worker before the next forward pass
        (copy-on-write, Kwon et al. 2023, §4.4). Blocks beyond the computed tokens are
        not shared.

        Args:
            parent: a request holding blocks.
            child: a request holding none, with ``parent``'s ``num_computed_tokens``.

        Returns:
            The (parent block id, child block id) pairs to copy (none or one); None when
            no block is free for the copy (nothing changed then).

        Raises:
            ValueError: ``parent`` holds no blocks or ``child`` already holds some.
        """
        blocks = self.req_to_blocks.get(parent.request_id)
        if blocks is None or child.request_id in self.req_to_blocks:
            raise ValueError(
                f"cannot fork {parent.request_id!r} (holds blocks: {blocks is not None}) into "
                f"{child.request_id!r}"
            )
        num_tokens = parent.num_computed_tokens
        num_full = num_tokens // self.block_size
        partial = blocks[num_full : cdiv(num_tokens, self.block_size)]
        if len(partial) > self.block_pool.get_num_free_blocks():
            return None
        shared = blocks[:num_full]
        self.block_pool.touch(shared)
        copies = self.block_pool.get_new_blocks(len(partial))
        self.req_to_blocks[child.request_id] = shared + copies
        self.req_to_num_allocated_tokens[child.request_id] = num_tokens
        self.num_cached_blocks[child.request_id] = min(
            self.num_cached_blocks.get(parent.request_id, 0), num_full
        )
        return [(p.block_id, c.block_id) for p, c in zip(partial, copies, strict=True)]

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (empty if it holds no blocks)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix-cache counters since the last call; resets them."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks, offloaded ones included; only possible (True) when no
        block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.offload is not None:
            self.offload.clear()
        return True

    def _offload_block(self, block: KVCacheBlock) -> None:
        assert self.offload is not None and block.block_hash is not None
        self.offload.store(block.block_hash, block.block_id)

    def check_integrity(self) -> None:
        """Check the pool and every block table.

        Raises:
            AssertionError: the pool is inconsistent (see ``BlockPool.check_integrity``),
                a block table's length is not ``ceil(allocated tokens / block_size)``, a
                table holds a block twice, or a block's ref count differs from the
                number of tables holding it.
        """
        self.block_pool.check_integrity()
        if self.offload is not None:
            self.offload.check_integrity()
        holders = [0] * self.num_blocks
        for req_id, blocks in self.req_to_blocks.items():
            num_tokens = self.req_to_num_allocated_tokens.get(req_id, 0)
            expected = cdiv(num_tokens, self.block_size)
            assert len(blocks) == expected, (
                f"request {req_id!r} holds {len(blocks)} blocks for {num_tokens} tokens "
                f"(expected {expected})"
            )
            ids = [b.block_id for b in blocks]
            assert len(set(ids)) == len(ids), f"request {req_id!r} holds a block twice: {ids}"
            for block in blocks:
                holders[block.block_id] += 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block} is held by {holders[block.block_id]} requests"
            )

    def _check_allocation(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_new_tokens: int,
        num_new_computed_tokens: int,
        hit_blocks: list[KVCacheBlock],
    ) -> None:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if hit_blocks and blocks:
            raise ValueError(f"request {request.request_id!r} already holds blocks; no hits")
        if num_new_computed_tokens != len(hit_blocks) * self.block_size:
            raise ValueError(
                f"{num_new_computed_tokens} hit tokens do not fill {len(hit_blocks)} blocks "
                f"of {self.block_size} tokens"
            )
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} would hold {num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )

    def _cache_known_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_hit_blocks: int, num_tokens: int
    ) -> None:
        """Enter the request's full blocks of known tokens into the prefix cache."""
        req_id = request.request_id
        num_cached = max(self.num_cached_blocks.get(req_id, 0), num_hit_blocks)
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        if num_full > num_cached:
            update_block_hashes(request, self.block_size)
            self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full)
            # Blocks whose last slot is below num_computed_tokens were written by earlier
            # steps (under async scheduling a block is cached once its last token reaches
            # the host, which can be a step after the step that wrote its KV).
            first_written = max(num_cached, request.num_computed_tokens // self.block_size)
            filled = blocks[first_written:num_full]
            self._blocks_filled_this_step.update(b.block_id for b in filled)
        self.num_cached_blocks[req_id] = max(num_cached, num_full)

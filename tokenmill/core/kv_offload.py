"""The KV cache's offload tiers: prefix-cache blocks evicted from the device live on in a
host-memory pool and, behind it, a disk file, keyed by the same block hashes.

When the block pool hands out a free block that still holds a cached prefix, the block's
KV is first copied to a host slot (``store``); when the host tier is full its least
recently used entry moves on to the disk tier (or is dropped without one), and the disk
tier drops its least recently used entry. A request whose prefix continues past the
device's prefix-cache hits into the tiers gets fresh device blocks that are filled from
there (``reserve_loads``; a disk entry passes through a host slot) instead of being
recomputed.
Each tier is LRU.

The moves are decided here and made by the worker at the start of the next step, before
its forward pass, in ``KVTransfers``' order. A slot that a move of this step reads or
writes is pinned until the next step: it cannot be evicted and reused meanwhile.

Torch-free: block hashes, block ids and slot numbers only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tokenmill.core.kv_cache_utils import BlockHash

HOST, DISK = "host", "disk"


@dataclass
class KVTransfers:
    """The KV block moves of one step, made in this order (each list by slot/block id).

    Attributes:
        host_to_disk: (host slot, disk slot): entries leaving the host tier for disk.
        device_to_host: (device block id, host slot): evicted device blocks saved.
        disk_to_host: (disk slot, host slot): disk entries brought up to be loaded.
        host_to_device: (host slot, device block id): offloaded blocks loaded back.
    """

    host_to_disk: list[tuple[int, int]] = field(default_factory=list)
    device_to_host: list[tuple[int, int]] = field(default_factory=list)
    disk_to_host: list[tuple[int, int]] = field(default_factory=list)
    host_to_device: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.host_to_disk or self.device_to_host or self.disk_to_host or self.host_to_device
        )


class OffloadTier:
    """One tier: ``num_slots`` slots holding blocks by hash, evicted least recently used
    first (an ordered dict: oldest first).

    Args:
        name: "host" or "disk".
        num_slots: its capacity in blocks (>= 1).
    """

    def __init__(self, name: str, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the {name} tier needs at least one slot, got {num_slots}")
        self.name = name
        self.num_slots = num_slots
        self.entries: OrderedDict[BlockHash, int] = OrderedDict()
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self.pinned: set[int] = set()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, block_hash: BlockHash) -> int:
        """The block's slot, now the most recently used (KeyError if absent)."""
        self.entries.move_to_end(block_hash)
        return self.entries[block_hash]

    def put(self, block_hash: BlockHash) -> tuple[int, tuple[BlockHash, int] | None] | None:
        """Give ``block_hash`` a slot (pinned for this step), evicting the least recently
        used unpinned entry if no slot is free.

        Returns:
            (its slot, the evicted (hash, slot) or None); None if every slot is pinned.
        """
        evicted = None
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((h for h, s in self.entries.items() if s not in self.pinned), None)
            if victim is None:
                return None
            slot = self.entries.pop(victim)
            evicted = (victim, slot)
        self.entries[block_hash] = slot
        self.pinned.add(slot)
        return slot, evicted

    def num_evictable(self) -> int:
        """Slots a ``put`` could take now (free, or holding an unpinned entry)."""
        return self.num_slots - len(self.pinned)

    def clear(self) -> None:
        self.entries.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.pinned.clear()

    def check_integrity(self) -> None:
        """Raises AssertionError unless every slot is free or held by exactly one entry."""
        held = list(self.entries.values())
        assert len(set(held)) == len(held), f"{self.name}: a slot holds two blocks"
        assert not set(held) & set(self.free_slots), f"{self.name}: a held slot is free"
        assert sorted(held + self.free_slots) == list(range(self.num_slots)), (
            f"{self.name}: slots lost or duplicated"
        )
        assert self.pinned <= set(range(self.num_slots)), f"{self.name}: pinned unknown slot"


class KVOffloadManager:
    """The offload tiers of one KV cache, and the moves of the step being planned.

    Args:
        host_slots: blocks the host tier holds (>= 1).
        disk_slots: blocks the disk tier holds (0: no disk tier).
    """

    def __init__(self, host_slots: int, disk_slots: int = 0) -> None:
        self.host = OffloadTier(HOST, host_slots)
        self.disk = OffloadTier(DISK, disk_slots) if disk_slots else None
        self.transfers = KVTransfers()
        # Tokens found in each tier by admitted requests since the last snapshot.
        self.hit_tokens = {HOST: 0, DISK: 0}
        # Steps that handed the worker moves: the engine asks the workers for their copy
        # statistics only after new ones (a round trip to every rank).
        self.num_transfer_steps = 0

    def begin_step(self) -> None:
        """Unpin the slots of the moves already handed to the worker."""
        self.host.pinned.clear()
        if self.disk is not None:
            self.disk.pinned.clear()

    def take_transfers(self) -> KVTransfers:
        transfers, self.transfers = self.transfers, KVTransfers()
        if transfers:
            self.num_transfer_steps += 1
        return transfers

    # ---- eviction from the device ----------------------------------------------------------

    def store(self, block_hash: BlockHash, block_id: int) -> None:
        """Save the KV of an evicted device block (skipped if the host tier has it, or has
        no slot to spare this step)."""
        if block_hash in self.host:
            self.host.get(block_hash)
            return
        got = self.host.put(block_hash)
        if got is None:
            return
        slot, evicted = got
        if evicted is not None:
            self._demote(*evicted)
        self.transfers.device_to_host.append((block_id, slot))

    def _demote(self, block_hash: BlockHash, host_slot: int) -> None:
        """A host entry evicted for another block moves to the disk tier, if there is one."""
        disk = self.disk
        if disk is None:
            return
        if block_hash in disk:
            disk.get(block_hash)
            return
        got = disk.put(block_hash)
        if got is not None:
            self.transfers.host_to_disk.append((host_slot, got[0]))

    # ---- loads for a new request -----------------------------------------------------------

    def lookup(self, block_hashes: list[BlockHash], limit: int | None = None) -> list[BlockHash]:
        """The leading ``block_hashes`` found in the tiers (at most ``limit``), stopping at
        the first miss, and at a disk entry no host slot is left to bring up this step."""
        found: list[BlockHash] = []
        room = self.host.num_evictable()
        for block_hash in block_hashes[:limit]:
            if block_hash in self.host:
                if self.host.entries[block_hash] not in self.host.pinned:
                    room -= 1  # it will be pinned for its own load
                found.append(block_hash)
            elif self.disk is not None and block_hash in self.disk:
                found.append(block_hash)
            else:
                break
        while found and sum(h not in self.host for h in found) > max(0, room):
            found.pop()
        return found

    def reserve_loads(self, block_hashes: list[BlockHash], block_size: int) -> list[int]:
        """Pin the host slots ``block_hashes`` (from ``lookup`` in this step) will be loaded
        from, bringing disk entries up into host slots; call before taking the device
        blocks they go to, whose evictions must not take these slots.

        Returns:
            The host slot of each block, in order.

        Raises:
            KeyError: a block is in no tier.
            RuntimeError: no host slot for a disk entry (``lookup`` leaves room for them).
        """
        for block_hash in block_hashes:  # first pin what is on the host already
            if block_hash in self.host:
                self.host.pinned.add(self.host.get(block_hash))
        slots = []
        for block_hash in block_hashes:
            if block_hash in self.host:
                slot = self.host.entries[block_hash]
                self.hit_tokens[HOST] += block_size
            else:
                assert self.disk is not None
                disk_slot = self.disk.get(block_hash)
                self.disk.pinned.add(disk_slot)
                got = self.host.put(block_hash)
                if got is None:
                    raise RuntimeError("no host slot to load an offloaded block through")
                slot, evicted = got
                if evicted is not None:
                    self._demote(*evicted)
                self.transfers.disk_to_host.append((disk_slot, slot))
                self.hit_tokens[DISK] += block_size
            slots.append(slot)
        return slots

    def add_loads(self, host_slots: list[int], block_ids: list[int]) -> None:
        """Load the reserved ``host_slots`` into device blocks ``block_ids``."""
        self.transfers.host_to_device.extend(zip(host_slots, block_ids, strict=True))

    def clear(self) -> None:
        """Forget every offloaded block (the weights changed, or the cache was reset)."""
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()
        self.transfers = KVTransfers()

    def take_hit_tokens(self) -> dict[str, int]:
        hits, self.hit_tokens = self.hit_tokens, {HOST: 0, DISK: 0}
        return hits

    def check_integrity(self) -> None:
        self.host.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()

"""The worker's half of the KV offload tiers: the host pool and the disk file, and the
block moves the scheduler plans (``core/kv_offload.py``), made at the start of a step.

A host slot holds one block of every layer, ``[layers, 2, block_size, kv_heads,
head_dim]`` (MLA: ``[layers, block_size, latent]``), contiguous (pinned memory on CUDA, so
copies to and from the device run as DMA); a disk slot holds the same bytes at
``slot * block_bytes`` of one preallocated file, unlinked from its folder as soon as it is
open (its space is freed when the process ends).
"""

from __future__ import annotations

import os
import time

import torch

from tokenmill.core.kv_offload import KVTransfers
from tokenmill.worker.host_memory import lazily_zeroed_cpu_tensor
from tokenmill.worker.kv_blocks import block_dim

# Blocks moved between the host pool and the device per copy (bounds the staging memory).
_CHUNK_BLOCKS = 256


class KVOffloadStore:
    """The host pool (and optional disk file) of one KV cache.

    Args:
        kv_arena: the KV cache, ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``
            (MLA: ``[layers, num_blocks, block_size, latent]``).
        host_slots: blocks the host pool holds.
        disk_path: a folder for the disk tier's file, or None.
        disk_slots: blocks the disk file holds (with ``disk_path``).

    Raises:
        OSError: the disk file cannot be created.
    """

    def __init__(
        self,
        kv_arena: torch.Tensor,
        host_slots: int,
        disk_path: str | None = None,
        disk_slots: int = 0,
    ) -> None:
        # The arena's block dimension: the layers' own, after the layer dimension.
        self.dim = 1 + block_dim(kv_arena[0])
        self.block_shape = tuple(n for i, n in enumerate(kv_arena.shape) if i != self.dim)
        shape = (host_slots, *self.block_shape)
        if kv_arena.device.type == "cuda":
            self.host = torch.empty(shape, dtype=kv_arena.dtype, pin_memory=True)
        else:  # its pages are taken as slots fill
            self.host = lazily_zeroed_cpu_tensor(shape, kv_arena.dtype)
        self.block_bytes = self.host[0].numel() * self.host.element_size()
        self._fd: int | None = None
        self.disk_file: str | None = None
        if disk_path is not None and disk_slots:
            os.makedirs(disk_path, exist_ok=True)
            self.disk_file = os.path.join(disk_path, f"tokenmill-kv-{os.getpid()}.bin")
            self._fd = os.open(self.disk_file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            # NOTE: unlinked at once: the open descriptor keeps the file, and the system
            # frees its space when the process ends, however it ends (no stale files).
            os.unlink(self.disk_file)
            os.ftruncate(self._fd, disk_slots * self.block_bytes)
        self.stats: dict[str, float] = {}

    def apply(self, transfers: KVTransfers, kv_arena: torch.Tensor) -> None:
        """Make one step's moves, in ``KVTransfers``' order (host->disk, device->host,
        disk->host, host->device)."""
        start = time.perf_counter()
        for host_slot, disk_slot in transfers.host_to_disk:
            os.pwrite(self._disk_fd(), self._slot_bytes(host_slot), disk_slot * self.block_bytes)
        n = len(transfers.host_to_disk)
        self._count("disk_store_bytes", n * self.block_bytes)
        disk_time = time.perf_counter() - start
        start = time.perf_counter()
        if transfers.device_to_host:
            blocks, slots = zip(*transfers.device_to_host, strict=True)
            self._device_to_host(kv_arena, list(blocks), list(slots))
            self._count("host_store_bytes", len(blocks) * self.block_bytes)
        host_time = time.perf_counter() - start
        start = time.perf_counter()
        for disk_slot, host_slot in transfers.disk_to_host:
            offset = disk_slot * self.block_bytes
            got = os.preadv(self._disk_fd(), [self._slot_bytes(host_slot)], offset)
            if got != self.block_bytes:
                raise OSError(f"short read of the KV disk tier: {got} of {self.block_bytes} bytes")
        self._count("disk_load_bytes", len(transfers.disk_to_host) * self.block_bytes)
        disk_time += time.perf_counter() - start
        start = time.perf_counter()
        if transfers.host_to_device:
            slots, blocks = zip(*transfers.host_to_device, strict=True)
            self._host_to_device(kv_arena, list(slots), list(blocks))
            self._count("host_load_bytes", len(blocks) * self.block_bytes)
        host_time += time.perf_counter() - start
        self._count("host_seconds", host_time)
        if self._fd is not None:
            self._count("disk_seconds", disk_time)

    def _device_to_host(self, kv_arena: torch.Tensor, blocks: list[int], slots: list[int]) -> None:
        for i in range(0, len(blocks), _CHUNK_BLOCKS):
            index = torch.tensor(blocks[i : i + _CHUNK_BLOCKS], device=kv_arena.device)
            # [layers, (2,) n, ...] -> [n, layers, (2,) ...]
            data = kv_arena.index_select(self.dim, index).movedim(self.dim, 0).to("cpu")
            self.host[torch.tensor(slots[i : i + _CHUNK_BLOCKS])] = data

    def _host_to_device(self, kv_arena: torch.Tensor, slots: list[int], blocks: list[int]) -> None:
        pin = kv_arena.device.type == "cuda"
        for i in range(0, len(slots), _CHUNK_BLOCKS):
            data = self.host.index_select(0, torch.tensor(slots[i : i + _CHUNK_BLOCKS]))
            if pin:
                data = data.pin_memory()
            data = data.to(kv_arena.device, non_blocking=pin)
            index = torch.tensor(blocks[i : i + _CHUNK_BLOCKS], device=kv_arena.device)
            kv_arena.index_copy_(self.dim, index, data.movedim(0, self.dim))

    def _slot_bytes(self, host_slot: int) -> memoryview:
        return memoryview(self.host[host_slot].view(torch.uint8).numpy()).cast("B")

    def _disk_fd(self) -> int:
        if self._fd is None:
            raise RuntimeError("a disk move was planned without a disk tier")
        return self._fd

    def _count(self, key: str, value: float) -> None:
        self.stats[key] = self.stats.get(key, 0.0) + value

    def take_stats(self) -> dict[str, float]:
        """Bytes moved and seconds spent per tier since the last call."""
        stats, self.stats = self.stats, {}
        return stats

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

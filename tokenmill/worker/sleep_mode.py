"""Sleep mode: release a model runner's weights and KV cache, and bring them back.

With ``--enable-sleep-mode`` the model's weights (its parameters, and the buffers of
quantized layers) are packed into one buffer (a ``WeightArena``) when the model loads, and
the KV cache is one tensor whose layers are views. Sleeping then frees two buffers: level 1
copies the weights to the host first (pinned memory on CUDA; on the CPU, where the device is
host memory, a temporary file) and level 2 drops them. Waking brings both back in place:
every parameter and every layer's KV view follows its buffer, so nothing is rebound.

On CUDA both buffers live in CUDA virtual memory (``device_vmm.py``): sleeping unmaps their
physical memory and waking maps new memory at the same addresses, so the captured CUDA
graphs stay valid. Where virtual memory management is unavailable (and on the CPU) the
buffers' storages are resized to nothing and back instead; on CUDA they then may come back
elsewhere, and the graphs are captured again when an address moved.

A woken KV cache is zero-filled (its content is gone); weights dropped at level 2 are read
again from the model's checkpoint unless new ones were loaded (``update_weights``).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tokenmill.model.layers.attention import unbind_kv_caches
from tokenmill.model.loader.model_loader import loaded_tensors
from tokenmill.worker.device_vmm import region_of, stable_device_memory
from tokenmill.worker.host_memory import release_free_host_memory

logger = logging.getLogger(__name__)

# Byte alignment of each packed storage (the widest vector loads of any kernel).
_ALIGN = 256
SLEEP_TAGS = ("weights", "kv_cache")
# Allocates a uint8 device tensor of that many bytes (stable addresses: ``DeviceVmm.empty``).
Allocate = Callable[[int], torch.Tensor]


def free_buffer(buffer: torch.Tensor) -> None:
    """Give a buffer's device memory back: unmap its VMM region, or resize its storage to
    nothing. Its views stay, unreadable until ``refill_buffer``."""
    region = region_of(buffer)
    if region is not None:
        region.unmap()
    else:
        buffer.untyped_storage().resize_(0)


def refill_buffer(buffer: torch.Tensor, nbytes: int) -> None:
    """Give a freed buffer ``nbytes`` of device memory again (content undefined): at the
    same addresses for a VMM region; a no-op while it holds memory.

    Raises:
        RuntimeError: the device is out of memory.
    """
    region = region_of(buffer)
    if region is not None:
        region.map()
    else:
        buffer.untyped_storage().resize_(nbytes)


def buffer_device_bytes(buffer: torch.Tensor) -> int:
    """Bytes of device memory a buffer holds now (a VMM region's, rounded up to its
    granularity)."""
    region = region_of(buffer)
    return region.mapped_bytes if region is not None else buffer.untyped_storage().nbytes()


class WeightArena:
    """A module's tensors (parameters and buffers) packed into one byte buffer, each tensor
    a view of it.

    Tensors that shared a storage (tied embeddings) keep sharing it.

    Args:
        params: the tensors (any device, one device for all).
        allocate: allocates the buffer (stable-address device memory); default
            ``torch.empty``.
    """

    def __init__(self, params: list[torch.Tensor], allocate: Allocate | None = None) -> None:
        params = list({id(p): p for p in params}.values())  # each tensor object once
        device = params[0].device
        offsets: dict[int, int] = {}  # old storage address -> byte offset in the arena
        storages: list[tuple[int, torch.UntypedStorage]] = []
        size = 0
        for p in params:
            storage = p.untyped_storage()
            if storage.data_ptr() in offsets:
                continue
            size = -(-size // _ALIGN) * _ALIGN
            offsets[storage.data_ptr()] = size
            storages.append((size, storage))
            size += storage.nbytes()
        self.nbytes = size
        if allocate is not None:
            self.buffer = allocate(size)
        else:
            self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        with torch.no_grad():
            for offset, storage in storages:
                old = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
                self.buffer[offset : offset + storage.nbytes()].copy_(old)
            arena = self.buffer.untyped_storage()
            for p in params:
                byte_offset = offsets[p.untyped_storage().data_ptr()]
                byte_offset += p.storage_offset() * p.element_size()
                p.set_(arena, byte_offset // p.element_size(), p.size(), p.stride())

    @property
    def device_bytes(self) -> int:
        return buffer_device_bytes(self.buffer)

    @property
    def resident(self) -> bool:
        return self.device_bytes > 0

    def release(self) -> None:
        """Free the buffer's memory (every parameter becomes unreadable)."""
        free_buffer(self.buffer)

    def restore(self) -> None:
        """Allocate the buffer again (its content undefined until filled).

        Raises:
            RuntimeError: the device is out of memory.
        """
        refill_buffer(self.buffer, self.nbytes)


class HostBackup:
    """Where level 1 keeps the weights while asleep: pinned host memory on CUDA (kept for
    the next sleep), a temporary file on the CPU (whose memory the weights leave)."""

    def __init__(self) -> None:
        self._pinned: torch.Tensor | None = None
        self._path: str | None = None

    def save(self, buffer: torch.Tensor) -> None:
        if buffer.device.type == "cuda":
            if self._pinned is None or self._pinned.numel() != buffer.numel():
                self._pinned = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=True)
            self._pinned.copy_(buffer, non_blocking=True)
            torch.cuda.synchronize(buffer.device)
            return
        self.discard()
        fd, self._path = tempfile.mkstemp(prefix="tokenmill-weights-")
        os.close(fd)
        # A file-backed tensor: the copy lands in the file, not in this process's heap.
        # (numpy views would pin ``buffer``'s storage, which must stay resizable.)
        mapped = torch.from_file(self._path, shared=True, size=buffer.numel(), dtype=torch.uint8)
        mapped.copy_(buffer)
        del mapped

    def load(self, buffer: torch.Tensor) -> None:
        """Copy the saved weights into ``buffer``.

        Raises:
            RuntimeError: nothing was saved.
        """
        if buffer.device.type == "cuda":
            if self._pinned is None:
                raise RuntimeError("no weights were saved")
            buffer.copy_(self._pinned, non_blocking=True)
            return
        if self._path is None:
            raise RuntimeError("no weights were saved")
        mapped = torch.from_file(self._path, shared=False, size=buffer.numel(), dtype=torch.uint8)
        buffer.copy_(mapped)
        del mapped
        self.discard()

    def discard(self) -> None:
        if self._path is not None:
            os.unlink(self._path)
            self._path = None


class SleepHost(Protocol):
    """What sleep mode needs of the model runner it belongs to."""

    model: torch.nn.Module | None
    device: torch.device
    kv_arena: torch.Tensor | None
    kv_caches: list[torch.Tensor]
    num_blocks: int
    graphs: Any

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def reload_weights(self, path: str | None = None) -> None: ...

    def capture_cuda_graphs(self) -> None: ...


def release_kv_cache(runner: SleepHost) -> None:
    """Free the runner's KV cache memory. On CUDA the layers keep their views of the
    freed buffer, which ``restore_kv_cache`` fills again in place."""
    assert runner.kv_arena is not None and runner.model is not None
    if runner.device.type == "cuda":
        free_buffer(runner.kv_arena)
        return
    unbind_kv_caches(runner.model)
    runner.kv_caches, runner.kv_arena = [], None


def restore_kv_cache(runner: SleepHost) -> None:
    """Allocate the KV cache again, zero-filled (after ``release_kv_cache``)."""
    arena = runner.kv_arena
    if runner.device.type == "cuda":
        assert arena is not None
        refill_buffer(arena, arena.numel() * arena.element_size())
        arena.zero_()
        return
    runner.initialize_kv_cache(runner.num_blocks)


class SleepMode:
    """The sleep and wake-up of one model runner.

    Args:
        runner: the runner; its model must be loaded (its parameters are packed here).
    """

    def __init__(self, runner: SleepHost) -> None:
        assert runner.model is not None
        self.runner = runner
        # Stable-address device memory for the weights and the KV cache (None: off CUDA,
        # or no virtual memory management).
        self.vmm = stable_device_memory(runner.device)
        # Quantized layers keep their converted weights (int4 planes, GGUF blocks) in
        # buffers: those sleep too. Computed buffers (rotary tables) stay: level 2 could
        # not read them back from the checkpoint.
        self.weights = WeightArena(
            [t for _, t in loaded_tensors(runner.model)], self.allocate
        )
        if self.vmm is not None:
            logger.info(
                "Sleep mode: %.2f GiB of weights and the KV cache in CUDA virtual memory "
                "(they wake up at the same addresses)", self.weights.nbytes / 2**30,
            )  # fmt: skip
        self.backup = HostBackup()
        self.asleep: set[str] = set()  # of SLEEP_TAGS
        self._weights_saved = False  # level 1: the backup holds them
        self._addresses: tuple[int, int] = (0, 0)

    @property
    def allocate(self) -> Allocate | None:
        """How the KV cache and the weights get their device memory (None: ``torch``'s
        allocator)."""
        return self.vmm.empty if self.vmm is not None else None

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def sleep(self, level: int) -> None:
        """Free the weights (level 1: saved to the host first; level 2: dropped) and the
        KV cache. Sleeping again while asleep changes nothing.

        Raises:
            ValueError: a level other than 1 or 2.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.asleep:
            return
        start = time.perf_counter()
        runner = self.runner
        self._addresses = self._storage_addresses()
        if level == 1:
            self.backup.save(self.weights.buffer)
        self._weights_saved = level == 1
        self.weights.release()
        release_kv_cache(runner)
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_free_host_memory()
        self.asleep = set(SLEEP_TAGS)
        logger.info(
            "Asleep (level %d): freed %.2f GiB of weights and the KV cache in %.2f s",
            level, self.weights.nbytes / 2**30, time.perf_counter() - start,
        )  # fmt: skip

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and/or the KV cache (both when ``tags`` is None).

        Raises:
            ValueError: an unknown tag.
        """
        tags = list(SLEEP_TAGS) if tags is None else tags
        unknown = set(tags) - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"unknown wake-up tags {sorted(unknown)}; use weights, kv_cache")
        start = time.perf_counter()
        if "weights" in tags and "weights" in self.asleep:
            self.weights.restore()
            if self._weights_saved:
                self.backup.load(self.weights.buffer)
            else:
                self.runner.reload_weights()
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            restore_kv_cache(self.runner)
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self._after_wake_up()
        logger.info("Woke %s up in %.2f s", "+".join(tags), time.perf_counter() - start)

    def _after_wake_up(self) -> None:
        runner = self.runner
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
            # NOTE: with CUDA virtual memory the addresses never move; the storages resized
            # by the fallback may.
            if runner.graphs is not None and self._storage_addresses() != self._addresses:
                # The captured graphs read the old addresses: capture them again.
                logger.info("Weights or KV cache moved while asleep: capturing CUDA graphs again")
                runner.graphs = None
                runner.capture_cuda_graphs()

    def _storage_addresses(self) -> tuple[int, int]:
        kv = self.runner.kv_arena
        return (self.weights.buffer.data_ptr(), kv.data_ptr() if kv is not None else 0)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the weights and the KV cache hold on the device now."""
        kv = self.runner.kv_arena
        return {
            "weights": self.weights.device_bytes,
            "kv_cache": buffer_device_bytes(kv) if kv is not None else 0,
        }

"""Device memory at stable addresses: CUDA virtual memory management (VMM) through the driver
API, for sleep mode.

A ``VmmRegion`` reserves a virtual address range once (``cuMemAddressReserve``) and maps
physical memory into it (``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``). ``unmap``
gives the physical memory back to the device and keeps the range; ``map`` backs the same
addresses with new physical memory. Every tensor view of the range, and every CUDA graph
captured over it, stays valid across an unmap/map cycle (as vLLM's ``CuMemAllocator``).

The driver is reached through ``ctypes`` on ``libcuda.so.1``: no compiled extension and no
extra package (``cuda.bindings`` is not a tokenmill dependency), so it works wherever
PyTorch's CUDA build runs. Signatures and struct layouts follow ``cuda.h`` (CUDA 11.2+):
``CUdeviceptr`` and ``CUmemGenericAllocationHandle`` are ``unsigned long long``, sizes are
``size_t``, enums and ``CUresult`` are C ``int``.

A region reaches torch as a ``uint8`` tensor through ``__cuda_array_interface__``:
``torch.as_tensor`` wraps the pointer with zero copy and holds a reference to the region
until the last view of it is gone, when the region frees its memory and its range. (torch's
``CUDAPluggableAllocator``/``MemPool`` would need a compiled ``.so`` exposing malloc/free.)
VMM memory is outside torch's caching allocator: ``torch.cuda.memory_allocated`` does not
count it, ``torch.cuda.mem_get_info`` does.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint, c_ulonglong, c_void_p
from typing import Any

import torch

logger = logging.getLogger(__name__)

CUDA_SUCCESS = 0
CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_HANDLE_TYPE_NONE = 0x0
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class CUmemAllocFlags(ctypes.Structure):
    """``CUmemAllocationProp.allocFlags`` (an anonymous struct in ``cuda.h``)."""

    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    """32 bytes on 64-bit Linux: two enums, the location, a pointer (8-aligned), the flags."""

    _fields_ = [
        ("type", c_int),
        ("requestedHandleTypes", c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", c_void_p),
        ("allocFlags", CUmemAllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", c_int)]


# name -> argtypes; every function returns CUresult (int).
SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [c_uint],
    "cuGetErrorName": [c_int, POINTER(c_char_p)],
    "cuDeviceGet": [POINTER(c_int), c_int],
    "cuDeviceGetAttribute": [POINTER(c_int), c_int, c_int],
    "cuDevicePrimaryCtxRetain": [POINTER(c_void_p), c_int],
    "cuCtxGetCurrent": [POINTER(c_void_p)],
    "cuCtxSetCurrent": [c_void_p],
    "cuCtxSynchronize": [],
    "cuMemGetAllocationGranularity": [POINTER(c_size_t), POINTER(CUmemAllocationProp), c_int],
    "cuMemAddressReserve": [POINTER(c_ulonglong), c_size_t, c_size_t, c_ulonglong, c_ulonglong],
    "cuMemAddressFree": [c_ulonglong, c_size_t],
    "cuMemCreate": [POINTER(c_ulonglong), c_size_t, POINTER(CUmemAllocationProp), c_ulonglong],
    "cuMemRelease": [c_ulonglong],
    "cuMemMap": [c_ulonglong, c_size_t, c_size_t, c_ulonglong, c_ulonglong],
    "cuMemUnmap": [c_ulonglong, c_size_t],
    "cuMemSetAccess": [c_ulonglong, c_size_t, POINTER(CUmemAccessDesc), c_size_t],
}


def round_up(nbytes: int, granularity: int) -> int:
    """``nbytes`` rounded up to a multiple of ``granularity`` (at least one granule: a
    mapping cannot be empty)."""
    return max(1, -(-nbytes // granularity)) * granularity


class CudaDriver:
    """The few driver calls VMM needs, each checked.

    Args:
        lib: ``libcuda.so.1`` loaded by ``load_driver`` (or any object with the same
            functions taking ctypes arguments and returning an int ``CUresult``).
    """

    def __init__(self, lib: Any) -> None:
        self.lib = lib

    def call(self, name: str, *args: Any) -> None:
        """``name(*args)``.

        Raises:
            RuntimeError: the call returned an error; the message names the call and the
                error (``cuGetErrorName``), e.g. ``cuMemCreate failed:
                CUDA_ERROR_OUT_OF_MEMORY (2)``.
        """
        result = getattr(self.lib, name)(*args)
        if result != CUDA_SUCCESS:
            raise RuntimeError(f"{name} failed: {self.error_name(result)} ({result})")

    def error_name(self, result: int) -> str:
        name = c_char_p()
        try:
            if self.lib.cuGetErrorName(result, ctypes.pointer(name)) == CUDA_SUCCESS:
                if name.value:
                    return name.value.decode()
        except Exception:  # noqa: BLE001 - naming an error must not hide it
            pass
        return "unknown CUDA error"

    def ensure_context(self, device_index: int) -> None:
        """Make the device's primary context (the one the CUDA runtime and torch use)
        current on this thread: VMM calls act on the current context."""
        ctx = c_void_p()
        self.call("cuCtxGetCurrent", ctypes.pointer(ctx))
        if ctx.value:
            return
        device = c_int()
        self.call("cuDeviceGet", ctypes.pointer(device), device_index)
        self.call("cuDevicePrimaryCtxRetain", ctypes.pointer(ctx), device.value)
        self.call("cuCtxSetCurrent", ctx)

    def allocation_prop(self, device_index: int) -> CUmemAllocationProp:
        prop = CUmemAllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        return prop

    def granularity(self, device_index: int) -> int:
        """The size and alignment unit of mappings on the device (bytes; 2 MiB on recent
        GPUs)."""
        size = c_size_t()
        prop = self.allocation_prop(device_index)
        self.call(
            "cuMemGetAllocationGranularity", ctypes.pointer(size), ctypes.pointer(prop),
            CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )  # fmt: skip
        return int(size.value)


def load_driver() -> CudaDriver:
    """``libcuda.so.1`` with its signatures declared, initialised.

    Raises:
        OSError: no CUDA driver library; AttributeError: a driver without VMM calls;
        RuntimeError: ``cuInit`` failed.
    """
    lib = ctypes.CDLL("libcuda.so.1")
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = c_int
    driver = CudaDriver(lib)
    driver.call("cuInit", 0)
    return driver


# Live regions by base address, to find the region behind a tensor (``region_of``).
_REGIONS: weakref.WeakValueDictionary[int, VmmRegion] = weakref.WeakValueDictionary()


class VmmRegion:
    """A reserved device address range and the physical memory mapped into it.

    Args:
        driver: the driver.
        device_index: the CUDA device.
        nbytes: bytes the caller uses; the range and each mapping take ``nbytes`` rounded
            up to the granularity.
        granularity: the device's (``CudaDriver.granularity``).

    Raises:
        RuntimeError: the driver refused (out of memory: ``CUDA_ERROR_OUT_OF_MEMORY``).
    """

    def __init__(self, driver: CudaDriver, device_index: int, nbytes: int, granularity: int):
        self.driver = driver
        self.device_index = device_index
        self.nbytes = nbytes
        self.size = round_up(nbytes, granularity)
        self.mapped = False
        self._handle: int | None = None
        self.ptr = 0
        driver.ensure_context(device_index)
        ptr = c_ulonglong()
        driver.call("cuMemAddressReserve", ctypes.pointer(ptr), self.size, granularity, 0, 0)
        self.ptr = int(ptr.value)
        try:
            self.map()
        except BaseException:
            driver.call("cuMemAddressFree", self.ptr, self.size)
            self.ptr = 0
            raise
        _REGIONS[self.ptr] = self

    @property
    def mapped_bytes(self) -> int:
        """Device memory the region holds now (bytes)."""
        return self.size if self.mapped else 0

    def map(self) -> None:
        """Back the range with new physical memory (content undefined), readable and
        writable by the device; a no-op while mapped.

        Raises:
            RuntimeError: the driver refused (the range stays unmapped).
        """
        if self.mapped:
            return
        d = self.driver
        d.ensure_context(self.device_index)
        handle = c_ulonglong()
        prop = d.allocation_prop(self.device_index)
        d.call("cuMemCreate", ctypes.pointer(handle), self.size, ctypes.pointer(prop), 0)
        mapped = False
        try:
            d.call("cuMemMap", self.ptr, self.size, 0, handle.value, 0)
            mapped = True
            access = CUmemAccessDesc()
            access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = self.device_index
            access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            d.call("cuMemSetAccess", self.ptr, self.size, ctypes.pointer(access), 1)
        except BaseException:
            if mapped:
                d.call("cuMemUnmap", self.ptr, self.size)
            d.call("cuMemRelease", handle.value)
            raise
        self._handle = int(handle.value)
        self.mapped = True

    def unmap(self) -> None:
        """Give the physical memory back to the device (after the work queued on it has
        finished); the addresses stay reserved. A no-op while unmapped."""
        if not self.mapped:
            return
        d = self.driver
        d.ensure_context(self.device_index)
        d.call("cuCtxSynchronize")  # no kernel may still read or write the memory
        d.call("cuMemUnmap", self.ptr, self.size)
        assert self._handle is not None
        d.call("cuMemRelease", self._handle)
        self._handle = None
        self.mapped = False

    def close(self) -> None:
        """Unmap and free the address range (the region is unusable afterwards)."""
        if not self.ptr:
            return
        self.unmap()
        self.driver.call("cuMemAddressFree", self.ptr, self.size)
        _REGIONS.pop(self.ptr, None)
        self.ptr = 0

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone
            pass

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The first ``nbytes`` bytes as a writable 1-D ``uint8`` array (version 2 of the
        interface: no stream, the producer synchronises)."""
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "strides": None, "version": 2}  # fmt: skip

    def as_tensor(self) -> torch.Tensor:
        """A ``uint8`` tensor of ``nbytes`` elements over the range, zero copy; it keeps
        the region alive."""
        return torch.as_tensor(self, device=torch.device("cuda", self.device_index))


def region_of(tensor: torch.Tensor) -> VmmRegion | None:
    """The region whose range starts at ``tensor``'s first byte, or None."""
    if tensor.device.type != "cuda":
        return None
    return _REGIONS.get(tensor.data_ptr())


class DeviceVmm:
    """Allocates stable-address device memory on one CUDA device.

    Args:
        driver: the driver (``load_driver``).
        device_index: the CUDA device.
    """

    def __init__(self, driver: CudaDriver, device_index: int) -> None:
        self.driver = driver
        self.device_index = device_index
        driver.ensure_context(device_index)
        self.granularity = driver.granularity(device_index)

    def empty(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor of ``nbytes`` in its own region (content undefined).

        Raises:
            RuntimeError: the driver refused (out of memory).
        """
        region = VmmRegion(self.driver, self.device_index, nbytes, self.granularity)
        return region.as_tensor()


def vmm_supported(driver: CudaDriver, device_index: int) -> bool:
    driver.ensure_context(device_index)
    device, value = c_int(), c_int()
    driver.call("cuDeviceGet", ctypes.pointer(device), device_index)
    driver.call(
        "cuDeviceGetAttribute", ctypes.pointer(value),
        CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device.value,
    )  # fmt: skip
    return bool(value.value)


@functools.cache
def _device_vmm(device_index: int) -> DeviceVmm | None:
    try:
        driver = load_driver()
        if not vmm_supported(driver, device_index):
            raise RuntimeError("the device does not support virtual memory management")
        return DeviceVmm(driver, device_index)
    except (OSError, AttributeError, RuntimeError) as e:
        logger.warning(
            "Sleep mode without CUDA virtual memory management (%s): the weights and the KV "
            "cache may come back at other addresses, and the CUDA graphs are then captured "
            "again after each wake-up", e,
        )  # fmt: skip
        return None


def stable_device_memory(device: torch.device) -> DeviceVmm | None:
    """The VMM allocator of ``device``, or None off CUDA or where VMM is unavailable (no
    driver library, a driver or device without VMM; logged once per device)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_vmm(index)

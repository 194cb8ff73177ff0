"""The CUDA virtual-memory wrapper without a GPU: the struct layouts of ``cuda.h``, sizes
rounded to the granularity, the call sequence of a region's life (against a fake driver
that records calls), errors named by the driver, and the fallback when no driver loads."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch

from tokenmill.worker import device_vmm
from tokenmill.worker.device_vmm import (
    CudaDriver,
    CUmemAccessDesc,
    CUmemAllocationProp,
    VmmRegion,
    round_up,
)

MiB = 1 << 20
ERRORS = {2: b"CUDA_ERROR_OUT_OF_MEMORY", 1: b"CUDA_ERROR_INVALID_VALUE"}


class FakeLib:
    """The driver functions a region calls, on a fake 2 MiB-granular device: records each
    call and fails the one named in ``fail`` with its error code."""

    def __init__(self, fail: dict[str, int] | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail = fail or {}
        self.current_ctx = 0
        self.next_address = 0x7F0000000000
        self.next_handle = 1
        self.live_handles: set[int] = set()
        self.mappings: dict[int, int] = {}  # address -> handle

    def __getattr__(self, name: str):
        if not name.startswith("cu"):
            raise AttributeError(name)

        def fn(*args):
            self.calls.append((name, *args))
            if name in self.fail:
                return self.fail[name]
            return getattr(self, f"_{name}", lambda *a: 0)(*args)

        return fn

    def _cuGetErrorName(self, code, out):
        if code not in ERRORS:
            return 1
        out[0] = ERRORS[code]
        return 0

    def _cuCtxGetCurrent(self, out):
        out[0] = self.current_ctx or None
        return 0

    def _cuDevicePrimaryCtxRetain(self, out, device):
        out[0] = 0xC0
        return 0

    def _cuCtxSetCurrent(self, ctx):
        self.current_ctx = ctx.value
        return 0

    def _cuMemGetAllocationGranularity(self, out, prop, option):
        assert prop[0].type == device_vmm.CU_MEM_ALLOCATION_TYPE_PINNED
        out[0] = 2 * MiB
        return 0

    def _cuMemAddressReserve(self, out, size, alignment, addr, flags):
        assert size % (2 * MiB) == 0
        out[0] = self.next_address
        self.next_address += size
        return 0

    def _cuMemCreate(self, out, size, prop, flags):
        p = prop[0]
        assert (p.location.type, p.location.id) == (device_vmm.CU_MEM_LOCATION_TYPE_DEVICE, 3)
        out[0] = self.next_handle
        self.live_handles.add(self.next_handle)
        self.next_handle += 1
        return 0

    def _cuMemMap(self, address, size, offset, handle, flags):
        self.mappings[address] = handle
        return 0

    def _cuMemUnmap(self, address, size):
        del self.mappings[address]
        return 0

    def _cuMemRelease(self, handle):
        self.live_handles.remove(handle)
        return 0

    def _cuMemSetAccess(self, address, size, desc, count):
        d = desc[0]
        assert d.flags == device_vmm.CU_MEM_ACCESS_FLAGS_PROT_READWRITE and count == 1
        return 0


def names(lib: FakeLib) -> list[str]:
    return [c[0] for c in lib.calls if c[0] not in ("cuCtxGetCurrent",)]


def test_struct_layouts_match_cuda_h():
    # CUmemAllocationProp: type, requestedHandleTypes (4 + 4), CUmemLocation (8), the
    # win32 pointer at 16, allocFlags (1 + 1 + 2 + 4) at 24.
    assert ctypes.sizeof(CUmemAllocationProp) == 32
    assert CUmemAllocationProp.location.offset == 8
    assert CUmemAllocationProp.win32HandleMetaData.offset == 16
    assert CUmemAllocationProp.allocFlags.offset == 24
    assert ctypes.sizeof(CUmemAccessDesc) == 12


def test_sizes_round_up_to_the_granularity():
    g = 2 * MiB
    assert round_up(1, g) == g
    assert round_up(g, g) == g
    assert round_up(g + 1, g) == 2 * g
    assert round_up(0, g) == g  # a mapping is never empty


def test_region_maps_unmaps_and_maps_again_at_the_same_address():
    lib = FakeLib()
    driver = CudaDriver(lib)
    granularity = driver.granularity(3)
    lib.calls.clear()
    region = VmmRegion(driver, 3, 5 * MiB + 7, granularity)
    assert (region.size, region.nbytes) == (6 * MiB, 5 * MiB + 7)
    assert region.mapped and region.mapped_bytes == 6 * MiB
    ptr = region.ptr
    assert lib.mappings == {ptr: 1}
    # The primary context is made current (once: then it is found current), the range
    # reserved, physical memory created, mapped and made accessible.
    context = ["cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"]
    mapping = ["cuMemCreate", "cuMemMap", "cuMemSetAccess"]
    assert names(lib) == [*context, "cuMemAddressReserve", *mapping]
    reserve = next(c for c in lib.calls if c[0] == "cuMemAddressReserve")
    assert reserve[2:] == (6 * MiB, 2 * MiB, 0, 0)  # size, alignment, no fixed address
    assert device_vmm.region_of(torch.empty(0)) is None  # a CPU tensor has none
    interface = region.__cuda_array_interface__
    assert interface["shape"] == (5 * MiB + 7,) and interface["data"] == (ptr, False)

    lib.calls.clear()
    region.unmap()
    assert names(lib) == ["cuCtxSynchronize", "cuMemUnmap", "cuMemRelease"]
    assert not region.mapped and region.mapped_bytes == 0 and not lib.live_handles
    region.unmap()  # a no-op while unmapped
    lib.calls.clear()
    region.map()
    assert names(lib) == mapping
    assert region.ptr == ptr and lib.mappings == {ptr: 2}
    region.close()
    assert names(lib)[-1] == "cuMemAddressFree" and not lib.mappings and not lib.live_handles
    assert device_vmm._REGIONS.get(ptr) is None


def test_driver_errors_are_named_and_nothing_leaks():
    lib = FakeLib(fail={"cuMemMap": 2})
    driver = CudaDriver(lib)
    with pytest.raises(RuntimeError, match=r"cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY \(2\)"):
        VmmRegion(driver, 3, MiB, 2 * MiB)
    # The physical memory was released and the address range freed.
    assert not lib.live_handles
    assert [c[0] for c in lib.calls][-2:] == ["cuMemRelease", "cuMemAddressFree"]

    lib = FakeLib()
    driver = CudaDriver(lib)
    region = VmmRegion(driver, 3, MiB, 2 * MiB)
    region.unmap()
    lib.fail = {"cuMemCreate": 2}
    with pytest.raises(RuntimeError, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"):
        region.map()
    assert not region.mapped  # a later wake-up may try again
    lib.fail = {}
    region.map()
    assert region.mapped
    # An error the driver cannot name is still reported with its code.
    lib.fail = {"cuMemUnmap": 999}
    with pytest.raises(RuntimeError, match=r"cuMemUnmap failed: unknown CUDA error \(999\)"):
        region.unmap()


def test_no_driver_falls_back_once_with_the_reason(monkeypatch, caplog):
    def no_driver():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(device_vmm, "load_driver", no_driver)
    device_vmm._device_vmm.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=device_vmm.__name__):
            assert device_vmm.stable_device_memory(torch.device("cuda", 0)) is None
            assert device_vmm.stable_device_memory(torch.device("cuda", 0)) is None
        warnings = [r for r in caplog.records if "virtual memory" in r.getMessage()]
        assert len(warnings) == 1 and "libcuda.so.1" in warnings[0].getMessage()
    finally:
        device_vmm._device_vmm.cache_clear()
    # The CPU never uses it, and says nothing.
    assert device_vmm.stable_device_memory(torch.device("cpu")) is None


def test_device_without_vmm_falls_back(monkeypatch, caplog):
    class NoVmm(FakeLib):
        def _cuDeviceGetAttribute(self, out, attribute, device):
            assert attribute == device_vmm.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            out[0] = 0
            return 0

    monkeypatch.setattr(device_vmm, "load_driver", lambda: CudaDriver(NoVmm()))
    device_vmm._device_vmm.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=device_vmm.__name__):
            assert device_vmm.stable_device_memory(torch.device("cuda", 1)) is None
        assert "does not support virtual memory management" in caplog.text
    finally:
        device_vmm._device_vmm.cache_clear()

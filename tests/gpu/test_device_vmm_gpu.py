"""CUDA virtual memory through the driver (``tokenmill/worker/device_vmm.py``) on a GPU:
a region's tensor is ordinary device memory for torch, unmapping gives its memory back to
the device, and a CUDA graph captured over it replays correctly after it is mapped again
at the same address."""

from __future__ import annotations

import pytest
import torch

from tokenmill.worker import device_vmm

pytestmark = pytest.mark.gpu
MiB = 1 << 20


@pytest.fixture(scope="module")
def vmm() -> device_vmm.DeviceVmm:
    torch.cuda.init()
    allocator = device_vmm.stable_device_memory(torch.device("cuda", 0))
    assert allocator is not None, "no CUDA virtual memory management (see the log)"
    return allocator


def test_region_tensor_unmap_and_map_at_the_same_address(vmm):
    nbytes = 64 * MiB + 3
    buffer = vmm.empty(nbytes)
    assert buffer.dtype == torch.uint8 and buffer.shape == (nbytes,)
    assert buffer.device == torch.device("cuda", 0)
    region = device_vmm.region_of(buffer)
    assert region is not None and region.size % vmm.granularity == 0
    values = buffer[: 1 << 20].view(torch.float32)
    values.copy_(torch.arange(values.numel(), dtype=torch.float32, device="cuda"))
    assert values[-1].item() == values.numel() - 1
    ptr = buffer.data_ptr()

    torch.cuda.synchronize()
    free_mapped = torch.cuda.mem_get_info()[0]
    region.unmap()
    assert torch.cuda.mem_get_info()[0] - free_mapped >= region.size - 2 * MiB
    region.map()
    assert buffer.data_ptr() == ptr and region.mapped
    buffer.zero_()
    assert int(buffer.sum()) == 0

    # A graph captured over the region reads the memory mapped after a remap.
    out = torch.empty(values.numel(), dtype=torch.float32, device="cuda")
    values.fill_(1.0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out.copy_(values * 2)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(values * 2)
    region.unmap()
    region.map()
    values.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 6.0))


def test_region_is_freed_with_its_last_view(vmm):
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    buffer = vmm.empty(256 * MiB)
    view = buffer[MiB:].view(torch.float16)
    ptr = buffer.data_ptr()
    del buffer
    assert device_vmm._REGIONS.get(ptr) is not None  # the view keeps it
    del view
    torch.cuda.synchronize()
    assert device_vmm._REGIONS.get(ptr) is None
    assert torch.cuda.mem_get_info()[0] >= free_before - 4 * MiB


def test_out_of_memory_is_a_clear_error(vmm):
    total = torch.cuda.mem_get_info()[1]
    with pytest.raises(RuntimeError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        vmm.empty(2 * total)

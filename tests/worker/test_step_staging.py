"""One copy per step: arrays packed on the host land in their persistent device buffers (the
Triton scatter under the interpreter, against the torch reference), sampled tokens of the
previous step replace their placeholders, and misuse is refused."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tokenmill.worker import step_staging
from tokenmill.worker.step_staging import MAX_SEGMENTS, DeviceArena, StepStaging

CPU = torch.device("cpu")
# (device, scatter with the Triton kernel): the torch reference everywhere, the kernel on
# CUDA and in Triton's interpreter.
CASES = [("cpu", False)]
if step_staging.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
    CASES.append(("cpu", True))
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    CASES += [("cuda", True), ("cuda", False)]


def _arena(device: str = "cpu") -> DeviceArena:
    return DeviceArena(
        [((40,), torch.int64), ((9,), torch.int32), ((6, 10), torch.int32), ((2,), torch.int32)],
        torch.device(device),
    )


@pytest.mark.parametrize(("device", "use_kernel"), CASES)
def test_a_step_lands_in_its_buffers_and_views(device, use_kernel):
    arena = _arena(device)
    ids, lens, table, pair = arena.buffers
    table.fill_(-7)
    staging = StepStaging(4096, arena, torch.device(device), use_kernel=use_kernel)
    rng = np.random.default_rng(0)
    for step in range(3):  # both pinned buffers, and reuse of the first
        staging.begin()
        tokens = rng.integers(0, 1000, 23).astype(np.int64)
        tokens[[3, 17]] = [-1, -3]  # the previous step's sampled[0] and sampled[2]
        staging.put_tokens(tokens, ids[:23])
        lens_np = rng.integers(0, 99, 5).astype(np.int32)
        staging.put_into(lens_np, lens[:5])
        rows = rng.integers(0, 50_000, (4, 7)).astype(np.int32)
        staging.put_into(rows, table[:4, :7])  # rows of 7 words at a stride of 10
        staging.put_into(np.array([step, 4], dtype=np.int32), pair)
        floats = staging.put(rng.random(5).astype(np.float32))
        flags = staging.put(np.array([True, False, True]))
        keys = staging.put(np.array([2**62 + step, -5], dtype=np.int64))
        sampled = torch.tensor([1001, 1002, 1003, 1004], device=device)
        staging.flush(sampled)

        want = torch.from_numpy(tokens.copy())
        want[3], want[17] = 1001, 1003
        assert torch.equal(ids[:23].cpu(), want)
        assert torch.equal(lens[:5].cpu(), torch.from_numpy(lens_np))
        assert torch.equal(table[:4, :7].cpu(), torch.from_numpy(rows))
        assert (table[:4, 7:] == -7).all() and (table[4:] == -7).all()  # nothing else written
        assert pair.tolist() == [step, 4]
        assert floats.dtype == torch.float32 and floats.shape == (5,)
        assert flags.tolist() == [True, False, True]
        assert keys.tolist() == [2**62 + step, -5]


@pytest.mark.parametrize(("device", "use_kernel"), CASES)
def test_token_ids_without_placeholders_need_no_sampled_tokens(device, use_kernel):
    arena = _arena(device)
    staging = StepStaging(1024, arena, torch.device(device), use_kernel=use_kernel)
    staging.begin()
    staging.put_tokens(np.arange(5, dtype=np.int64), arena.buffers[0][:5])
    staging.flush(None)
    assert arena.buffers[0][:5].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("device", "use_kernel"), CASES)
def test_long_segments_span_several_programs(device, use_kernel):
    d = torch.device(device)
    arena = DeviceArena([((5000,), torch.int64), ((3000,), torch.int32)], d)
    staging = StepStaging(64_000, arena, d, use_kernel=use_kernel)
    staging.begin()
    tokens = np.arange(5000, dtype=np.int64)
    tokens[4999] = -1
    staging.put_tokens(tokens, arena.buffers[0])
    staging.put_into(np.arange(3000, dtype=np.int32), arena.buffers[1])
    staging.flush(torch.tensor([77], device=d))
    assert arena.buffers[0][4998:].tolist() == [4998, 77]
    assert torch.equal(arena.buffers[1].cpu(), torch.arange(3000, dtype=torch.int32))


def test_misuse_is_refused():
    arena = _arena()
    ids, lens, table, _ = arena.buffers
    staging = StepStaging(256, arena, CPU)
    staging.begin()
    with pytest.raises(ValueError, match="staging"):
        staging.put_into(np.zeros(5, dtype=np.int64), lens[:5])  # dtype differs
    with pytest.raises(ValueError, match="device arena"):
        staging.put_into(np.zeros(5, dtype=np.int32), torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="int64"):
        staging.put_tokens(np.zeros(5, dtype=np.int32), lens[:5])
    with pytest.raises(RuntimeError, match="overflow"):
        staging.put(np.zeros(1000, dtype=np.int64))
    staging.begin()
    for _ in range(MAX_SEGMENTS):
        staging.put_into(np.zeros(1, dtype=np.int32), lens[:1])
    with pytest.raises(RuntimeError, match="more than"):
        staging.put_into(np.zeros(1, dtype=np.int32), lens[:1])
    with pytest.raises(ValueError, match="4- or 8-byte"):
        DeviceArena([((4,), torch.bfloat16)], CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packing_waits_for_the_copy_out_of_its_pinned_buffer():
    """Steps that sample nothing leave the host free to run ahead of a busy GPU: packing step
    n + 2 must not overwrite the pinned bytes that step n's queued copy has yet to read."""
    d = torch.device("cuda")
    arena = DeviceArena([((4096,), torch.int32)], d)
    staging = StepStaging(64_000, arena, d)
    snapshots = []
    for k in range(6):
        staging.begin()
        staging.put_into(np.full(4096, k, dtype=np.int32), arena.buffers[0])
        staging.flush(None)
        snapshots.append(arena.buffers[0].clone())
        torch.cuda._sleep(200_000_000)  # keep the compute stream busy, the host ahead
    assert [int(x[0]) for x in snapshots] == list(range(6))
    assert all(bool(x.eq(k).all()) for k, x in enumerate(snapshots))

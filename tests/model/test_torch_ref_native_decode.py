"""The torch backend's decode rows through the native paged decode kernel: the same outputs
as its torch path (gather, then fused attention by padded length) in decode-only and mixed
batches, the torch path kept for what the kernel does not do, and a decode request's bits
independent of the batch around it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.kernels.paged_cases import scattered_cache
from tokenmill.kernels.cpu.native import native_ops
from tokenmill.model.attention import torch_ref
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.model.attention.torch_ref import TorchAttentionImpl

BLOCK_SIZE = 16

pytestmark = pytest.mark.skipif(native_ops() is None, reason="native CPU kernels unavailable")


def make_step(q_lens, seq_lens, num_heads=9, num_kv_heads=3, head_dim=64, seed=0):
    """A step's query ``[T, H * D]``, a cache holding every request's context (scattered
    blocks, zeros elsewhere) and its metadata."""
    gen = torch.Generator().manual_seed(seed)
    cache, table = scattered_cache(seq_lens, num_kv_heads, head_dim, BLOCK_SIZE, gen, 0.0,
                                   spare_blocks=4, spare_columns=1)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    t = sum(q_lens)
    metadata = AttentionMetadata(
        num_actual_tokens=t, num_reqs=len(q_lens), query_start_loc=qsl, seq_lens=lens,
        block_table=table, slot_mapping=torch.zeros(t, dtype=torch.int64),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=lens.clone(),
    )  # fmt: skip
    query = torch.randn(t, num_heads * head_dim, generator=gen)
    return query, cache, metadata


def attend(impl, query, cache, md, native: bool, monkeypatch) -> tuple[torch.Tensor, int]:
    """``impl.attend`` with the native kernel or without it; also how many kernel calls."""
    calls = []
    ops = native_ops()

    def spy(*args):
        calls.append(args)
        return ops.paged_decode_attention(*args)

    fake = SimpleNamespace(paged_decode_attention=spy) if native else None
    with monkeypatch.context() as m:
        m.setattr(torch_ref, "native_ops", lambda: fake)
        out = impl.attend(query, cache, dataclasses.replace(md))  # no cached plan
    return out, len(calls)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize(
    "q_lens, seq_lens",
    [([1] * 6, [1, 16, 17, 230, 64, 65]), ([1, 1, 30, 1, 12], [40, 1, 30, 231, 50])],
    ids=["decode-only", "mixed"],
)
def test_native_decode_matches_the_torch_path(monkeypatch, q_lens, seq_lens, window):
    query, cache, md = make_step(q_lens, seq_lens)
    impl = TorchAttentionImpl(9, 64, 0.125, 3, sliding_window=window)
    native, calls = attend(impl, query, cache, md, True, monkeypatch)
    fallback, _ = attend(impl, query, cache, md, False, monkeypatch)
    assert calls == 1
    torch.testing.assert_close(native, fallback, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_caches_and_queries(monkeypatch, dtype):
    query, cache, md = make_step([1, 1, 9], [33, 100, 20], num_heads=4, num_kv_heads=4)
    impl = TorchAttentionImpl(4, 64, 0.125, 4)
    cache = cache.to(dtype)
    native, calls = attend(impl, query, cache, md, True, monkeypatch)
    fallback, _ = attend(impl, query, cache, md, False, monkeypatch)
    assert calls == 1
    torch.testing.assert_close(native, fallback, rtol=1e-5, atol=1e-5)
    half_native, _ = attend(impl, query.to(dtype), cache, md, True, monkeypatch)
    half_fallback, _ = attend(impl, query.to(dtype), cache, md, False, monkeypatch)
    assert half_native.dtype == dtype
    torch.testing.assert_close(half_native, half_fallback, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "features, head_dim",
    [
        (dict(logits_soft_cap=5.0), 64),
        (dict(sinks=torch.zeros(9)), 64),
        (dict(attention_chunk_size=32), 64),
        ({}, 8),
    ],
    ids=["soft-cap", "sinks", "chunks", "head-dim-8"],
)
def test_what_the_kernel_does_not_do_takes_the_torch_path(monkeypatch, features, head_dim):
    query, cache, md = make_step([1, 1], [40, 7], head_dim=head_dim)
    impl = TorchAttentionImpl(9, head_dim, 0.125, 3, **features)
    native, calls = attend(impl, query, cache, md, True, monkeypatch)
    fallback, _ = attend(impl, query, cache, md, False, monkeypatch)
    assert calls == 0
    assert torch.equal(native, fallback)


def test_a_decode_row_has_the_same_bits_alone_and_in_a_mixed_batch(monkeypatch):
    query, cache, md = make_step([1, 25, 1, 1], [230, 25, 17, 1])
    impl = TorchAttentionImpl(9, 64, 0.125, 3)
    batched, _ = attend(impl, query, cache, md, True, monkeypatch)
    starts = md.query_start_loc_cpu.tolist()
    for i in (0, 2, 3):
        row = starts[i]
        one = torch.tensor([0, 1], dtype=torch.int32)
        lens = md.seq_lens[i : i + 1]
        alone = AttentionMetadata(
            num_actual_tokens=1, num_reqs=1, query_start_loc=one, seq_lens=lens,
            block_table=md.block_table[i : i + 1], slot_mapping=torch.zeros(1, dtype=torch.int64),
            max_query_len=1, max_seq_len=int(lens[0]), query_start_loc_cpu=one.clone(),
            seq_lens_cpu=lens.clone(),
        )  # fmt: skip
        out, calls = attend(impl, query[row : row + 1], cache, alone, True, monkeypatch)
        assert calls == 1
        assert torch.equal(out[0], batched[row])

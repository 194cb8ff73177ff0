"""Batches and runners shared by the Triton attention tests, which run by Triton's
interpreter (``TRITON_INTERPRET=1``) on CPU in float32. Import this module before any
attention kernel: it switches the interpreter on (the switch is read when kernels are
defined) and skips the importing test module where it cannot take effect.

Every batch uses scattered block ids, spare block-table columns holding other valid ids and
sequence lengths that are not multiples of the block size. Cache slots no request has written
hold NaN (as a ``torch.empty`` cache may), so a kernel that reads past a sequence's end fails;
the reference sees them as zeros. Outputs are poisoned with NaN before each run, so a real
token's row that a kernel forgets to write fails too.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if torch.cuda.is_available():
    # NOTE: the interpreter switch is process-wide and read when kernels are defined; with a
    # GPU present the kernels must compile for it, and the GPU test file covers them.
    pytest.skip("CUDA present: tests/gpu/test_triton_attention_gpu.py", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from triton.runtime import interpreter  # noqa: E402

from tokenmill.kernels.attention import paged  # noqa: E402
from tokenmill.kernels.attention import prefill as kernels  # noqa: E402
from tokenmill.kernels.attention.cache_write import reshape_and_cache  # noqa: E402
from tokenmill.kernels.attention.launch import TileConfig  # noqa: E402
from tokenmill.model.attention.backend import AttentionMetadata  # noqa: E402
from tokenmill.model.attention.torch_ref import (  # noqa: E402
    TorchAttentionImpl,
    write_to_kv_cache,
)
from tokenmill.model.attention.triton_backend import TritonAttentionImpl  # noqa: E402

if not isinstance(kernels.varlen_attention_kernel, interpreter.InterpretedFunction):
    pytest.skip("Triton kernels were defined before TRITON_INTERPRET=1", allow_module_level=True)


@dataclasses.dataclass
class Batch:
    query: torch.Tensor  # [T, H * D]
    key: torch.Tensor  # [T, Hkv * D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]; NaN where never written
    metadata: AttentionMetadata
    num_heads: int
    num_kv_heads: int
    head_dim: int


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    extra_tokens: int = 0,
    num_decodes: int = 0,
    max_seq_len: int | None = None,
    query_scale: float = 1.0,
    seed: int = 0,
) -> Batch:
    """Requests with ``q_lens[i]`` new tokens after ``ctx_lens[i]`` cached ones (random K/V
    in the cache; every other slot NaN).

    ``extra_tokens`` rows past ``num_actual_tokens`` carry valid-looking slots in a block no
    request owns: they must not be written.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    stray_block = free.pop()
    tables = [[free.pop() for _ in range(n)] for n in needed]
    width = max(needed, default=0) + 1
    rows = [
        t + torch.randint(num_blocks, (width - len(t),), generator=gen).tolist() for t in tables
    ]
    slots = [
        table[p // block_size] * block_size + p % block_size
        for table, s, q in zip(tables, seq_lens, q_lens, strict=True)
        for p in range(s - q, s)
    ]
    n = len(slots)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    for table, c in zip(tables, ctx_lens, strict=True):
        cached = [table[p // block_size] * block_size + p % block_size for p in range(c)]
        flat[:, cached] = torch.randn(2, c, num_kv_heads, head_dim, generator=gen)
    slots += [stray_block * block_size + i % block_size for i in range(extra_tokens)]
    t = len(slots)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=n,
        num_reqs=len(q_lens),
        query_start_loc=qsl,
        seq_lens=sl,
        block_table=torch.tensor(rows, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(q_lens),
        max_seq_len=max_seq_len or max(seq_lens),
        query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=sl.clone(),
        num_decodes=num_decodes,
    )
    return Batch(
        query=torch.randn(t, num_heads * head_dim, generator=gen) * query_scale,
        key=torch.randn(t, num_kv_heads * head_dim, generator=gen),
        value=torch.randn(t, num_kv_heads * head_dim, generator=gen),
        kv_cache=kv_cache,
        metadata=metadata,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )


def run_triton(
    b: Batch, sliding_window: int | None = None, soft_cap: float | None = None, **features
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache write + attention through the Triton impl; output poisoned with NaN first.
    ``features``: further ``AttentionImpl`` arguments (``attention_chunk_size``, ``sinks``)."""
    impl = TritonAttentionImpl(
        b.num_heads, b.head_dim, b.head_dim**-0.5, b.num_kv_heads, sliding_window, soft_cap,
        **features,
    )
    cache = b.kv_cache.clone()
    md = dataclasses.replace(b.metadata)
    reshape_and_cache(b.key, b.value, cache, md.slot_mapping, md.num_actual_tokens)
    out = torch.full((b.query.shape[0], b.num_heads * b.head_dim), float("nan"))
    assert impl.attend(b.query, cache, md, out=out) is out
    return out, cache


def run_reference(
    b: Batch, sliding_window: int | None = None, soft_cap: float | None = None, **features
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference's output (on the cache with NaN read as 0) and the cache it
    leaves (NaN kept where nothing was written)."""
    impl = TorchAttentionImpl(
        b.num_heads, b.head_dim, b.head_dim**-0.5, b.num_kv_heads, sliding_window, soft_cap,
        **features,
    )
    md = dataclasses.replace(b.metadata)
    out = impl.forward(b.query, b.key, b.value, torch.nan_to_num(b.kv_cache, nan=0.0), md)
    cache = b.kv_cache.clone()
    n = md.num_actual_tokens
    write_to_kv_cache(b.key[:n], b.value[:n], cache, md.slot_mapping[:n])
    return out, cache


def assert_same_cache(cache: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(cache, expected, atol=0, rtol=0, equal_nan=True)


def check(
    b: Batch, sliding_window: int | None = None, soft_cap: float | None = None, **features
) -> None:
    out, cache = run_triton(b, sliding_window, soft_cap, **features)
    ref_out, ref_cache = run_reference(b, sliding_window, soft_cap, **features)
    n = b.metadata.num_actual_tokens
    torch.testing.assert_close(out[:n], ref_out[:n], atol=1e-4, rtol=1e-4)
    assert_same_cache(cache, ref_cache)


# Two decodes, a fresh prompt, a chunk after cached context.
MIXED_Q = [1, 1, 37, 21]
MIXED_CTX = [40, 17, 0, 50]


def use_tiles(monkeypatch, varlen: TileConfig, decode: TileConfig) -> None:
    monkeypatch.setattr(paged, "varlen_tile_config", lambda *args: varlen)
    monkeypatch.setattr(paged, "decode_tile_config", lambda *args: decode)


# The fp32 tiles (16 x 16), the bf16/fp16 ones the GPU runs at head_dim <= 128, those of
# short whole-step graphs, and the 32-key decode tile of grids that one warp a program fits
# in one wave.
TILE_SHAPES = {
    "fp32": (TileConfig(16, 16, 4, 1), TileConfig(16, 16, 4, 2)),
    "half": (TileConfig(128, 64, 8, 3), TileConfig(16, 64, 4, 3)),
    "half_short": (TileConfig(64, 128, 4, 2), TileConfig(16, 64, 4, 3)),
    "half_decode32": (TileConfig(128, 64, 8, 3), TileConfig(16, 32, 1, 4)),
}


def padded_decode_batch(real: Batch, pad: int) -> Batch:
    """``real`` (decodes only) with ``pad`` padding requests after it, as a CUDA graph's
    padded batch has them: one token each (random q/k/v), slot -1, context length 0."""
    md = real.metadata
    qsl = torch.arange(md.num_reqs + pad + 1, dtype=torch.int32)
    sl = torch.cat([md.seq_lens, torch.zeros(pad, dtype=torch.int32)])
    padded = dataclasses.replace(
        md,
        num_actual_tokens=md.num_reqs + pad,
        num_reqs=md.num_reqs + pad,
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=sl,
        seq_lens_cpu=sl.clone(),
        block_table=torch.cat([md.block_table, torch.zeros_like(md.block_table[:pad])]),
        slot_mapping=torch.cat([md.slot_mapping, torch.full((pad,), -1)]),
        num_decodes=md.num_reqs + pad,
    )
    grow = lambda x: torch.cat([x, torch.randn(pad, x.shape[1])])  # noqa: E731
    return dataclasses.replace(
        real, query=grow(real.query), key=grow(real.key), value=grow(real.value), metadata=padded
    )


def share_prefix(b: Batch, num_decodes: int, prefix_blocks: int) -> Batch:
    """The first ``num_decodes`` requests' first ``prefix_blocks`` block-table entries point
    at request 0's blocks (a prompt prefix found by prefix caching); the blocks they held
    before are left unread."""
    table = b.metadata.block_table.clone()
    table[1:num_decodes, :prefix_blocks] = table[0, :prefix_blocks]
    bs = b.kv_cache.shape[2]
    md = dataclasses.replace(b.metadata, block_table=table, common_prefix_len=prefix_blocks * bs)
    return dataclasses.replace(b, metadata=md)

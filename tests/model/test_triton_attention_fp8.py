"""FP8 KV caches (e4m3 and e5m2): the Triton cache write and attention kernels, run by Triton's
interpreter on CPU, against the float32 torch reference attending over the same FP8 values
widened to float32, on batches of decodes, fresh prompts and chunks after cached context in
scattered blocks (``triton_attention_cases``).

The interpreter (Triton 3.7) converts to FP8 wrongly where rounding carries into the exponent
(7.9 becomes 4, not 8) and reads FP8 NaN as a number, so here new keys and values lie on the
FP8 grid already and unwritten slots hold zeros; tests/gpu/test_fp8_gpu.py checks the
hardware's rounding and the NaN-poisoned cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.model.triton_attention_cases import (  # first: switches the interpreter on
    MIXED_CTX,
    MIXED_Q,
    TILE_SHAPES,
    make_batch,
    use_tiles,
)
from tokenmill.kernels.attention.cache_write import reshape_and_cache
from tokenmill.model.attention.torch_ref import TorchAttentionImpl, write_to_kv_cache
from tokenmill.model.attention.triton_backend import TritonAttentionImpl

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")

FP8_TYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fp8_batch(dtype: torch.dtype, **kwargs):
    b = make_batch(MIXED_Q, MIXED_CTX, num_decodes=2, **kwargs)
    on_grid = lambda x: x.to(dtype).float()  # noqa: E731
    return dataclasses.replace(b, kv_cache=torch.nan_to_num(b.kv_cache).to(dtype),
                               key=on_grid(b.key), value=on_grid(b.value))


def _reference(b, sliding_window=None):
    """The float32 reference over the FP8 cache it writes, widened to float32."""
    cache = b.kv_cache.clone()
    n = b.metadata.num_actual_tokens
    write_to_kv_cache(b.key[:n], b.value[:n], cache, b.metadata.slot_mapping[:n])
    impl = TorchAttentionImpl(b.num_heads, b.head_dim, b.head_dim**-0.5, b.num_kv_heads,
                              sliding_window)
    wide = torch.nan_to_num(cache.float(), nan=0.0)
    out = impl.attend(b.query, wide, dataclasses.replace(b.metadata))
    return out, cache


def _triton(b, sliding_window=None):
    impl = TritonAttentionImpl(b.num_heads, b.head_dim, b.head_dim**-0.5, b.num_kv_heads,
                               sliding_window)
    cache = b.kv_cache.clone()
    md = dataclasses.replace(b.metadata)
    reshape_and_cache(b.key, b.value, cache, md.slot_mapping, md.num_actual_tokens)
    out = torch.full((b.query.shape[0], b.num_heads * b.head_dim), float("nan"))
    impl.attend(b.query, cache, md, out=out)
    return out, cache


@pytest.mark.parametrize("dtype", FP8_TYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("tiles", ["fp32", "half"])
def test_fp8_cache_matches_float32_reference(monkeypatch, dtype, tiles):
    use_tiles(monkeypatch, *TILE_SHAPES[tiles])
    b = _fp8_batch(dtype, head_dim=64)
    out, cache = _triton(b)
    ref_out, ref_cache = _reference(b)
    n = b.metadata.num_actual_tokens
    torch.testing.assert_close(out[:n], ref_out[:n], atol=1e-4, rtol=1e-4)
    # The kernel's rounding to FP8 is the reference's (round to nearest even).
    torch.testing.assert_close(cache.float(), ref_cache.float(), atol=0, rtol=0, equal_nan=True)


def test_fp8_cache_with_a_sliding_window():
    b = _fp8_batch(torch.float8_e4m3fn)
    out, _ = _triton(b, sliding_window=20)
    ref_out, _ = _reference(b, sliding_window=20)
    n = b.metadata.num_actual_tokens
    torch.testing.assert_close(out[:n], ref_out[:n], atol=1e-4, rtol=1e-4)


def test_fp8_writes_saturate_instead_of_overflowing():
    """Keys beyond e4m3's range (448) are stored as +-448, never NaN, by both writers."""
    b = _fp8_batch(torch.float8_e4m3fn)
    b = dataclasses.replace(b, key=b.key * 1024)  # still on the grid: powers of two
    _, cache = _triton(b)
    _, ref_cache = _reference(b)
    n = b.metadata.num_actual_tokens
    slots = b.metadata.slot_mapping[:n].long()
    written = cache[0].flatten(0, 1)[slots].float()
    assert torch.isfinite(written).all() and written.abs().max() == 448
    torch.testing.assert_close(cache.float(), ref_cache.float(), atol=0, rtol=0, equal_nan=True)

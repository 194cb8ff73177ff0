"""The decode kernel's rotary path (``TritonAttentionImpl.attend_decode_rotary``) against
rotating with the torch ``RotaryEmbedding``, writing, then attending, in Triton's
interpreter on CPU in float32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.model.triton_attention_cases import (  # first: switches the interpreter on
    MIXED_CTX,
    MIXED_Q,
    make_batch,
    padded_decode_batch,
    run_reference,
)
from tokenmill.kernels.attention import paged
from tokenmill.model.attention.backend import DecodeRotary
from tokenmill.model.attention.triton_backend import TritonAttentionImpl
from tokenmill.model.layers.rotary import RotaryEmbedding

# An empty split's log-sum-exp is log2(0) = -inf by design.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")

HEAD_DIM = 16


def _rope(rotary_dim: int, neox: bool) -> RotaryEmbedding:
    # A small base: every frequency turns far within the batch's 60 positions.
    return RotaryEmbedding(HEAD_DIM, rotary_dim, 128, base=10.0, is_neox_style=neox)


@pytest.mark.parametrize(
    "neox, rotary_dim, window",
    [(True, 16, None), (False, 16, None), (True, 8, None), (True, 16, 20)],
)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_with_rope_in_the_kernel(monkeypatch, small_tiles, splits, neox, rotary_dim, window):
    """The same output and cache as rotating, writing, then attending; the inputs are left
    unrotated, and padding rows write nothing."""
    monkeypatch.setattr(paged, "num_decode_splits", lambda *args: splits)
    real = make_batch([1] * 3, [50, 9, 31], head_dim=HEAD_DIM, num_decodes=3, seed=5)
    b = padded_decode_batch(real, 2)
    rope = _rope(rotary_dim, neox)
    impl = TritonAttentionImpl(real.num_heads, HEAD_DIM, HEAD_DIM**-0.5, real.num_kv_heads,
                               window, None)  # fmt: skip
    cache = real.kv_cache.clone()
    out = torch.full((b.query.shape[0], real.num_heads * HEAD_DIM), float("nan"))
    before = b.query.clone(), b.key.clone()
    rotary = DecodeRotary(rope.cos_sin_cache, rotary_dim, neox)
    assert impl.attend_decode_rotary(b.query, b.key, b.value, cache, b.metadata, rotary, out) is out
    assert torch.equal(b.query, before[0]) and torch.equal(b.key, before[1])

    query, key = rope((real.metadata.seq_lens - 1).long(), real.query, real.key)
    ref_out, ref_cache = run_reference(
        dataclasses.replace(real, query=query, key=key), sliding_window=window
    )
    torch.testing.assert_close(out[:3], ref_out, atol=1e-4, rtol=1e-4)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    torch.testing.assert_close(cache, ref_cache, atol=1e-6, rtol=1e-6, equal_nan=True)


def test_decode_with_rope_asks_for_the_rotary_kernel_tiles(monkeypatch, small_tiles):
    """The rotary kernel holds more registers, so its launch asks for its own tiles."""
    asked = []
    small = paged.decode_tile_config  # the small_tiles stand-in

    def config(*args):
        asked.append(args[5])
        return small(*args)

    monkeypatch.setattr(paged, "decode_tile_config", config)
    b = make_batch([1] * 3, [50, 9, 31], head_dim=HEAD_DIM, num_decodes=3)
    impl = TritonAttentionImpl(b.num_heads, HEAD_DIM, HEAD_DIM**-0.5, b.num_kv_heads)
    rope = _rope(HEAD_DIM, True)
    rotary = DecodeRotary(rope.cos_sin_cache, HEAD_DIM, True)
    impl.attend_decode_rotary(b.query, b.key, b.value, b.kv_cache.clone(), b.metadata, rotary)
    assert asked == [True]


def test_decode_with_rope_refuses_prompt_tokens():
    b = make_batch(MIXED_Q, MIXED_CTX, head_dim=HEAD_DIM)
    impl = TritonAttentionImpl(b.num_heads, HEAD_DIM, 1.0, b.num_kv_heads)
    rope = _rope(HEAD_DIM, True)
    with pytest.raises(ValueError, match="decode-only"):
        impl.attend_decode_rotary(
            b.query, b.key, b.value, b.kv_cache, b.metadata,
            DecodeRotary(rope.cos_sin_cache, HEAD_DIM, True),
        )  # fmt: skip

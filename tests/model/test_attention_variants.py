"""Attention sinks and chunked local attention (with windows and soft caps beside them):
the torch reference backend against a dense float32 reference written token by token, and
the Triton kernels (Triton's interpreter, float32) against the torch reference over every
path a batch can take: decode splits merged by the last split or by a reduction, prompt
key splits, cascade attention over a shared prefix, padded and uniform-grid batches, and
the decode launch that rotates and writes the new K/V itself.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.model.triton_attention_cases import (  # first: switches the interpreter on
    MIXED_CTX,
    MIXED_Q,
    TILE_SHAPES,
    Batch,
    assert_same_cache,
    check,
    make_batch,
    padded_decode_batch,
    run_reference,
    run_triton,
    share_prefix,
    use_tiles,
)
from tokenmill.kernels.attention import paged
from tokenmill.model.attention.backend import AttentionImpl
from tokenmill.model.attention.torch_ref import TorchAttentionImpl

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")

# Sink logits around the scores' scale: some rows give the sink most of their weight.
SINKS = torch.tensor([0.5, -1.0, 2.5, 0.0, 1.5, -3.0, 4.0, 0.25])


def sinks(num_heads: int) -> torch.Tensor:
    return SINKS[:num_heads].clone()


def dense_reference(
    b: Batch, window=None, soft_cap=None, chunk=None, sink=None, last_key_pos=None
) -> torch.Tensor:
    """Each query token's attention written out: its visible keys (causal, or up to
    ``last_key_pos[t]``; within the window or its chunk), scaled scores, the cap, the sink in
    the denominator. float64."""
    md = b.metadata
    h, hkv, d = b.num_heads, b.num_kv_heads, b.head_dim
    cache = torch.nan_to_num(b.kv_cache, nan=0.0).double()
    bs = cache.shape[2]
    flat_k = cache[0].reshape(-1, hkv, d)
    flat_v = cache[1].reshape(-1, hkv, d)
    n = md.num_actual_tokens
    for t in range(n):  # this step's K/V first, as the backends write them
        slot = int(md.slot_mapping[t])
        flat_k[slot] = b.key[t].view(hkv, d).double()
        flat_v[slot] = b.value[t].view(hkv, d).double()
    out = torch.zeros(n, h, d, dtype=torch.float64)
    starts = md.query_start_loc_cpu.tolist()
    for r in range(md.num_reqs):
        seq_len = int(md.seq_lens_cpu[r])
        q_len = starts[r + 1] - starts[r]
        slots = [int(md.block_table[r, p // bs]) * bs + p % bs for p in range(seq_len)]
        k, v = flat_k[slots], flat_v[slots]  # [L, Hkv, D]
        for i in range(q_len):
            pos = seq_len - q_len + i
            hi = pos + 1 if last_key_pos is None else int(last_key_pos[starts[r] + i]) + 1
            lo = 0
            if window is not None:
                lo = max(0, pos - window + 1)
            if chunk is not None:
                lo = pos // chunk * chunk
            q = b.query[starts[r] + i].view(h, d).double()
            for head in range(h):
                kv = head // (h // hkv)
                s = (k[lo:hi, kv] @ q[head]) * d**-0.5
                if soft_cap is not None:
                    s = soft_cap * torch.tanh(s / soft_cap)
                w = torch.exp(s - s.max())
                denom = w.sum()
                if sink is not None:
                    denom = denom + math.exp(float(sink[head]) - float(s.max()))
                out[starts[r] + i, head] = (w / denom) @ v[lo:hi, kv]
    return out.view(n, h * d)


@pytest.mark.parametrize(
    "features",
    [
        dict(sink=True),
        dict(chunk=16),
        dict(chunk=7, sink=True),
        dict(window=9, sink=True, soft_cap=3.0),
        dict(chunk=40, soft_cap=3.0),
    ],
    ids=str,
)
def test_torch_reference_matches_dense_attention(features):
    b = make_batch(MIXED_Q, [40, 17, 0, 50], num_heads=8, num_kv_heads=2, num_decodes=2,
                   query_scale=3.0)  # fmt: skip
    sink = sinks(8) if features.get("sink") else None
    impl = TorchAttentionImpl(8, 16, 16**-0.5, 2, features.get("window"),
                              features.get("soft_cap"), features.get("chunk"), sink)  # fmt: skip
    out = impl.forward(b.query, b.key, b.value, torch.nan_to_num(b.kv_cache, nan=0.0),
                       dataclasses.replace(b.metadata))  # fmt: skip
    expected = dense_reference(b, features.get("window"), features.get("soft_cap"),
                               features.get("chunk"), sink)  # fmt: skip
    torch.testing.assert_close(out[: len(expected)].double(), expected, atol=1e-5, rtol=1e-5)


def test_sinks_lower_every_weight():
    """A sink of -inf is no sink; a finite one takes weight from every key, so the output
    shrinks by the share it takes (values here are one constant vector)."""
    b = make_batch([6], [10], num_heads=2, num_kv_heads=1)
    ones = torch.ones_like(b.value)
    cache = torch.ones_like(b.kv_cache)
    md = dataclasses.replace(b.metadata)
    plain = TorchAttentionImpl(2, 16, 0.25, 1).forward(b.query, b.key, ones, cache, md)
    none = torch.full((2,), float("-inf"))
    same = TorchAttentionImpl(2, 16, 0.25, 1, sinks=none).forward(b.query, b.key, ones, cache, md)
    torch.testing.assert_close(same, plain)
    big = torch.full((2,), 50.0)
    tiny = TorchAttentionImpl(2, 16, 0.25, 1, sinks=big).forward(b.query, b.key, ones, cache, md)
    assert tiny.abs().max() < 1e-6


def test_window_and_chunk_together_are_refused():
    with pytest.raises(ValueError, match="either a sliding window or attention chunks"):
        TorchAttentionImpl(2, 16, 0.25, 1, sliding_window=8, attention_chunk_size=8)
    with pytest.raises(ValueError, match=r"sinks must be \[4\]"):
        TorchAttentionImpl(4, 16, 0.25, 1, sinks=torch.zeros(3))
    assert issubclass(TorchAttentionImpl, AttentionImpl)


# ---- Triton (interpreter) against the torch reference ------------------------------------


@pytest.mark.parametrize("tiles", sorted(TILE_SHAPES))
@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
def test_chunk_edges_inside_and_across_tiles(monkeypatch, tiles, chunk):
    use_tiles(monkeypatch, *TILE_SHAPES[tiles])
    b = make_batch([1, 70, 45], [60, 0, 90], num_kv_heads=1, block_size=8, num_decodes=1)
    check(b, attention_chunk_size=chunk)


@pytest.mark.parametrize("tiles", ["fp32", "half"])
def test_sinks_in_a_mixed_batch(monkeypatch, tiles):
    use_tiles(monkeypatch, *TILE_SHAPES[tiles])
    b = make_batch(MIXED_Q, MIXED_CTX, num_heads=8, num_kv_heads=2, num_decodes=2,
                   query_scale=3.0)  # fmt: skip
    check(b, sinks=sinks(8))
    check(b, sliding_window=12, soft_cap=5.0, sinks=sinks(8))
    check(b, attention_chunk_size=24, sinks=sinks(8))


def test_context_outside_the_chunk_is_never_read(small_tiles):
    # Keys before each query's chunk are poisoned for the kernels only.
    chunk, q_lens, ctx_lens = 32, [1, 1, 30], [75, 44, 60]
    b = make_batch(q_lens, ctx_lens, num_kv_heads=1, block_size=8, num_decodes=2)
    ref_out, _ = run_reference(b, attention_chunk_size=chunk)
    md = b.metadata
    poisoned = b.kv_cache.clone()
    flat = poisoned.view(2, -1, *poisoned.shape[3:])
    for i, ctx in enumerate(ctx_lens):
        first_visible = ctx // chunk * chunk  # the chunk start of the request's first query
        stale = [int(md.block_table[i, p // 8]) * 8 + p % 8 for p in range(first_visible)]
        flat[:, stale] = float("nan")
    out, _ = run_triton(dataclasses.replace(b, kv_cache=poisoned), attention_chunk_size=chunk)
    n = md.num_actual_tokens
    torch.testing.assert_close(out[:n], ref_out[:n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("self_merge", [True, False], ids=["self-merge", "reduction"])
@pytest.mark.parametrize("splits", [1, 5])
def test_sinks_counted_once_over_decode_splits(monkeypatch, splits, self_merge):
    # 5 splits of short contexts leave most of them empty; the sink rides on the first.
    if not self_merge:
        monkeypatch.setattr(paged, "MERGE_COUNTER_SLOTS", 0)
    monkeypatch.setattr(paged, "num_decode_splits", lambda *args: splits)
    real = make_batch([1] * 3, [300, 2, 47], num_heads=4, num_kv_heads=1, num_decodes=3)
    ref_out, ref_cache = run_reference(real, sinks=sinks(4))
    out, cache = run_triton(padded_decode_batch(real, 2), sinks=sinks(4))
    torch.testing.assert_close(out[:3], ref_out, atol=1e-4, rtol=1e-4)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))  # padding rows: no keys, no sink
    assert_same_cache(cache, ref_cache)
    check(real, attention_chunk_size=64, sinks=sinks(4))


# 7 splits exceed the key tiles of the longest request (some splits are empty); the
# interpreter's cost grows with the splits, so that case runs with both features only.
@pytest.mark.parametrize("splits,chunk", [(2, None), (2, 20), (7, 20)])
def test_sinks_and_chunks_over_prompt_key_splits(monkeypatch, small_tiles, splits, chunk):
    monkeypatch.setattr(paged, "num_varlen_splits", lambda *args: splits)
    b = make_batch(MIXED_Q, MIXED_CTX, num_decodes=2)
    check(b, attention_chunk_size=chunk, sinks=sinks(4))


def test_cascade_attention_with_sinks():
    # Sinks keep cascade on (the decode kernel's first split holds them); chunks turn it off.
    q_lens, ctx = [1, 1, 1, 1, 1, 9], [400, 350, 341, 500, 336, 20]
    b = share_prefix(make_batch(q_lens, ctx, num_heads=8, num_kv_heads=2, num_decodes=5), 5, 6)
    check(b, sinks=sinks(8))
    check(b, attention_chunk_size=128, sinks=sinks(8))


def test_uniform_grids_with_chunks_and_sinks(monkeypatch, small_tiles):
    """A mixed batch launched as a whole-step graph's uniform grids (see
    ``test_uniform_grids_of_a_padded_mixed_batch``)."""
    monkeypatch.setattr(paged, "num_decode_splits", lambda *args: 3)
    real = make_batch([1, 1, 21, 9], [40, 17, 50, 0])
    md = real.metadata
    n, r, tokens, reqs = md.num_actual_tokens, md.num_reqs, 40, 8
    qsl = torch.cat([md.query_start_loc, torch.arange(n + 1, n + 1 + reqs - r)])
    sl = torch.cat([md.seq_lens, torch.zeros(reqs - r, dtype=torch.int32)])
    padded = dataclasses.replace(
        md, num_actual_tokens=tokens, num_reqs=reqs, query_start_loc=qsl.to(torch.int32),
        seq_lens=sl, block_table=torch.cat([md.block_table, md.block_table[:1].expand(4, -1)]),
        slot_mapping=torch.cat([md.slot_mapping, torch.full((tokens - n,), -1)]),
        max_query_len=1, max_seq_len=1024, uniform_grids=True,
        prefill_range=torch.tensor([2, 2], dtype=torch.int32),
    )  # fmt: skip
    grow = lambda x: torch.cat([x, torch.randn(tokens - n, x.shape[1])])  # noqa: E731
    b = dataclasses.replace(
        real, query=grow(real.query), key=grow(real.key), value=grow(real.value), metadata=padded
    )
    for features in (dict(attention_chunk_size=16, sinks=sinks(4)), dict(sinks=sinks(4))):
        out, cache = run_triton(b, **features)
        ref_out, ref_cache = run_reference(real, **features)
        torch.testing.assert_close(out[:n], ref_out, atol=1e-4, rtol=1e-4)
        assert_same_cache(cache, ref_cache)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_with_rope_in_the_kernel_with_chunks_and_sinks(monkeypatch, small_tiles, splits):
    """The rotating decode launch (Llama 4's interleaved RoPE on chunked layers; gpt-oss'
    NeoX RoPE with sinks) equals rotating, writing, then attending."""
    from tokenmill.model.attention.backend import DecodeRotary
    from tokenmill.model.attention.triton_backend import TritonAttentionImpl
    from tokenmill.model.layers.rotary import RotaryEmbedding

    monkeypatch.setattr(paged, "num_decode_splits", lambda *args: splits)
    real = make_batch([1] * 3, [50, 9, 31], num_decodes=3, seed=5)
    b = padded_decode_batch(real, 2)
    for neox, features in ((False, dict(attention_chunk_size=16)), (True, dict(sinks=sinks(4)))):
        rope = RotaryEmbedding(16, 16, 128, base=10.0, is_neox_style=neox)
        impl = TritonAttentionImpl(4, 16, 0.25, 2, **features)
        cache = real.kv_cache.clone()
        out = impl.attend_decode_rotary(b.query, b.key, b.value, cache, b.metadata,
                                        DecodeRotary(rope.cos_sin_cache, 16, neox))  # fmt: skip
        query, key = rope((real.metadata.seq_lens - 1).long(), real.query, real.key)
        rotated = dataclasses.replace(real, query=query, key=key)
        impl_ref = TorchAttentionImpl(4, 16, 0.25, 2, **features)
        ref_out = impl_ref.forward(rotated.query, rotated.key, rotated.value,
                                   torch.nan_to_num(real.kv_cache, nan=0.0),
                                   dataclasses.replace(real.metadata))  # fmt: skip
        torch.testing.assert_close(out[:3], ref_out, atol=1e-4, rtol=1e-4)


# ---- bidirectional spans (Gemma 3's image tokens) ------------------------------------------

# Request 2 (a fresh 37-token prompt): two spans, the second ending before the chunk does;
# request 3 (21 tokens after 50 cached): a span begun in the cached context, one ending the
# chunk. Decodes have none.
SPANS = {2: [(3, 19), (20, 36)], 3: [(45, 60), (62, 71)]}


def with_spans(b: Batch, spans: dict[int, list[tuple[int, int]]]) -> Batch:
    """``b`` with ``metadata.last_key_pos``: each token's own position, or ``end - 1`` for a
    token in one of its request's spans ``[start, end)`` (absolute positions)."""
    md = b.metadata
    starts = md.query_start_loc_cpu.tolist()
    last = torch.zeros(b.query.shape[0], dtype=torch.int32)
    for r in range(md.num_reqs):
        seq_len, q_len = int(md.seq_lens_cpu[r]), starts[r + 1] - starts[r]
        for i in range(q_len):
            pos = seq_len - q_len + i
            ends = [hi - 1 for lo, hi in spans.get(r, []) if lo <= pos < hi]
            last[starts[r] + i] = ends[0] if ends else pos
    return dataclasses.replace(b, metadata=dataclasses.replace(md, last_key_pos=last))


@pytest.mark.parametrize(
    "features", [dict(), dict(window=9, soft_cap=3.0), dict(sink=True)], ids=str
)
def test_torch_reference_sees_whole_spans(features):
    b = with_spans(
        make_batch(MIXED_Q, MIXED_CTX, num_heads=8, num_kv_heads=2, num_decodes=2), SPANS
    )
    sink = sinks(8) if features.get("sink") else None
    impl = TorchAttentionImpl(8, 16, 16**-0.5, 2, features.get("window"),
                              features.get("soft_cap"), None, sink)  # fmt: skip
    out = impl.forward(b.query, b.key, b.value, torch.nan_to_num(b.kv_cache, nan=0.0),
                       dataclasses.replace(b.metadata))  # fmt: skip
    expected = dense_reference(b, features.get("window"), features.get("soft_cap"), None, sink,
                               b.metadata.last_key_pos)  # fmt: skip
    torch.testing.assert_close(out[: len(expected)].double(), expected, atol=1e-5, rtol=1e-5)
    causal = dense_reference(b, features.get("window"), features.get("soft_cap"), None, sink)
    assert not torch.allclose(expected, causal)  # the spans change the outputs


@pytest.mark.parametrize("tiles", ["fp32", "half"])
def test_spans_in_a_mixed_batch(monkeypatch, tiles):
    use_tiles(monkeypatch, *TILE_SHAPES[tiles])
    b = with_spans(make_batch(MIXED_Q, MIXED_CTX, num_decodes=2), SPANS)
    check(b)
    check(b, sliding_window=12, soft_cap=5.0, sinks=sinks(4))


@pytest.mark.parametrize("splits", [2, 5])
def test_spans_over_prompt_key_splits(monkeypatch, small_tiles, splits):
    monkeypatch.setattr(paged, "num_varlen_splits", lambda *args: splits)
    b = with_spans(make_batch([37, 21], [0, 50]), {0: SPANS[2], 1: SPANS[3]})
    check(b)
    check(b, sliding_window=10)

"""LoRA layers under tensor parallelism: which part of an adapter each rank keeps, and the
layers' products over 2 gloo ranks (one process each) against the unsharded formula
``y = x W^T + b + scale B (A x)`` per row, for column-parallel q/k/v (one KV head,
replicated on both ranks) and gate/up, and a row-parallel projection with a bias; with
the default half-sharded layers and with ``fully_sharded_loras``."""

from __future__ import annotations

import socket

import torch

from tokenmill.distributed import parallel_state
from tokenmill.lora.layers import LoRABatch, lora_layer
from tokenmill.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

RANK = 8  # --max-lora-rank
SLOTS = 3  # two adapters and slot 0 (none)
# Adapter ranks per slot: below the slot rank, and not a multiple of the tensor-parallel size.
ADAPTER_RANKS = {1: 8, 2: 3}
HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTERMEDIATE, OUT = 64, 16, 4, 1, 96, 48


def _build(kind: str, fully_sharded: bool, batch: LoRABatch):
    """The layer ``kind`` (its base built for this process's rank), its merged parts as
    ``(shard id, checkpoint output features)`` and its checkpoint input features."""
    if kind == "qkv":
        base = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS)
        parts = [("q", HEADS * HEAD_DIM), ("k", KV_HEADS * HEAD_DIM), ("v", KV_HEADS * HEAD_DIM)]
        in_features = HIDDEN
    elif kind == "gate_up":
        base = MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE, INTERMEDIATE])
        parts, in_features = [(0, INTERMEDIATE), (1, INTERMEDIATE)], HIDDEN
    else:
        base = RowParallelLinear(INTERMEDIATE, OUT, bias=True)
        parts, in_features = [(None, OUT)], INTERMEDIATE
    layer_parts = []
    for shard, _ in parts:
        s = base.shard_slices(shard)[0]
        layer_parts.append((shard, s.dst_start or 0, s.size or base.output_size))
    layer = lora_layer(base, layer_parts, SLOTS, RANK, torch.float32, batch, fully_sharded)
    return layer, parts, in_features


def _weights(parts, in_features, seed: int):
    """Full (unsharded) base weights per part, the bias, and each slot's adapters
    ``{slot: {shard: (A [r, in], B [out, r])}}``, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    weights = {shard: torch.randn(out, in_features, generator=g) / 8 for shard, out in parts}
    bias = torch.randn(sum(out for _, out in parts), generator=g)
    adapters = {
        slot: {
            shard: (torch.randn(r, in_features, generator=g), torch.randn(out, r, generator=g))
            for shard, out in parts
        }
        for slot, r in ADAPTER_RANKS.items()
    }
    return weights, bias, adapters


def test_each_rank_keeps_its_slice_of_an_adapter():
    """Column-parallel: A whole, B this rank's output features of the part (k/v whole when
    KV heads are replicated); fully sharded, A also this rank's block of the slot's ranks.
    Row-parallel: A this rank's input features, B whole; fully sharded, B this rank's
    output features."""
    a_q, b_q = torch.randn(8, HIDDEN), torch.randn(HEADS * HEAD_DIM, 8)
    a_k, b_k = torch.randn(8, HIDDEN), torch.randn(KV_HEADS * HEAD_DIM, 8)
    a_o, b_o = torch.randn(8, INTERMEDIATE), torch.randn(OUT, 8)
    batch = LoRABatch(torch.zeros(4, dtype=torch.int32))
    try:
        for rank in range(2):
            parallel_state.set_tensor_model_parallel(rank, 2)
            for fully in (False, True):
                qkv, _, _ = _build("qkv", fully, batch)
                a, b = qkv.shard_weights("q", a_q, b_q)
                half = slice(rank * 4, rank * 4 + 4) if fully else slice(None)
                assert torch.equal(a, a_q[half])
                assert torch.equal(b, b_q[rank * 32 : rank * 32 + 32])
                a, b = qkv.shard_weights("k", a_k, b_k)
                assert torch.equal(a, a_k[half]) and torch.equal(b, b_k)
                assert qkv.checkpoint_shape("k") == (KV_HEADS * HEAD_DIM, HIDDEN)
                o, _, _ = _build("o", fully, batch)
                a, b = o.shard_weights(None, a_o, b_o)
                assert torch.equal(a, a_o[:, rank * 48 : rank * 48 + 48])
                assert torch.equal(b, b_o[rank * 24 : rank * 24 + 24] if fully else b_o)
                assert o.checkpoint_shape(None) == (OUT, INTERMEDIATE)
    finally:
        parallel_state.set_tensor_model_parallel(0, 1)


def _reference(x, weights, bias, adapters, slots, parts):
    """``[T, sum of parts' outputs]``: the unsharded product, part after part."""
    ys = []
    for shard, _ in parts:
        y = x @ weights[shard].T
        for row, slot in enumerate(slots.tolist()):
            if slot:
                a, b = adapters[slot][shard]
                y[row] += (x[row] @ a.T) @ b.T
        ys.append(y)
    return torch.cat(ys, dim=1) + bias


def _rank_main(rank: int, port: int) -> None:
    parallel_state.init_model_parallel(rank, 2, 1, False, "gloo", f"tcp://127.0.0.1:{port}")
    torch.manual_seed(0)
    num_tokens = 11
    slots = torch.tensor([0, 1, 1, 1, 2, 2, 0, 1, 2, 0, 1], dtype=torch.int32)
    batch = LoRABatch(slots)
    for kind in ("qkv", "gate_up", "o"):
        for fully in (False, True):
            layer, parts, in_features = _build(kind, fully, batch)
            weights, bias, adapters = _weights(parts, in_features, seed=len(kind))
            base = layer.base
            for shard, w in weights.items():
                base.weight_loader(base.weight, w, shard)
            if kind == "o":
                base.weight_loader(base.bias, bias)
            else:
                bias = torch.zeros_like(bias)
            for slot, by_shard in adapters.items():
                layer.set_slot(slot, {s: layer.shard_weights(s, a, b) for s, (a, b) in
                                      by_shard.items()})  # fmt: skip
            x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(7))
            want = _reference(x, weights, bias, adapters, slots, parts)
            if kind == "o":  # input features split: this rank's slice in, every output out
                s = base.shard_slices(None)[0]
                got = layer(x[:, s.in_start : s.in_start + s.in_size])
            else:  # output features split: this rank's slice of every part
                got = layer(x)
                starts = [0]
                for _, out in parts[:-1]:
                    starts.append(starts[-1] + out)
                want = torch.cat([
                    want[:, start + s.src_start : start + s.src_start + s.size]
                    for (shard, _), start in zip(parts, starts, strict=True)
                    for s in base.shard_slices(shard)
                ], dim=1)  # fmt: skip
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"{kind} {fully}")
    parallel_state.destroy_model_parallel()


def test_layers_over_two_ranks_match_the_unsharded_product():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(port,), nprocs=2, join=True)


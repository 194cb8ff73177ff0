"""The MoE layer: per-expert checkpoint tensors loaded into the stacked weights, and the
layer's forward against the torch expert loop."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.moe.fused_moe import fused_experts_torch, select_experts
from tokenmill.model.layers.fused_moe import FusedMoE


def test_fused_moe_loads_per_expert_tensors_and_runs():
    torch.manual_seed(0)
    experts, hidden, inter = 4, 16, 24
    moe = FusedMoE(experts, 2, hidden, inter, renormalize=True)
    w1 = torch.randn(experts, inter, hidden)
    w3 = torch.randn(experts, inter, hidden)
    w2 = torch.randn(experts, hidden, inter)
    for e in range(experts):
        moe.w13.weight.weight_loader(moe.w13.weight, w1[e], (e, "gate"))
        moe.w13.weight.weight_loader(moe.w13.weight, w3[e], (e, "up"))
        moe.w2.weight.weight_loader(moe.w2.weight, w2[e], (e, "down"))
    assert torch.equal(moe.w13.weight, torch.cat([w1, w3], dim=1))
    assert torch.equal(moe.w2.weight, w2)
    x, logits = torch.randn(5, hidden), torch.randn(5, experts)
    weights, ids = select_experts(logits, 2, True)
    torch.testing.assert_close(moe(x, logits), fused_experts_torch(x, moe.w13.weight, w2,
                                                                   weights, ids))


def test_fused_moe_rejects_bad_shards():
    moe = FusedMoE(4, 2, 16, 24, renormalize=True)
    loader = moe.w13.weight.weight_loader
    with pytest.raises(ValueError, match="expert id 4"):
        loader(moe.w13.weight, torch.zeros(24, 16), (4, "gate"))
    with pytest.raises(ValueError, match="shard id"):
        loader(moe.w13.weight, torch.zeros(24, 16), None)
    with pytest.raises(ValueError, match="shape"):
        loader(moe.w13.weight, torch.zeros(48, 16), (0, "up"))


def test_expert_params_mapping_names():
    mapping = FusedMoE.expert_params_mapping(2, "w1", "w3", "w2")
    assert ("experts.w13", "experts.1.w3", (1, "up")) in mapping
    assert ("experts.w2", "experts.0.w2", (0, "down")) in mapping
    assert len(mapping) == 6


@pytest.mark.parametrize("kwargs, words", [
    ({"bias": True}, "without biases"),
    ({"mxfp4": True}, "without biases"),
    ({"checkpoint_layout": "gate_up_halves"}, "stacks them"),
])
def test_quantized_methods_refuse_experts_they_do_not_compute(kwargs, words):
    from tokenmill.model.layers.quantization.base import QuantizationError

    moe = FusedMoE(4, 2, 32, 64, renormalize=True, **kwargs)
    with pytest.raises(QuantizationError, match=words):
        moe.set_quant_method(object())

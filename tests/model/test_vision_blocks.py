"""The Qwen2.5-VL vision blocks' merged, zero-padded MLP: loading a checkpoint's gate, up
and down projections gives transformers' MLP output, and dummy weights keep the padding
zero (so the padding never changes an output)."""

from __future__ import annotations

import torch

from tokenmill.model.models.qwen2_5_vl_vision import VisionMLP


def test_padded_mlp_equals_the_checkpoint_mlp():
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    hidden, inter = 24, 50  # padded to 128
    gate, up, down = torch.nn.Linear(hidden, inter), torch.nn.Linear(hidden, inter), \
        torch.nn.Linear(inter, hidden)
    mlp = VisionMLP(hidden, inter, "silu")
    assert mlp.padded_size == 128
    with torch.no_grad():
        for shard, lin in ((0, gate), (1, up)):
            mlp.gate_up_proj.weight.weight_loader(mlp.gate_up_proj.weight, lin.weight, shard)
            mlp.gate_up_proj.bias.weight_loader(mlp.gate_up_proj.bias, lin.bias, shard)
        mlp.down_proj.weight.weight_loader(mlp.down_proj.weight, down.weight, None)
        mlp.down_proj.bias.copy_(down.bias)
        x = torch.randn(7, hidden)
        ref = down(ACT2FN["silu"](gate(x)) * up(x))
        torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-6)


def test_dummy_fill_keeps_the_padding_zero():
    mlp = VisionMLP(16, 40, "silu")
    gen = torch.Generator().manual_seed(0)
    for param in (mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight):
        param.dummy_fill(param, gen)
    p, i = mlp.padded_size, mlp.intermediate_size
    w = mlp.gate_up_proj.weight
    assert w[:i].abs().sum() > 0 and w[p : p + i].abs().sum() > 0
    assert not w[i:p].any() and not w[p + i :].any() and not mlp.gate_up_proj.bias[i:p].any()
    assert not mlp.down_proj.weight[:, i:].any()


def test_fused_tower_path_equals_the_torch_path(monkeypatch):
    """The blocks' CUDA branch (fused RMSNorm with the residual, the patch rotary, the SiLU
    gate) run by Triton's interpreter on CPU tensors equals the torch branch in float32."""
    import os

    import pytest

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    from tokenmill.model.models import qwen2_5_vl_vision as vv
    from tokenmill.model.models.qwen2_5_vl import _vision_tower

    vision = dict(depth=2, hidden_size=64, intermediate_size=100, num_heads=2,
                  out_hidden_size=32, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1],
                  hidden_act="silu")  # fmt: skip
    torch.manual_seed(0)
    tower = _vision_tower(vision).float().eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.05)
        for block in tower.blocks:
            block.mlp._zero_padding()
    grid = torch.tensor([[1, 8, 12], [1, 4, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    with torch.no_grad():
        ref = tower(pixels, grid_thw=grid)
        ref = getattr(ref, "pooler_output", ref)
        monkeypatch.setattr(vv, "use_triton", lambda x: True)
        got = tower(pixels, grid_thw=grid)
        got = getattr(got, "pooler_output", got)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)

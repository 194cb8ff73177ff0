"""RoPE scalings give transformers' frequencies and attention factors."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.layers.rotary import RotaryEmbedding

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(16)],
        "long_factor": [2.0 + 0.2 * i for i in range(16)],
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_inv_freq_matches_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = SCALINGS[name]
    config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rope_scaling=dict(scaling),
    )
    # longrope switches to the long factors past the original length, as we do with
    # a long max_model_len.
    seq_len = 256 if name == "longrope" else None
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu", seq_len)
    inv, factor = RotaryEmbedding._inv_freq(10000.0, 32, scaling, 256, 256)
    torch.testing.assert_close(inv.float(), ref_inv.float(), rtol=1e-5, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-6)


def test_neox_rotation_matches_rotate_half():
    rope = RotaryEmbedding(head_dim=16, rotary_dim=16, max_position=64, base=10000.0)
    q = torch.randn(5, 2 * 16)
    k = torch.randn(5, 16)
    pos = torch.tensor([0, 3, 7, 20, 63])
    q2, k2 = rope(pos, q, k)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).double() / 16))
    ang = pos[:, None].double() * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, :]

    def rotate_half(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat([-x2, x1], -1)

    qv = q.view(5, 2, 16)
    torch.testing.assert_close(q2.view(5, 2, 16), qv * cos + rotate_half(qv) * sin)
    # position 0 leaves vectors unchanged
    torch.testing.assert_close(k2[0], k[0])

"""Multimodal rotary positions (``MRotaryEmbedding``) against transformers' rotary
embeddings of the models that use them, on three position streams that differ: the
sectioned layout (Qwen2-VL, Qwen2.5-VL) and the interleaved one (Qwen3-VL)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.layers.mrope import MRotaryEmbedding

HEAD_DIM, SECTION, THETA = 32, [4, 6, 6], 1e4


def _streams(num_tokens: int = 40) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 300, (3, num_tokens), generator=gen)


def _ours(positions: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rope = MRotaryEmbedding(HEAD_DIM, 2048, THETA, SECTION, interleaved=interleaved)
    rope.set_step_positions(positions)
    cos, sin = rope._step_cos_sin.chunk(2, dim=-1)
    return cos, sin


@pytest.mark.parametrize("model", ["qwen2_vl", "qwen3_vl"])
def test_cos_sin_equal_transformers(model):
    positions = _streams()
    if model == "qwen3_vl":
        from transformers import Qwen3VLTextConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

        config = Qwen3VLTextConfig(
            hidden_size=64, num_attention_heads=2, head_dim=HEAD_DIM,
            rope_parameters={"rope_type": "default", "rope_theta": THETA,
                             "mrope_section": SECTION, "mrope_interleaved": True},
        )  # fmt: skip
        rotary = Qwen3VLTextRotaryEmbedding(config)
    else:
        from transformers import Qwen2VLTextConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

        config = Qwen2VLTextConfig(
            hidden_size=64, num_attention_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": THETA,
                             "mrope_section": SECTION},
        )  # fmt: skip
        rotary = Qwen2VLRotaryEmbedding(config)
    x = torch.zeros(1, positions.shape[1], HEAD_DIM)
    ref_cos, ref_sin = rotary(x, positions[:, None, :])
    if ref_cos.dim() == 4:  # Qwen2-VL: per stream; its apply step picks the sections
        pick = torch.cat([torch.repeat_interleave(torch.arange(3), torch.tensor(SECTION))] * 2)
        ref_cos = ref_cos[pick, 0, :, torch.arange(HEAD_DIM)].T
        ref_sin = ref_sin[pick, 0, :, torch.arange(HEAD_DIM)].T
    else:
        ref_cos, ref_sin = ref_cos[0], ref_sin[0]
    cos, sin = _ours(positions, interleaved=model == "qwen3_vl")
    half = HEAD_DIM // 2
    torch.testing.assert_close(cos, ref_cos[:, :half].float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sin, ref_sin[:, :half].float(), atol=1e-5, rtol=1e-5)
    other_cos, _ = _ours(positions, interleaved=model != "qwen3_vl")
    assert not torch.allclose(other_cos, ref_cos[:, :half].float(), atol=1e-3)

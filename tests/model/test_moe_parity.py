"""Mixtral and Qwen3-MoE logits equal transformers' on the same random weights (float32, CPU):
top-k routing renormalised as each model defines, per-expert checkpoint tensors loaded into
stacked expert weights, dense and sparse layers mixed (Qwen3-MoE)."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_qwen3_parity import TINY, mixed_batch_logits, save_random_model
from tests.model.tolerance import assert_logits_close
from tokenmill.config import LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.hf_config import ModelLoadError
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.layers.fused_moe import FusedMoE
from tokenmill.model.loader.model_loader import get_model

MOE = dict(TINY, num_hidden_layers=3)
# transformers initialises routers with std 0.02, which makes every expert about equally
# likely; scaled up, routing is decisive and a wrong expert choice changes the logits.
ROUTER_SCALE = {"mlp.gate.weight": 40.0, "block_sparse_moe.gate.weight": 40.0}


def _configs():
    from transformers import MixtralConfig, Qwen3MoeConfig

    return {
        "mixtral": MixtralConfig(
            **MOE, num_local_experts=6, num_experts_per_tok=2, sliding_window=None
        ),
        "mixtral-top3-sliding": MixtralConfig(
            **MOE, num_local_experts=4, num_experts_per_tok=3, sliding_window=12
        ),
        # Layer 1 dense (mlp_only_layers); top-k weights renormalised.
        "qwen3-moe-norm": Qwen3MoeConfig(
            **MOE, head_dim=24, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
            norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=True,
        ),
        # Every second layer sparse; raw softmax probabilities as weights.
        "qwen3-moe-raw": Qwen3MoeConfig(
            **MOE, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
            norm_topk_prob=False, decoder_sparse_step=2,
        ),
    }


@pytest.fixture(scope="module", params=list(_configs()))
def saved_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return save_random_model(_configs()[request.param], path, ROUTER_SCALE), str(path)


def _load(path: str):
    cfg = EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config()
    return get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)


def test_mixed_batch_matches_transformers(saved_model):
    hf, path = saved_model
    logits, expected = mixed_batch_logits(hf, path)
    assert logits.shape == expected.shape
    assert_logits_close(logits, expected)


def test_experts_are_stacked_per_layer(saved_model):
    """One ``[E, 2I, H]`` and one ``[E, H, I]`` tensor per sparse layer, equal to HF's."""
    hf, path = saved_model
    model = _load(path)
    sparse = [m for m in model.modules() if isinstance(m, FusedMoE)]
    hf_experts = [m for m in hf.modules() if type(m).__name__.endswith("Experts")]
    assert len(sparse) == len(hf_experts) > 0
    for ours, ref in zip(sparse, hf_experts, strict=True):
        torch.testing.assert_close(ours.w13.weight, ref.gate_up_proj, atol=0, rtol=0)
        torch.testing.assert_close(ours.w2.weight, ref.down_proj, atol=0, rtol=0)


def test_missing_expert_tensor_is_named(saved_model, tmp_path):
    """A checkpoint without one expert's tensor fails to load and says which shard."""
    import os

    from safetensors.torch import load_file, save_file

    _, path = saved_model
    tensors = load_file(os.path.join(path, "model.safetensors"))
    dropped = next(n for n in tensors if ".experts.1." in n)
    del tensors[dropped]
    for name in os.listdir(path):
        if name != "model.safetensors":
            os.symlink(os.path.join(path, name), tmp_path / name)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"experts\.w(13|2)\.weight.*1"):
        _load(str(tmp_path))

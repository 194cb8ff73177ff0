"""DeepSeek-V3 with quantized weights: a GPTQ checkpoint (int4 attention projections, the
merged latent and query down-projections, the up-projection ``kv_b_proj``, dense MLPs and
experts) against transformers on the dequantized weights, and an up-projection quantized while
loading (bitsandbytes), whose absorbed decode must agree with the prompt path."""

from __future__ import annotations

import pytest
import torch

from tests.model.paged import PagedRunner
from tests.model.test_deepseek_parity import MLA, save_deepseek
from tests.model.test_qwen3_parity import mixed_batch_logits
from tokenmill.config import LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.model.attention.mla import TorchMLABackend
from tokenmill.model.layers.fused_moe import FusedMoE
from tokenmill.model.loader.model_loader import get_model

# The int4 products run in bfloat16 on the CPU: max |difference| relative to the largest
# |logit| (as tests/model/test_int4_checkpoints.py).
BF16_RELATIVE = 2e-2
DEEPSEEK_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                    "gate_proj", "up_proj", "down_proj")  # fmt: skip


def test_gptq_checkpoint_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from tests.model.quant_checkpoints import quantize_folder

    # Every quantized product's input size a multiple of the group (32).
    config = DeepseekV3Config(**MLA, q_lora_rank=64, n_routed_experts=8, n_group=4,
                              topk_group=2, num_experts_per_tok=3, n_shared_experts=1,
                              routed_scaling_factor=2.5, norm_topk_prob=True)  # fmt: skip
    save_deepseek(config, tmp_path / "float")
    quant, reference = quantize_folder(str(tmp_path / "float"), str(tmp_path), "gptq", 32,
                                       False, leaves=DEEPSEEK_LINEARS)  # fmt: skip
    ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    logits, expected = mixed_batch_logits(ref, quant)
    assert (logits - expected).abs().max() <= BF16_RELATIVE * expected.abs().max()


def test_quantized_up_projection_decodes_like_the_prompt_path(tmp_path):
    """With weights quantized while loading (bitsandbytes NF4), the absorbed decode takes
    ``W_UK`` and ``W_UV`` from a dense copy of the quantized ``kv_b_proj``: a decode after 20
    cached tokens gives the logits that the prompt path (the quantized product itself)
    computes for the same 21 tokens."""
    pytest.importorskip("bitsandbytes")
    from transformers import DeepseekV3Config

    # Dense layers only: bitsandbytes does not quantize experts.
    config = DeepseekV3Config(**{**MLA, "first_k_dense_replace": MLA["num_hidden_layers"]},
                              q_lora_rank=48, n_routed_experts=4, n_group=1, topk_group=1,
                              num_experts_per_tok=2)  # fmt: skip
    save_deepseek(config, tmp_path)
    cfg = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu",
                     quantization="bitsandbytes").create_engine_config()  # fmt: skip
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchMLABackend)
    assert not any(isinstance(m, FusedMoE) for m in model.modules())
    impl = model.model.layers[0].self_attn.attn.impl
    assert impl.dense_up_weight is not None and impl.dense_up_weight.shape == (4 * 56, 32)
    runner = PagedRunner(model, cfg.model_config.hf_config, num_blocks=16,
                         backend=TorchMLABackend)  # fmt: skip
    ids = list(range(5, 26))
    runner.step({"a": ids[:20]}, {"a": ids})
    decode = runner.step({"a": ids[20:]}, {"a": ids})[-1]
    prompt = runner.step({"b": ids}, {"b": ids})[-1]
    torch.testing.assert_close(decode, prompt, rtol=1e-4, atol=1e-4)


def test_reloaded_quantized_weights_refresh_the_dense_up_projection(tmp_path):
    """Weights loaded in place (sleep level 2, ``update_weights``) from another GPTQ
    checkpoint refresh the dense copy of ``kv_b_proj`` the absorbed decode reads, in place."""
    from transformers import DeepseekV3Config

    from tests.model.quant_checkpoints import quantize_folder
    from tokenmill.model.loader.model_loader import reload_weights

    config = DeepseekV3Config(**{**MLA, "first_k_dense_replace": MLA["num_hidden_layers"]},
                              q_lora_rank=64, n_routed_experts=4, n_group=1, topk_group=1,
                              num_experts_per_tok=2)  # fmt: skip
    save_deepseek(config, tmp_path / "float")
    folders = [
        quantize_folder(str(tmp_path / "float"), str(tmp_path / f"q{seed}"), "gptq", 32, False,
                        seed=seed, leaves=DEEPSEEK_LINEARS)[0]
        for seed in (0, 1)
    ]  # fmt: skip

    def load(folder):
        cfg = EngineArgs(model=folder, dtype="float32", device="cpu").create_engine_config()
        return cfg, get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchMLABackend)

    cfg, model = load(folders[0])
    impl = model.model.layers[0].self_attn.attn.impl
    dense = impl.dense_up_weight
    assert dense is not None
    expected = load(folders[1])[1].model.layers[0].self_attn.attn.impl.dense_up_weight
    assert not torch.equal(dense, expected)
    reload_weights(model, cfg.model_config, LoadConfig(), torch.device("cpu"), TorchMLABackend,
                   path=folders[1])  # fmt: skip
    assert impl.dense_up_weight is dense and torch.equal(dense, expected)

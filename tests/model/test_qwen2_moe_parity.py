"""Qwen2-MoE against transformers on the same random weights (float32, CPU): logits of a
mixed step (routed experts, the sigmoid-gated shared expert, dense layers by
``decoder_sparse_step`` and ``mlp_only_layers``), and greedy generation through the engine
with prefix caching and preemption."""

from __future__ import annotations

import pytest
import torch

from tests.model.gguf_files import decoder_writer
from tests.model.test_qwen3_parity import TINY, VOCAB, mixed_batch_logits, save_random_model
from tests.model.tolerance import assert_logits_close
from tokenmill.config import LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.layers.fused_moe import FusedMoE
from tokenmill.model.loader.model_loader import get_model
from tokenmill.model.models.qwen2_moe import Qwen2MoeSparseMoeBlock

MOE = dict(TINY, num_hidden_layers=3)
SCALES = {"mlp.gate.weight": 40.0, "shared_expert_gate": 10.0, "lm_head": 30.0}


def _configs():
    from transformers import Qwen2MoeConfig

    return {
        # Layer 1 dense (mlp_only_layers), raw softmax weights, biases on q/k/v.
        "shared-raw": Qwen2MoeConfig(
            **MOE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
        ),
        # Every second layer sparse, renormalised weights, tied embeddings, no q/k/v bias.
        "sparse-step-norm": Qwen2MoeConfig(
            **MOE, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
            shared_expert_intermediate_size=40, norm_topk_prob=True, decoder_sparse_step=2,
            tie_word_embeddings=True, qkv_bias=False,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module", params=list(_configs()))
def saved_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return save_random_model(_configs()[request.param], path, SCALES), str(path)


def test_mixed_batch_matches_transformers(saved_model):
    hf, path = saved_model
    logits, expected = mixed_batch_logits(hf, path)
    assert_logits_close(logits, expected)


def test_sparse_layers_and_shared_expert(saved_model):
    hf, path = saved_model
    cfg = EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    for ours, ref in zip(model.model.layers, hf.model.layers, strict=True):
        sparse = hasattr(ref.mlp, "experts")
        assert isinstance(ours.mlp, Qwen2MoeSparseMoeBlock) == sparse
        if sparse:
            assert isinstance(ours.mlp.experts, FusedMoE)
            torch.testing.assert_close(ours.mlp.experts.w2.weight, ref.mlp.experts.down_proj)
            torch.testing.assert_close(
                ours.mlp.shared_expert_gate.weight, ref.mlp.shared_expert_gate.weight
            )


@pytest.mark.slow
def test_greedy_through_the_engine(tmp_path, smollm2_gguf_path):
    """Greedy tokens equal transformers' over 32 steps for prompts sharing a 40-token prefix,
    in a cache small enough to preempt; every block is free at the end."""
    from tokenmill import LLM, SamplingParams

    hf = save_random_model(_configs()["shared-raw"], tmp_path, SCALES)
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, VOCAB, (40,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (4, 11, 17)]
    prompts.append(torch.randint(0, VOCAB, (30,), generator=gen).tolist())
    block_bytes = 3 * 2 * 16 * 2 * 16 * 4  # layers x K,V x tokens x KV heads x head_dim x 4
    llm = LLM(str(tmp_path), tokenizer=smollm2_gguf_path, dtype="float32", max_model_len=96,
              kv_cache_memory=8 * block_bytes, max_num_batched_tokens=64)  # fmt: skip
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    outputs += llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params,
                            use_tqdm=False)  # fmt: skip
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert list(out.outputs[0].token_ids) == expected
    assert engine.counters.prefix_cache_hits >= 32
    assert engine.counters.num_preemptions > 0
    kv = engine.engine_core.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.usage == 0.0


def _write_gguf(hf, path: str, quantize: bool = False) -> dict[str, torch.Tensor]:
    """``hf``'s weights as llama.cpp's converter lays out a qwen2moe GGUF file (float32, or
    with ``quantize`` its 2D weights in Q8_0 blocks): each layer's experts stacked into
    ``ffn_{gate,up,down}_exps`` ``[E, out, in]``, the shared expert's gate a vector.
    Returns the state dict the file holds (dequantized), in ``hf``'s names."""
    import gguf
    import numpy as np

    c = hf.config
    writer = decoder_writer(path, "qwen2moe", c)
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2MOE, c.num_hidden_layers)
    qtype = gguf.GGMLQuantizationType.Q8_0

    def add(gguf_name: str, data: np.ndarray) -> torch.Tensor:
        if not quantize or data.ndim == 1:
            writer.add_tensor(gguf_name, data)
            return torch.from_numpy(data.copy())
        q = gguf.quants.quantize(data, qtype)
        writer.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=qtype)
        return torch.from_numpy(gguf.quants.dequantize(q, qtype).reshape(data.shape).copy())

    held = {}
    for name, param in hf.state_dict().items():
        data = param.detach().float().numpy()
        if ".mlp.experts." in name:
            layer = name.split(".")[2]
            gate, up = np.split(data, 2, axis=1)  # transformers keeps [E, 2I, H] in memory
            parts = {"gate": gate, "up": up} if name.endswith("gate_up_proj") else {"down": data}
            held[name] = torch.cat([
                add(f"blk.{layer}.ffn_{part}_exps.weight", np.ascontiguousarray(stacked))
                for part, stacked in parts.items()
            ], dim=1)  # fmt: skip
            continue
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if name.endswith("shared_expert_gate.weight"):
            held[name] = add(gguf_name, data.reshape(-1)).reshape(data.shape)
        else:
            held[name] = add(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def test_gguf_file_matches_transformers(tmp_path):
    """A qwen2moe GGUF file (every layer sparse, raw top-k weights, as llama.cpp's graph has
    it) loads into the same model: logits equal transformers' on the weights it holds."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(**MOE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, norm_topk_prob=False)  # fmt: skip
    hf = save_random_model(config, tmp_path / "hf", SCALES)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(hf, path)
    logits, expected = mixed_batch_logits(hf, path)
    assert_logits_close(logits, expected)


def test_q8_0_gguf_file_kept_quantized(tmp_path):
    """A qwen2moe file in Q8_0 blocks (experts, shared expert, attention and head) runs kept
    in its blocks and dequantized at load: both against transformers on the weights the file
    holds (the blocks' products within bfloat16's rounding on the CPU)."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(**MOE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, norm_topk_prob=False)  # fmt: skip
    hf = save_random_model(config, tmp_path / "hf", SCALES)
    path = str(tmp_path / "tiny-q8_0.gguf")
    hf.load_state_dict(_write_gguf(hf, path, quantize=True))
    logits, expected = mixed_batch_logits(hf, path, gguf_dequantize=True)
    assert_logits_close(logits, expected)
    logits, expected = mixed_batch_logits(hf, path)
    assert (logits - expected).abs().max() <= 2e-2 * expected.abs().max()


def test_dummy_weights_from_a_config_alone(tmp_path):
    import json

    from tokenmill.model.registry import supported_architectures

    assert "Qwen2MoeForCausalLM" in supported_architectures()
    config = _configs()["shared-raw"].to_dict()
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "architectures": ["Qwen2MoeForCausalLM"]})
    )
    cfg = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu",
                     load_format="dummy").create_engine_config()  # fmt: skip
    model = get_model(cfg.model_config, cfg.load_config, torch.device("cpu"),
                      TorchAttentionBackend)  # fmt: skip
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    assert all(bool(p.abs().max() > 0) for p in model.parameters())

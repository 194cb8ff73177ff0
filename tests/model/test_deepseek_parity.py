"""DeepSeek-V2/V3 (multi-head latent attention, shared-expert MoE with grouped routing)
against transformers on the same random weights (float32, CPU): logits of a mixed step
over the paged latent cache, the cache's latent layout, and greedy generation through the
engine with prefix caching and preemption."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_qwen3_parity import mixed_batch_logits, save_random_model
from tests.model.tolerance import assert_logits_close
from tokenmill.config import LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.model.attention.mla import TorchMLABackend
from tokenmill.model.layers.attention import kv_cache_specs
from tokenmill.model.layers.fused_moe import FusedMoE
from tokenmill.model.loader.model_loader import get_model

VOCAB = 320
MLA = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,  # transformers' DeepSeek-V3 defaults it to 128
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=24,
    first_k_dense_replace=1,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
        "beta_slow": 1, "original_max_position_embeddings": 64}  # fmt: skip
# Routers scaled up so that expert choices are decisive (transformers initialises them with
# std 0.02); the LM head so that greedy choices are.
SCALES = {"mlp.gate.weight": 8.0, "lm_head": 30.0}


def _configs():
    from transformers import DeepseekV2Config, DeepseekV3Config

    return {
        # Low-rank queries, YaRN with both mscales, sigmoid routing in 4 groups of 2 kept.
        "v3-qlora-yarn": DeepseekV3Config(
            **MLA, q_lora_rank=48, n_routed_experts=8, n_group=4, topk_group=2,
            num_experts_per_tok=3, n_shared_experts=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, num_nextn_predict_layers=1,
            rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8},
        ),
        # Full-rank queries, RoPE on halves, biased latent projection, raw weights.
        "v3-q-proj": DeepseekV3Config(
            **MLA, q_lora_rank=None, n_routed_experts=6, n_group=2, topk_group=1,
            num_experts_per_tok=2, n_shared_experts=2, routed_scaling_factor=1.5,
            norm_topk_prob=False, rope_interleave=False, attention_bias=True,
            tie_word_embeddings=True,
        ),
        # V2-Lite's layout: full-rank queries, softmax routing limited to 2 of 4 groups.
        "v2-group-limited": DeepseekV2Config(
            **MLA, q_lora_rank=None, n_routed_experts=8, n_group=4, topk_group=2,
            topk_method="group_limited_greedy", num_experts_per_tok=2, n_shared_experts=2,
            routed_scaling_factor=1.5, rope_parameters={**YARN, "mscale": 0.707,
                                                        "mscale_all_dim": 0.707},
        ),
    }  # fmt: skip


def _random_correction_bias(model) -> None:
    """transformers starts ``e_score_correction_bias`` at zero; a random one checks that it
    steers the choice of experts and not their weights."""
    gen = torch.Generator().manual_seed(3)
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.2)


def save_deepseek(config, path):
    return save_random_model(config, path, SCALES, mutate=_random_correction_bias)


@pytest.fixture(scope="module", params=list(_configs()))
def saved_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return save_deepseek(_configs()[request.param], path), str(path)


def _load(path: str):
    cfg = EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchMLABackend)
    return model, cfg


def test_mixed_batch_matches_transformers(saved_model):
    """A fresh 20-token prompt, a decode after 30 cached tokens (absorbed attention) and a
    13-token chunk after 37 (keys and values expanded from the cached latents)."""
    hf, path = saved_model
    logits, expected = mixed_batch_logits(hf, path)
    assert_logits_close(logits, expected)


@pytest.mark.parametrize("saved_model", ["v3-qlora-yarn"], indirect=True)
def test_long_contexts_attend_in_pieces(saved_model, monkeypatch):
    """Contexts past ``max_expanded_context`` (here 8 tokens) expanded 16 tokens at a time
    and merged by online softmax: the same step's logits (the 20- and 50-token prompt
    contexts in pieces that cross blocks and the chunk's start; the 31-token decode as
    before)."""
    from tokenmill.model.attention.mla import MLAImpl

    monkeypatch.setattr(MLAImpl, "max_expanded_context", 8)
    monkeypatch.setattr(MLAImpl, "piece_scores", 1)  # the smallest piece, 16 tokens
    hf, path = saved_model
    logits, expected = mixed_batch_logits(hf, path)
    assert_logits_close(logits, expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu/test_mla_gpu.py on CUDA")
# The interpreter is slow: one config per rotary layout (interleaved pairs, halves).
@pytest.mark.parametrize("saved_model", ["v3-qlora-yarn", "v3-q-proj"], indirect=True)
def test_triton_kernels_match_transformers(saved_model):
    """The same step with the Triton write and decode kernels (Triton's interpreter)."""
    pytest.importorskip("triton")
    from tokenmill.model.attention.mla_triton import TritonMLABackend

    hf, path = saved_model
    logits, expected = mixed_batch_logits(hf, path, backend=TritonMLABackend)
    assert_logits_close(logits, expected)


def test_cache_holds_one_latent_per_token(saved_model):
    _, path = saved_model
    model, cfg = _load(path)
    specs = kv_cache_specs(model)
    assert len(specs) == 3
    assert {(s.num_kv_heads, s.head_size, s.num_tensors) for s in specs} == {(1, 32 + 16, 1)}
    assert TorchMLABackend.get_kv_cache_shape(10, 16, 1, 48) == (10, 16, 48)
    # Full K and V heads would take 4 x (48 + 24) values per token and layer, not 48.
    assert specs[0].bytes_per_token(torch.float32) == 48 * 4


def test_dense_first_layers_and_shared_experts(saved_model):
    hf, path = saved_model
    model, _ = _load(path)
    layers = model.model.layers
    assert not isinstance(getattr(layers[0].mlp, "experts", None), FusedMoE)
    for ours, ref in zip(layers[1:], hf.model.layers[1:], strict=True):
        assert isinstance(ours.mlp.experts, FusedMoE)
        torch.testing.assert_close(ours.mlp.experts.w13.weight, ref.mlp.experts.gate_up_proj)
        shared = ref.mlp.shared_experts.gate_proj.weight.shape[0]
        assert ours.mlp.shared_experts.gate_up_proj.weight.shape[0] == 2 * shared


@pytest.mark.slow
def test_greedy_through_the_engine(tmp_path_factory, smollm2_gguf_path):
    """Greedy tokens equal transformers' over 32 steps, for prompts that share a 40-token
    prefix (prefix-cache hits on the latent blocks), in a cache small enough that running
    requests are preempted and recomputed; every block is free at the end."""
    from tokenmill import LLM, SamplingParams

    path = tmp_path_factory.mktemp("v3-engine")
    hf = save_deepseek(_configs()["v3-qlora-yarn"], path)
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, VOCAB, (40,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 13)]
    prompts.append(torch.randint(0, VOCAB, (23,), generator=gen).tolist())
    block_bytes = 3 * 16 * 48 * 4
    llm = LLM(str(path), tokenizer=smollm2_gguf_path, dtype="float32", max_model_len=96,
              kv_cache_memory=12 * block_bytes, max_num_batched_tokens=64)  # fmt: skip
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    outputs = first + llm.generate(
        [{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False
    )
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert list(out.outputs[0].token_ids) == expected
    assert engine.counters.prefix_cache_hits >= 2 * 32
    assert engine.counters.num_preemptions > 0
    kv = engine.engine_core.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.usage == 0.0
    # The memory holds 12 blocks of latents (full K/V heads would not hold one request).
    assert kv.num_blocks == 12


@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_dummy_weights_from_a_config_alone(tmp_path, arch):
    import json

    from tokenmill.model.registry import supported_architectures

    assert arch in supported_architectures()
    config = _configs()["v3-qlora-yarn"].to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
    cfg = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu",
                     load_format="dummy").create_engine_config()  # fmt: skip
    model = get_model(cfg.model_config, cfg.load_config, torch.device("cpu"), TorchMLABackend)
    assert type(model).__name__ == arch
    assert all(bool(p.abs().max() > 0) for p in model.parameters())



def test_latent_decode_does_not_depend_on_the_batch():
    """One request's latent attention alone and beside requests with longer contexts: the
    same output, to the bit (each over its own keys, padded to DECODE_KEY_GRANULE)."""
    from tokenmill.model.attention.mla import attend_latent_torch

    gen = torch.Generator().manual_seed(3)
    heads, rank, rope, block_size = 16, 512, 64, 16  # DeepSeek-V3's latent and rope widths
    cache = torch.randn(305, block_size, rank + rope, generator=gen)
    table = torch.randperm(305, generator=gen)[:300].view(3, 100).int()
    q_lat = torch.randn(heads, 3, rank, generator=gen)
    q_pe = torch.randn(3, heads, rope, generator=gen)
    # Padded to the batch's longest context, the first request's sums changed in the last bit.
    lens = torch.tensor([1000, 1300, 1590])
    alone = attend_latent_torch(q_lat[:, :1], q_pe[:1], cache, table[:1], lens[:1], rank, 0.05)
    batched = attend_latent_torch(q_lat, q_pe, cache, table, lens, rank, 0.05)
    assert torch.equal(alone[:, 0], batched[:, 0])

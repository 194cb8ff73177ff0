"""Qwen3 logits equal transformers' on the same random weights (float32, CPU), and the whole
engine (``LLM``) generates transformers' greedy tokens for a tiny saved Qwen3.

``mixed_batch_logits`` is the shared parity check of the decoder families: one forward pass
over a fresh prompt, a decode step and a 13-token chunk after 37 cached tokens, with the
sequences' KV blocks scattered through the cache.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.paged import PagedRunner
from tests.model.tolerance import assert_logits_close
from tokenmill.config import LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.model.attention.selector import get_attn_backend
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.loader.model_loader import get_model

VOCAB = 320
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def save_random_model(config, path, scale_params: dict[str, float] | None = None, mutate=None):
    """Build transformers' model for ``config`` with seeded random weights, save it to
    ``path`` and return it (float32, eval, eager attention).

    ``scale_params`` multiplies parameters whose name contains a key (e.g. to make random
    routers decisive) before saving; ``mutate(model)`` may change it further.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            # transformers initialises norm weights to constants; random ones catch mix-ups.
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            for key, scale in (scale_params or {}).items():
                if key in name:
                    param.mul_(scale)
        if mutate is not None:
            mutate(hf)
    hf.save_pretrained(path)
    return hf


def mixed_batch_logits(
    hf, path: str, backend=None, **engine_kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ours, transformers')`` logits of the mixed step, each ``[34, vocab]`` float32;
    ``backend`` defaults to the CPU's attention backend for the model."""
    cfg = EngineArgs(
        model=path, dtype="float32", device="cpu", **engine_kwargs
    ).create_engine_config()
    backend = backend or get_attn_backend("cpu", use_mla=cfg.model_config.use_mla)
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), backend)
    runner = PagedRunner(model, cfg.model_config.hf_config, num_blocks=32, backend=backend)
    gen = torch.Generator().manual_seed(1)
    vocab = cfg.model_config.hf_config.vocab_size
    seqs = {
        "fresh": torch.randint(0, vocab, (20,), generator=gen).tolist(),
        "decode": torch.randint(0, vocab, (31,), generator=gen).tolist(),
        "chunk": torch.randint(0, vocab, (50,), generator=gen).tolist(),
    }
    # Earlier steps: the decode sequence's first 30 tokens, the chunked one's first 37.
    runner.step({"decode": seqs["decode"][:30]}, seqs)
    runner.step({"chunk": seqs["chunk"][:37]}, seqs)
    logits = runner.step(
        {"fresh": seqs["fresh"], "decode": seqs["decode"][30:], "chunk": seqs["chunk"][37:]}, seqs
    )
    with torch.no_grad():
        ref = {k: hf(torch.tensor([v])).logits[0] for k, v in seqs.items()}
    expected = torch.cat([ref["fresh"], ref["decode"][30:], ref["chunk"][37:]])
    return logits, expected


def _configs():
    from transformers import Qwen3Config

    return {
        # head_dim differs from hidden_size / heads, as in the real Qwen3 models
        "qwen3-tied": Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=True),
        "qwen3-bias-sliding": Qwen3Config(
            **TINY,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            tie_word_embeddings=False,
            rope_theta=1e6,
        ),
    }


@pytest.fixture(scope="module", params=["qwen3-tied", "qwen3-bias-sliding"])
def saved_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return save_random_model(_configs()[request.param], path), str(path)


def test_mixed_batch_matches_transformers(saved_model):
    hf, path = saved_model
    logits, expected = mixed_batch_logits(hf, path)
    assert logits.shape == expected.shape
    assert_logits_close(logits, expected)


def test_sliding_layers_follow_max_window_layers(saved_model):
    hf, path = saved_model
    cfg = EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    expected = [hf.model.layers[i].self_attn.sliding_window for i in range(len(windows))]
    assert windows == expected


@pytest.mark.slow
def test_llm_greedy_equals_transformers_generate(tmp_path, smollm2_gguf_path):
    """Through the engine (scheduler, runner, sampler): greedy tokens equal HF generate."""
    from transformers import Qwen3Config

    from tokenmill import LLM, SamplingParams

    hf = save_random_model(Qwen3Config(**TINY, head_dim=16), tmp_path, {"lm_head": 30.0})
    prompts = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], list(range(100, 140))]
    # The tiny model has no tokenizer of its own; SmolLM2's decodes ids below 320.
    llm = LLM(
        str(tmp_path),
        tokenizer=smollm2_gguf_path,
        dtype="float32",
        kv_cache_memory=16 << 20,
        max_model_len=128,
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == expected

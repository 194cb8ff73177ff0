"""Llama layers that pass the residual stream through their skinny products on CUDA (bf16):
each layer's two RMSNorms computed in the QKV and gate/up products, its residual adds in
the output and down products (``LlamaDecoderLayer.streams_in_products``).

The norms' arithmetic is the norm kernel's but for the mean square's summation order, so
logits stay within bf16 rounding of the separate kernels and greedy tokens may part only
at a near tie. A small random Llama stands in for Llama-3.1-8B, whose shapes have the
whole-row tiles on an H200: the tests give its shapes such tiles and let every shape run
the skinny GEMM.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HIDDEN = 512


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
                         max_position_embeddings=1024, rms_norm_eps=1e-5)  # fmt: skip
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    path = tmp_path_factory.mktemp("llama-streams")
    hf.save_pretrained(path)
    return hf, str(path)


@pytest.fixture
def whole_rows(monkeypatch):
    """Every eligible shape on the skinny GEMM, whole-row tiles at one or two rows."""
    from tokenmill.model.host_ints import next_power_of_2
    from tokenmill.model.layers import linear
    from tokenmill.model.layers import skinny_gemm as sg

    monkeypatch.setattr(linear, "_SKINNY_GEMM", "1")
    monkeypatch.setattr(sg, "MIN_WEIGHT_BYTES", 0)
    default = sg.launch_config

    def launch_config(m, n, k, num_sms=sg.DEFAULT_NUM_SMS):
        if m <= 2:
            return sg.SkinnyConfig(2, next_power_of_2(k), 1, 8, 1, False)
        return default(m, n, k, num_sms)

    monkeypatch.setattr(sg, "launch_config", launch_config)


def _tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, 4000, (n,), generator=gen).tolist()


def test_decode_logits_within_bf16_of_the_norm_kernels(llama, whole_rows):
    """Eight decode steps at batch 1, streamed and not, over the same cached prompt:
    logits within bf16 rounding of each other and of transformers in float32."""
    from tests.model.paged import PagedRunner
    from tokenmill.config import LoadConfig
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.attention.selector import get_attn_backend
    from tokenmill.model.loader.model_loader import get_model

    hf, path = llama
    cfg = EngineArgs(model=path, dtype="bfloat16", device="cuda").create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cuda"),
                      get_attn_backend("cuda"))  # fmt: skip
    layers = model.model.layers
    probe = torch.empty(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    assert all(layer.streams_in_products(probe) for layer in layers)
    assert not layers[0].streams_in_products(probe.expand(3, HIDDEN).contiguous())
    runner = PagedRunner(model, cfg.model_config.hf_config, num_blocks=64)
    tokens = _tokens(40, seed=3)
    seqs = {"on": tokens, "off": tokens}
    for name in seqs:
        runner.step({name: tokens[:32]}, seqs)
    logits: dict[str, list[torch.Tensor]] = {"on": [], "off": []}
    for i in range(32, 40):
        for name in seqs:
            for layer in layers:
                layer.norms_in_products = name == "on"
            logits[name].append(runner.step({name: tokens[i : i + 1]}, seqs).float().cpu())
    on, off = torch.cat(logits["on"]), torch.cat(logits["off"])
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0][32:40]
    scale = ref.abs().max()
    assert (on - off).abs().max() / scale < 1e-2
    assert (on - ref).abs().max() / scale < 3e-2
    assert (off - ref).abs().max() / scale < 3e-2


def test_greedy_tokens_part_only_at_near_ties(llama, whole_rows, monkeypatch):
    """Batch-1 greedy decoding through CUDA graphs, streamed and not: the tokens are the
    same until a position whose two best candidates (unstreamed) are within bf16 noise."""
    from tokenmill import LLM, SamplingParams

    _, path = llama
    prompts = [_tokens(7 + 9 * i, seed=10 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    runs = {}
    for value in ("1", "0"):
        monkeypatch.setenv("TOKENMILL_NORMS_IN_PRODUCTS", value)
        llm = LLM(path, dtype="bfloat16", kv_cache_memory=1 << 30, max_model_len=512,
                  max_num_seqs=4)  # fmt: skip
        runs[value] = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0]
                       for p in prompts]  # fmt: skip
        layer = llm.llm_engine.engine_core.executor.worker.model_runner.model.model.layers[0]
        assert any(layer._streams.values()) == (value == "1")
        del llm, layer
        torch.cuda.empty_cache()
    for on, off in zip(runs["1"], runs["0"], strict=True):
        for i, (a, b) in enumerate(zip(on.token_ids, off.token_ids, strict=True)):
            if a != b:
                best = sorted((lp.logprob for lp in off.logprobs[i].values()), reverse=True)
                assert best[0] - best[1] < 0.1, f"parted at {i} with a gap of {best[0] - best[1]}"
                break

"""Beam search, sleep mode and the KV offload tiers on CUDA.

The model is a 2-layer Llama with SmolLM2's tokenizer and large random weights (so that
beams are far from ties), written by transformers; set ``M135`` to a SmolLM2-135M config
and tokenizer folder (the peer-vllm bundle's ``smollm2-135m-dummy``).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    src = os.environ.get("M135")
    if not src or not os.path.isdir(src):
        pytest.skip("set M135 to a SmolLM2-135M config + tokenizer folder")
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-gpu")
    for name in os.listdir(src):
        if name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(os.path.join(src, name), path / name)
    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return model, str(path)


def _prompts(n: int, length: int = 40) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(100, 40000, (length + 9 * i,), generator=gen).tolist() for i in range(n)]


def test_beam_search_equals_transformers(tiny_llama):
    from tokenmill import LLM, BeamSearchParams

    hf, path = tiny_llama
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 30, max_model_len=512)
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    prompts = _prompts(3)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(
                ids, num_beams=3, num_return_sequences=3, do_sample=False, max_new_tokens=8,
                output_scores=True, return_dict_in_generate=True, eos_token_id=None,
                pad_token_id=0, temperature=None, top_p=None, top_k=None,
            )  # fmt: skip
        expected = [ref.sequences[i, len(prompt) :].tolist() for i in range(3)]
        assert [s.tokens[len(prompt) :] for s in out.sequences] == expected
        assert [s.score for s in out.sequences] == pytest.approx(
            ref.sequences_scores.tolist(), abs=1e-3
        )
    llm.llm_engine.engine_core.check_integrity()


def test_sleep_frees_memory_and_wakes_up_identical(tiny_llama):
    from tokenmill import LLM, SamplingParams

    _, path = tiny_llama
    llm = LLM(path, dtype="bfloat16", kv_cache_memory=2 << 30, enable_sleep_mode=True)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(4)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    core = llm.llm_engine.engine_core
    held = sum(core.memory_bytes().values())
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    for level in (1, 2):
        llm.sleep(level=level)
        torch.cuda.synchronize()
        assert torch.cuda.mem_get_info()[0] - free_awake >= 0.9 * held
        llm.wake_up()
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert after == before
    runner = core.executor.worker.model_runner
    assert runner.graphs is not None  # still replaying CUDA graphs after waking


def test_offload_tier_gives_the_same_outputs(tiny_llama):
    from tokenmill import LLM, SamplingParams

    _, path = tiny_llama
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = _prompts(8, length=300)

    # 80 blocks of 8 KiB (2 layers x K,V x 16 tokens x 2 heads x 32 x 2 bytes): about three
    # of the eight conversations fit, so their prefixes are evicted before the second turns.
    def run(**kwargs):
        llm = LLM(path, dtype="bfloat16", kv_cache_memory=80 * 8192, max_model_len=1024, **kwargs)
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in first]
        for p, o in zip(prompts, first, strict=True):
            second = {"prompt_token_ids": p + list(o.outputs[0].token_ids) + [1000, 1001]}
            [out] = llm.generate(second, greedy, use_tqdm=False)
            tokens.append(out.outputs[0].token_ids)
        llm.llm_engine.engine_core.check_integrity()
        return tokens, llm.llm_engine.counters.kv_offload

    plain, _ = run()
    offloaded, stats = run(kv_offloading_size=0.5)
    assert offloaded == plain
    assert stats["host_hit_tokens"] > 0


def _greedy_tokens(llm, prompts) -> list[list[int]]:
    from tokenmill import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]


def test_sleep_keeps_addresses_and_cuda_graphs(tiny_llama):
    """With CUDA virtual memory the weights and the KV cache wake up at their old addresses:
    every parameter and the KV arena keep their data_ptr(), the captured graphs are the same
    objects (not captured again), the device's free memory rises by the arenas' size while
    asleep, and greedy outputs are those before the nap, at level 1 and level 2."""
    from tokenmill import LLM

    _, path = tiny_llama
    llm = LLM(path, dtype="bfloat16", kv_cache_memory=2 << 30, enable_sleep_mode=True)
    core = llm.llm_engine.engine_core
    runner = core.executor.worker.model_runner
    mode = runner.sleep_mode
    assert mode.vmm is not None, "CUDA virtual memory management unavailable (see the log)"
    assert runner.graphs is not None
    prompts = [{"prompt_token_ids": p} for p in _prompts(4)]
    before = _greedy_tokens(llm, prompts)
    graphs = runner.graphs
    addresses = (mode.weights.buffer.data_ptr(), runner.kv_arena.data_ptr())
    params = [p.data_ptr() for p in runner.model.parameters()]
    held = core.memory_bytes()
    # The mapped sizes: the arenas' bytes rounded up to the 2 MiB granularity.
    assert 0 <= held["weights"] - mode.weights.nbytes < 2 << 20
    kv_bytes = runner.kv_arena.numel() * runner.kv_arena.element_size()
    assert 0 <= held["kv_cache"] - kv_bytes < 2 << 20
    for level in (1, 2):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # sleeping empties torch's cache too: not the arenas' bytes
        free_awake = torch.cuda.mem_get_info()[0]
        llm.sleep(level=level)
        assert core.memory_bytes() == {"weights": 0, "kv_cache": 0}
        freed = torch.cuda.mem_get_info()[0] - free_awake
        assert freed >= held["weights"] + held["kv_cache"] - (64 << 20)
        llm.wake_up()
        torch.cuda.synchronize()
        assert torch.cuda.mem_get_info()[0] - free_awake < 64 << 20  # all of it back
        assert (mode.weights.buffer.data_ptr(), runner.kv_arena.data_ptr()) == addresses
        assert [p.data_ptr() for p in runner.model.parameters()] == params
        assert runner.graphs is graphs  # replayed as captured, never captured again
        assert core.memory_bytes() == held
        assert _greedy_tokens(llm, prompts) == before
    llm.llm_engine.shutdown()


def test_sleep_without_virtual_memory_falls_back(tiny_llama, monkeypatch):
    """Where VMM is unavailable, the storages are freed and allocated again through torch:
    outputs are the same after waking (the graphs are captured again if an address moved)."""
    from tokenmill import LLM
    from tokenmill.worker import sleep_mode

    monkeypatch.setattr(sleep_mode, "stable_device_memory", lambda device: None)
    _, path = tiny_llama
    llm = LLM(path, dtype="bfloat16", kv_cache_memory=1 << 30, enable_sleep_mode=True)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert runner.sleep_mode.vmm is None
    prompts = [{"prompt_token_ids": p} for p in _prompts(4)]
    before = _greedy_tokens(llm, prompts)
    for level in (1, 2):
        llm.sleep(level=level)
        llm.wake_up()
        assert _greedy_tokens(llm, prompts) == before
    assert runner.graphs is not None
    llm.llm_engine.shutdown()

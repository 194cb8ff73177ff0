"""Engine features over MLA's latent cache (``[layers, num_blocks, block_size, latent]``, one
tensor without the K/V dimension), on a random DeepSeek-V3 in float32: beam search (forked
beams copy the block they diverge in), the KV offload host tier (blocks moved out and back)
and sleep mode (the latent cache freed and re-allocated)."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_deepseek_parity import VOCAB, _configs, save_deepseek
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import BeamSearchParams

pytestmark = pytest.mark.slow

# One latent block in float32: 3 layers x 16 tokens x (kv_lora_rank 32 + rope 16) x 4 bytes.
BLOCK_BYTES = 3 * 16 * 48 * 4
GIB = 1 << 30
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("v3-features")
    save_deepseek(_configs()["v3-qlora-yarn"], path)
    return str(path)


def _llm(path: str, tokenizer: str, blocks: int, **kw) -> LLM:
    return LLM(path, tokenizer=tokenizer, dtype="float32", max_model_len=192,
               kv_cache_memory=blocks * BLOCK_BYTES, max_num_batched_tokens=64,
               max_num_seqs=8, **kw)  # fmt: skip


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=gen).tolist() for _ in range(n)]


def test_beam_search_scores_match_the_beams_own_logprobs(model_path, smollm2_gguf_path):
    """Each beam's cumulative logprob equals the sum of its tokens' logprobs computed anew
    from its whole sequence: the blocks forked beams copied hold the right latents."""
    llm = _llm(model_path, smollm2_gguf_path, 64)
    prompt = _prompts(1, 21, 3)[0]  # 21 tokens: the beams fork inside a partly filled block
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    beams = llm.beam_search([{"prompt_token_ids": prompt}], params)[0].sequences
    assert len(beams) == 3
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for beam in beams:
        out = llm.generate([{"prompt_token_ids": beam.tokens}], scoring, use_tqdm=False)[0]
        generated = beam.tokens[len(prompt) :]
        lps = out.prompt_logprobs[len(prompt) :]
        total = sum(lp[t].logprob for lp, t in zip(lps, generated, strict=True))
        assert beam.cum_logprob == pytest.approx(total, abs=1e-3)
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert core.scheduler.kv_cache_manager.num_free_blocks == 64


def _two_turns(llm: LLM, firsts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in firsts], GREEDY, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    for prompt, answer in zip(firsts, list(tokens), strict=True):
        follow = {"prompt_token_ids": prompt + answer + [5, 6, 7]}
        tokens.append(list(llm.generate(follow, GREEDY, use_tqdm=False)[0].outputs[0].token_ids))
    llm.llm_engine.engine_core.check_integrity()
    return tokens


def test_offload_host_tier_and_sleep_keep_the_outputs(model_path, smollm2_gguf_path):
    """A second turn whose prefix left the 16-block cache loads it back from the host tier
    and gives the tokens computed without the tier; after sleep (level 1) and wake-up the
    same again."""
    firsts = _prompts(5, 40, 11)
    expected = _two_turns(_llm(model_path, smollm2_gguf_path, 16), firsts)
    llm = _llm(model_path, smollm2_gguf_path, 16, kv_offloading_size=128 * BLOCK_BYTES / GIB,
               enable_sleep_mode=True)  # fmt: skip
    assert _two_turns(llm, firsts) == expected
    stats = llm.llm_engine.counters.kv_offload
    assert stats["host_hit_tokens"] > 0 and stats["host_load_bytes"] % BLOCK_BYTES == 0
    llm.sleep(level=1)
    assert llm.llm_engine.engine_core.memory_bytes()["kv_cache"] == 0
    llm.wake_up()
    assert _two_turns(llm, firsts) == expected

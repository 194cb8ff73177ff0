"""Sampled tokens keep the target's distribution through the whole engine: many requests of
one prompt on a 16-token-vocabulary random model, its perturbed copy as the draft; the
tokens verified in the second step are compared, by a chi-square test, with the joint
distribution that transformers' logits of the target give (temperature and top-k applied)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tests.spec_decode.conftest import save_llama
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

V = 16
PROMPT = [3, 1, 4, 1, 5, 9]
DRAWS = 2000
TEMPERATURE, TOP_K = 0.9, 12


def _probs(logits: torch.Tensor) -> torch.Tensor:
    """The sampler's distribution: temperature, then the top-k tokens."""
    scaled = logits.double() / TEMPERATURE
    kth = scaled.topk(TOP_K, dim=-1).values[..., -1:]
    return torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)


def _joint_of_second_and_third(target) -> np.ndarray:
    """``[V, V]``: P(token 2 = a, token 3 = b), summed over token 1."""
    with torch.no_grad():
        one = torch.tensor([PROMPT + [a] for a in range(V)])
        two = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
        p1 = _probs(target(torch.tensor([PROMPT])).logits[0, -1])  # [V]
        p2 = _probs(target(one).logits[:, -1])  # [V(t1), V]
        p3 = _probs(target(two).logits[:, -1]).view(V, V, V)  # [t1, t2, t3]
    return torch.einsum("a,ab,abc->bc", p1, p2, p3).numpy()


def test_verified_tokens_keep_the_targets_joint_distribution(tmp_path, smollm2_gguf_path):
    from transformers import AutoModelForCausalLM

    target_path = save_llama(tmp_path / "target", seed=11, scale=6.0, vocab_size=V)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std() * 0.3)
    draft.save_pretrained(tmp_path / "draft")
    spec = {"model": str(tmp_path / "draft"), "num_speculative_tokens": 2}
    llm = LLM(
        target_path, tokenizer=smollm2_gguf_path, speculative_config=spec, max_model_len=64,
        max_num_seqs=256, max_num_batched_tokens=2048, kv_cache_memory=64 << 20,
    )  # fmt: skip
    # Four tokens: the first from the prompt's step, then two drafts verified together.
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * DRAWS, params, use_tqdm=False)
    stats = llm.llm_engine.counters.spec_decoding
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both branches ran
    counts = np.zeros((V, V))
    for out in outputs:
        tokens = out.outputs[0].token_ids
        counts[tokens[1], tokens[2]] += 1
    expected = _joint_of_second_and_third(target) * DRAWS
    # Cells expected fewer than 5 times are pooled, as the test needs.
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    wanted = np.append(expected[~small], expected[small].sum())
    assert chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue > 1e-3

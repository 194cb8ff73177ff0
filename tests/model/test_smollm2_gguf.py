"""The real SmolLM2-135M-Instruct GGUF: logits and greedy text equal transformers'."""

from __future__ import annotations

import pytest
import torch

from tests.model.paged import PagedRunner
from tests.model.tolerance import assert_logits_close

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]

pytestmark = pytest.mark.slow


def test_logits_match_transformers(smollm2_model, smollm2_hf, smollm2_tokenizer):
    model, model_config = smollm2_model
    runner = PagedRunner(model, model_config.hf_config, num_blocks=64)
    ids = {p: smollm2_tokenizer(p)["input_ids"] for p in PROMPTS}
    logits = runner.step(dict(ids), ids)
    with torch.no_grad():
        expected = torch.cat([smollm2_hf(torch.tensor([v])).logits[0] for v in ids.values()])
    assert_logits_close(logits, expected)


def test_greedy_continuation_matches_transformers(smollm2_model, smollm2_hf, smollm2_tokenizer):
    model, model_config = smollm2_model
    runner = PagedRunner(model, model_config.hf_config, num_blocks=64)
    seqs = {p: smollm2_tokenizer(p)["input_ids"] for p in PROMPTS}
    prompt_lens = {p: len(v) for p, v in seqs.items()}
    chunks = dict(seqs)
    for _ in range(32):
        logits = runner.step(chunks, seqs)
        ends = torch.tensor([len(c) for c in chunks.values()]).cumsum(0) - 1
        next_ids = logits[ends].argmax(-1).tolist()
        chunks = {}
        for p, tok in zip(list(seqs), next_ids, strict=False):
            seqs[p] = seqs[p] + [tok]
            chunks[p] = [tok]
    for p, ids in seqs.items():
        prompt = torch.tensor([ids[: prompt_lens[p]]])
        expected = smollm2_hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False
        )[0].tolist()
        # transformers stops at EOS; up to there (EOS included) the tokens must be equal.
        assert len(expected) - prompt_lens[p] >= 16, "reference stopped too early to compare"
        assert ids[: len(expected)] == expected, p

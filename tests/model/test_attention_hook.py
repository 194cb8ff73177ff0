"""``attention_hook``: the seam the piecewise CUDA graphs split a forward pass at."""

from __future__ import annotations

import pytest
import torch

from tests.model.paged import PagedRunner
from tokenmill.model.layers.attention import attention_hook


def _mixed_steps(runner: PagedRunner) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    seqs = {
        s: torch.randint(0, 4000, (n,), generator=gen).tolist()
        for s, n in (("a", 21), ("b", 40), ("c", 9))
    }
    runner.step({"a": seqs["a"][:20], "b": seqs["b"][:25]}, seqs)
    # One decode token, a 15-token chunk after 25 cached, a fresh prompt.
    return runner.step({"a": seqs["a"][20:], "b": seqs["b"][25:], "c": seqs["c"]}, seqs)


def test_split_forward_equals_the_plain_one(smollm2_model):
    """Each layer's attention as the piecewise graphs run it — RoPE applied and K/V written
    where the piece ends, queries handed over in a separate buffer, output into a static
    buffer whose padding rows hold garbage — gives the plain forward's logits exactly."""
    model, mc = smollm2_model
    reference = _mixed_steps(PagedRunner(model, mc.hf_config, num_blocks=32))
    layers = []

    def split(layer, query, key, value, metadata, positions):
        layers.append(layer.layer_idx)
        query = layer.store_kv(
            query, key, value, metadata.slot_mapping, metadata.num_actual_tokens, positions
        )
        static_query = query.clone()
        out = torch.full_like(query, float("nan"))
        return layer.attend(static_query, metadata, out=out)

    with attention_hook(split):
        split_logits = _mixed_steps(PagedRunner(model, mc.hf_config, num_blocks=32))
    assert torch.equal(split_logits, reference)
    assert layers == list(range(mc.hf_config.num_hidden_layers)) * 2


def test_hook_is_exclusive_and_cleared_on_error(smollm2_model):
    def hook(*args):
        raise KeyError("boom")

    with pytest.raises(RuntimeError, match="already active"):
        with attention_hook(hook), attention_hook(hook):
            pass
    model, mc = smollm2_model
    with pytest.raises(KeyError), attention_hook(hook):
        _mixed_steps(PagedRunner(model, mc.hf_config, num_blocks=32))
    # The hook is gone: a plain forward runs.
    assert _mixed_steps(PagedRunner(model, mc.hf_config, num_blocks=32)).isfinite().all()

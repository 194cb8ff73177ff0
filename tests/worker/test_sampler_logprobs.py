"""The sampler's logprobs: the raw distribution's top-k with the chosen token first, the
modes of ``--logprobs-mode`` (raw or processed, logprobs or logits) against a reference
computed by hand, and prompt logprobs."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_sampler import DEVICES, _meta
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampler import (
    Sampler,
    apply_logits_processors,
    apply_top_k_top_p,
    compute_prompt_logprobs,
)


def _ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> list[int]:
    order = logprobs.argsort(dim=-1, descending=True)
    return [int((order[i] == chosen[i]).nonzero()) + 1 for i in range(len(chosen))]


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_topk_with_chosen_first(device: str) -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5)).to(device)
    params = [
        SamplingParams(logprobs=3, temperature=0.5, presence_penalty=2.0),
        SamplingParams(logprobs=1, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(),
        SamplingParams(logprobs=0, top_k=2),
    ]
    meta = _meta(params, vocab_size=30, prompts=[[1, 2]] * 4, outputs=[[3, 4]] * 4, device=device)
    assert meta.max_num_logprobs == 3
    out = Sampler()(logits, meta)
    lp = out.logprobs
    assert lp is not None and lp.token_ids.shape == (4, 4) and lp.logprobs.dtype == torch.float32
    raw = torch.log_softmax(logits, dim=-1)  # before temperature and penalties
    top = raw.topk(3, dim=-1)
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    assert torch.allclose(lp.logprobs[:, 1:], top.values)
    assert torch.allclose(lp.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    assert lp.ranks.tolist() == _ranks(raw.cpu(), out.sampled_token_ids.cpu())

    lists = lp.to_lists_per_row([p.logprobs for p in params])
    assert lists[2] is None
    assert [len(x.token_ids[0]) for x in (lists[0], lists[1], lists[3])] == [4, 2, 1]
    assert lists[1].token_ids[0] == lp.token_ids[1, :2].tolist()
    assert lists[1].logprobs[0] == pytest.approx(lp.logprobs[1, :2].tolist())
    assert lists[3].ranks == [int(lp.ranks[3])]
    assert all(isinstance(t, int) for t in lists[0].token_ids[0])


def test_logprobs_whole_vocabulary() -> None:
    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(logprobs=-1, temperature=0.0), SamplingParams(logprobs=2)]
    meta = _meta(params, vocab_size=12)
    assert meta.max_num_logprobs == 12
    lp = Sampler()(logits, meta).logprobs
    assert lp is not None and lp.token_ids.shape == (2, 13)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], raw.argsort(dim=-1, descending=True))
    lists = lp.to_lists_per_row([-1, 2])
    assert len(lists[0].token_ids[0]) == 13 and len(lists[1].token_ids[0]) == 3
    assert lists[0].ranks == [1]  # greedy picks the most likely token


def test_logprob_of_chosen_token_is_finite_under_masks() -> None:
    # The sampled token's logprob comes from the raw distribution, so masks cannot make it -inf.
    logits = torch.tensor([[5.0, 4.0, -3.0, 0.0]] * 3)
    params = SamplingParams(logprobs=2, allowed_token_ids=[2], logit_bias={2: -50.0})
    meta = _meta([params] * 3, vocab_size=4)
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [2, 2, 2]
    assert torch.isfinite(out.logprobs.logprobs).all()
    assert out.logprobs.ranks.tolist() == [4, 4, 4]


def _processed_reference(logits: torch.Tensor, params: list[SamplingParams], meta) -> torch.Tensor:
    """The processed distribution by hand: processors, then temperature (1 for greedy rows)
    and top-k / top-p (vLLM's ``processed_*`` modes)."""
    x = apply_logits_processors(logits.clone(), meta)
    temps = torch.tensor([1.0 if p.temperature == 0 else p.temperature for p in params])
    x = x / temps[:, None]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else x.shape[1] for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    return apply_top_k_top_p(x, top_k, top_p)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes(mode: str, device: str) -> None:
    """--logprobs-mode: raw logits as they are; processed values after penalties,
    temperature and truncation (dropped tokens at -inf), for the chosen token and the top
    ranks; an all-greedy batch is processed but not divided by a temperature. (CUDA runs the
    fused Gumbel path.)"""
    logits = torch.randn(3, 24, generator=torch.Generator().manual_seed(8))
    params = [
        SamplingParams(logprobs=3, temperature=0.5, presence_penalty=1.0, top_k=5),
        SamplingParams(logprobs=2, temperature=0.0, repetition_penalty=1.5),
        SamplingParams(logprobs=4, temperature=1.3, top_p=0.6),
    ]
    meta = _meta(params, vocab_size=24, prompts=[[1, 2]] * 3, outputs=[[3, 4]] * 3)
    on_device = _meta(params, 24, [[1, 2]] * 3, [[3, 4]] * 3, device=device)
    out = Sampler(mode)(logits.to(device), on_device)
    sampled, values = out.sampled_token_ids.cpu(), out.logprobs.logprobs.cpu()
    if mode == "raw_logits":
        want = logits
    else:
        want = _processed_reference(logits, params, meta)
        if mode == "processed_logprobs":
            want = torch.log_softmax(want, dim=-1)
    chosen = want.gather(1, sampled[:, None])[:, 0]
    torch.testing.assert_close(values[:, 0], chosen, rtol=1e-5, atol=1e-5)
    top = want.topk(4, dim=-1)
    torch.testing.assert_close(values[:, 1:], top.values, rtol=1e-5, atol=1e-5)
    if mode != "raw_logits":  # the top-k row keeps 5 tokens: its 6th is dropped
        assert torch.isneginf(want[0]).sum() == 24 - 5
        assert torch.isfinite(chosen).all()  # drawn tokens are never dropped ones

    greedy = [SamplingParams(logprobs=2, temperature=0.0, frequency_penalty=2.0)]
    meta = _meta(greedy, vocab_size=24, outputs=[[int(logits[0].argmax())]])
    lp = Sampler(mode)(logits[:1].clone(), meta).logprobs
    want = logits[:1] if mode == "raw_logits" else apply_logits_processors(logits[:1].clone(), meta)
    if mode == "processed_logprobs":
        want = torch.log_softmax(want, dim=-1)
    torch.testing.assert_close(lp.logprobs[:, 1:], want.topk(2, dim=-1).values)


def test_compute_prompt_logprobs() -> None:
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(7)).bfloat16()
    next_ids = torch.tensor([3, 0, 19, 7, 7])
    lp = compute_prompt_logprobs(logits, next_ids, k=4)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert torch.equal(lp.token_ids[:, 0], next_ids)
    assert torch.allclose(lp.logprobs[:, 0], raw[torch.arange(5), next_ids])
    assert torch.equal(lp.token_ids[:, 1:], raw.topk(4, dim=-1).indices)
    assert lp.ranks.tolist() == _ranks(raw, next_ids)
    # Two requests' prompt positions in one tensor, each cut to its own k.
    first, second = lp.to_lists([(0, 2), (2, 5)], [1, -1])
    assert len(first.token_ids) == 2 and all(len(ids) == 2 for ids in first.token_ids)
    assert len(second.token_ids) == 3 and all(len(ids) == 5 for ids in second.token_ids)
    assert second.ranks == lp.ranks[2:].tolist()
    assert compute_prompt_logprobs(logits, next_ids, k=-1).token_ids.shape == (5, 21)


def test_to_lists_rejects_mismatched_lengths() -> None:
    lp = compute_prompt_logprobs(torch.zeros(2, 4), torch.tensor([0, 1]), k=1)
    with pytest.raises(ValueError):
        lp.to_lists([(0, 2)], [1, 1])

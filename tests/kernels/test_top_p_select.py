"""The radix-select top-p cut-off keeps what the sort route keeps. On CPU the kernels run in
Triton's interpreter (small vocabularies); on CUDA also at Llama-3's 128,256 tokens."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels.sampling import top_p as top_p_select  # noqa: E402
from tokenmill.kernels.sampling.top_p import chunk_plan, top_p_threshold  # noqa: E402
from tokenmill.worker import sampler as sampler_module  # noqa: E402
from tokenmill.worker.sampler import Sampler, apply_top_k_top_p  # noqa: E402
from tokenmill.worker.sampling_metadata import SamplingMetadata  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or the Triton interpreter",
)
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _scaled(rows: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    """Logits minus the row maximum, as the sampler hands them over (distinct values)."""
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    return (x - x.amax(dim=1, keepdim=True)).to(DEV)


def _kept_by_sort(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    return ~torch.isneginf(apply_top_k_top_p(x.clone(), None, top_p))


def _assert_same_kept(x: torch.Tensor, top_p: torch.Tensor, margin: float = 1e-5) -> None:
    """The radix select keeps what the sort route keeps, except tokens whose mass above
    (float64, exact enough) lies within ``margin`` of ``top_p``: float32 sums in either
    order may put those on either side."""
    kept = (x >= top_p_threshold(x, top_p)[:, None]).cpu()
    expected = _kept_by_sort(x, top_p).cpu()
    probs = torch.softmax(x.double().cpu(), dim=-1)
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    above = torch.empty_like(probs).scatter_(1, order, ranked.cumsum(dim=-1) - ranked)
    close = (above - top_p.double().cpu()[:, None]).abs() < margin
    differ = kept != expected
    assert not (differ & ~close).any(), differ.nonzero()[:5]


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("rows,vocab", [(1, 3000), (7, 1000), (300, 517)])
def test_keeps_what_the_sort_route_keeps(monkeypatch, rows, vocab, prefetch):
    """Several slices per row (1 and 7 rows) and one (300 rows); a vocabulary that is not a
    multiple of the block; probabilities from nearly flat to peaked; top_p from 1e-6 (the
    top token only) to 1.0 (everything, also the tokens whose exp underflows); the mass
    pass with and without its next-block prefetch."""
    monkeypatch.setattr(top_p_select, "PREFETCH", prefetch)
    x = _scaled(rows, vocab, scale=torch.linspace(0.5, 8, rows)[:, None], seed=rows)
    x[0, : vocab // 3] = float("-inf")  # already dropped by min-p or a processor
    x[0] -= x[0].max()
    x[-1, 1] = -200.0  # exp underflows to 0
    top_p = torch.tensor([1e-6, 0.3, 0.5, 0.9, 0.99, 1.0] * rows)[:rows].to(DEV)
    _assert_same_kept(x, top_p)


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token():
    x = _scaled(2, 1000, scale=2.0, seed=3)
    top_p = torch.tensor([1e-46, 1e-45]).to(DEV)  # 0 and the smallest float32 subnormal
    assert torch.equal((x >= top_p_threshold(x, top_p)[:, None]).sum(dim=1).cpu(),
                       torch.tensor([1, 1]))  # fmt: skip


def test_ties_at_the_cut_off_are_all_kept():
    x = torch.full((1, 600), -30.0)
    x[0, :5] = 0.0  # five tokens of equal, dominant probability
    threshold = top_p_threshold(x.to(DEV), torch.tensor([0.5], device=DEV))
    kept = (x.to(DEV) >= threshold[:, None]).cpu()
    assert kept[0, :5].all() and not kept[0, 5:].any()


def test_no_rows():
    empty = top_p_threshold(torch.zeros(0, 700, device=DEV), torch.zeros(0, device=DEV))
    assert empty.shape == (0,)


def test_rejects_what_it_cannot_take():
    with pytest.raises(ValueError, match="float32 contiguous"):
        top_p_threshold(torch.zeros(2, 8, dtype=torch.float16), torch.ones(2))
    with pytest.raises(ValueError, match=r"top_p must be \[2\] float32"):
        top_p_threshold(torch.zeros(2, 8), torch.ones(3))


def test_chunk_plan_covers_the_row():
    for rows, vocab in [(1, 128256), (64, 128256), (256, 128256), (1024, 32000), (3, 100)]:
        chunks, cols = chunk_plan(rows, vocab)
        assert chunks <= top_p_select.MAX_CHUNKS and cols % top_p_select.BLOCK == 0
        assert (chunks - 1) * cols < vocab <= chunks * cols


def test_sampler_takes_it_for_top_p_without_top_k(monkeypatch):
    """Through ``Sampler._scaled_truncated``: min-p first, then the radix select."""
    monkeypatch.setattr(sampler_module, "_sort_free", lambda logits: True)
    calls = []
    real = top_p_select.top_p_threshold
    monkeypatch.setattr(top_p_select, "top_p_threshold", lambda *a: calls.append(1) or real(*a))
    logits = _scaled(3, 900, scale=3.0, seed=5) + 7.0  # not yet shifted
    metadata = SamplingMetadata(
        temperature=torch.tensor([1.0, 0.7, 2.0], device=DEV),
        all_greedy=False, all_random=True,
        top_p=torch.tensor([0.8, 0.95, 1.0], device=DEV),
        min_p=torch.tensor([0.0, 0.01, 0.0], device=DEV),
    )  # fmt: skip
    got = Sampler()._scaled_truncated(logits.clone(), metadata)
    assert calls == [1]
    monkeypatch.setattr(sampler_module, "_sort_free", lambda logits: False)
    expected = Sampler()._scaled_truncated(logits.clone(), metadata)
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected))
    torch.testing.assert_close(got[~torch.isneginf(got)], expected[~torch.isneginf(expected)])


@pytest.mark.skipif(DEV != "cuda", reason="the vocabulary of Llama-3 on CUDA")
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_llama3_vocabulary_on_cuda(monkeypatch, rows, prefetch):
    monkeypatch.setattr(top_p_select, "PREFETCH", prefetch)
    x = _scaled(rows, 128256, scale=4.0, seed=rows)
    top_p = torch.rand(rows, generator=torch.Generator().manual_seed(1)).clamp(0.05, 1.0).to(DEV)
    _assert_same_kept(x, top_p)

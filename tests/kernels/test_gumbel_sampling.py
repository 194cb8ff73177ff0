"""The fused Gumbel-max sampling kernel: greedy rows equal ``torch.argmax``, temperature rows
follow ``softmax(logits / T)``, and a row's draw depends on its key and logits only. On CPU
the kernels run in Triton's interpreter (few draws); on CUDA with many."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from scipy import stats

pytest.importorskip("triton")

from tokenmill.kernels.sampling import gumbel as gumbel_sampling  # noqa: E402
from tokenmill.kernels.sampling.gumbel import chunk_plan, gumbel_argmax  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402
from tokenmill.worker.sampler import Sampler  # noqa: E402
from tokenmill.worker.sampling_metadata import (  # noqa: E402
    SamplingRow,
    add_gumbel_inputs,
    build_plain_sampling_metadata,
    build_sampling_metadata,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or the Triton interpreter",
)
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# The interpreter runs each program in Python (~15 ms): a few hundred draws there.
DRAWS = 20_000 if DEV == "cuda" else 400
LOGITS = torch.tensor([0.3, 2.0, -1.0, 1.1, -0.2, 1.6, 0.0, -0.7, 0.9, 1.3, -0.5, 0.6])


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(seed))


def _draw(logits: torch.Tensor, temperature, keys: torch.Tensor) -> torch.Tensor:
    rows = logits.shape[0]
    t = torch.as_tensor(temperature, dtype=torch.float32).expand(rows).contiguous()
    return gumbel_argmax(logits.to(DEV), t.to(DEV), keys.to(DEV)).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_are_torch_argmax_ties_included(dtype):
    vocab = 5000  # several chunks per row
    x = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    x[1] = 0.0  # all tied: token 0
    x[2, 7], x[2, vocab - 3] = 99.0, 99.0  # a tie across chunks: the first
    x[3] = float("-inf")
    x[3, vocab - 1] = -1.0  # the only finite entry is the last column
    x[4] = float("-inf")  # nothing finite: token 0, as torch.argmax
    x[5, 1000:1010] = 50.0  # a tie inside one chunk
    x = x.to(dtype)
    assert chunk_plan(6, vocab)[0] > 1
    got = _draw(x, 0.0, _keys(6))
    assert got.tolist() == x.float().argmax(dim=-1).tolist()
    assert got.tolist()[1:] == [0, 7, vocab - 1, 0, 1000]


def test_a_row_draw_depends_on_its_key_and_logits_only():
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(1))
    keys = _keys(5, seed=2)
    batch = _draw(logits, 1.0, keys)
    for row in range(5):
        assert int(_draw(logits[row : row + 1], 1.0, keys[row : row + 1])) == int(batch[row])
    other = keys.clone()
    other[2] ^= 1
    again = _draw(logits, 1.0, other)
    assert again[[0, 1, 3, 4]].tolist() == batch[[0, 1, 3, 4]].tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.5] if DEV == "cuda" else [0.7])
def test_draws_follow_the_softmax(temperature):
    counts = np.bincount(
        _draw(LOGITS.expand(DRAWS, -1), temperature, _keys(DRAWS)).numpy(), minlength=12
    )
    probs = torch.softmax(LOGITS.double() / temperature, dim=0).numpy()
    assert stats.chisquare(counts, probs * DRAWS).pvalue > 1e-3, counts


def test_two_equal_top_tokens_are_a_fair_coin_at_a_tiny_temperature():
    # In float32, 31.1 + 1e-5 * g would round the noise to a few steps and favour token 3.
    logits = torch.full((DRAWS, 12), 20.0)
    logits[:, 3] = logits[:, 11] = 31.123457
    got = _draw(logits, 1e-5, _keys(DRAWS, seed=5))
    assert set(got.tolist()) <= {3, 11}
    assert stats.binomtest(int((got == 3).sum()), DRAWS, 0.5).pvalue > 1e-3


def test_a_row_with_one_allowed_token_draws_it_whatever_the_noise():
    # These keys put a draw within 128 of 2**32 on column 1, where 1 - v in float32 is 0:
    # the noise must stay finite, or the row's only finite column would lose to column 0.
    keys = torch.tensor([2472697, 38904183, 113483383, 12345])
    x = torch.full((4, 8), float("-inf"))
    x[:, 1] = 5.0
    assert _draw(x, 1.0, keys).tolist() == [1, 1, 1, 1]


def test_masked_tokens_are_never_drawn():
    logits = LOGITS.expand(DRAWS // 4, -1).clone()
    logits[:, ::2] = float("-inf")
    assert (_draw(logits, 1.3, _keys(DRAWS // 4)) % 2 == 1).all()


def _meta(params: list[SamplingParams]):
    """Metadata on DEV with the fused kernel's fields (built on CPU for the interpreter)."""
    rows = [SamplingRow(p, [1], []) for p in params]
    meta = build_sampling_metadata(rows, 12, torch.device(DEV))
    if meta.gumbel_seeds is None:
        t = np.array([0.0 if p.sampling_type_greedy else p.temperature for p in params])
        add_gumbel_inputs(meta, t, meta.seeds, torch.device(DEV))
    return meta


def test_sampler_draw_of_a_seeded_row_ignores_the_others_truncation():
    others = [SamplingParams(top_k=2), SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)]
    logits = LOGITS.expand(4, -1).to(DEV)
    sampler = Sampler()
    for step in range(6):
        row = SamplingParams(temperature=0.8, seed=11 + 1000 * step)
        alone = sampler(logits[:1], _meta([row])).sampled_token_ids
        mixed = sampler(logits, _meta([*others, row][-4:])).sampled_token_ids
        assert int(alone[0]) == int(mixed[3])


def test_sampler_truncation_and_processors_hold_on_the_fused_route():
    params = [
        SamplingParams(top_k=3),
        SamplingParams(min_p=0.5),
        SamplingParams(allowed_token_ids=[2, 6]),
        SamplingParams(temperature=0.0, logit_bias={10: 5.0}),
    ]
    meta = _meta(params * 30)
    out = Sampler()(LOGITS.expand(120, -1).to(DEV), meta).sampled_token_ids.cpu().view(30, 4)
    top3 = set(LOGITS.topk(3).indices.tolist())
    probs = torch.softmax(LOGITS, 0)
    assert set(out[:, 0].tolist()) <= top3
    assert set(out[:, 1].tolist()) <= set((probs >= 0.5 * probs.max()).nonzero()[:, 0].tolist())
    assert set(out[:, 2].tolist()) <= {2, 6}
    assert set(out[:, 3].tolist()) == {10}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_plain_rows_take_the_fused_route():
    """The model runner's numpy metadata for plain rows carries the kernel's fields too."""
    meta = build_plain_sampling_metadata(
        np.array([True, False, False]), np.array([0.0, 0.7, 1.2], np.float32),
        np.zeros(3, np.int64), np.ones(3, np.float32), np.zeros(3, np.float32), 12,
        torch.device("cuda"),
    )  # fmt: skip
    assert meta.gumbel_temperature.tolist() == pytest.approx([0.0, 0.7, 1.2])
    assert meta.gumbel_seeds.shape == (3,)
    assert meta.greedy_mask.tolist() == [True, False, False]


def test_metadata_has_the_fused_fields_on_cuda_only():
    rows = [SamplingRow(SamplingParams(), [1], []), SamplingRow(SamplingParams(seed=3), [1], [])]
    cpu = build_sampling_metadata(rows, 12, torch.device("cpu"))
    assert cpu.gumbel_seeds is None and cpu.gumbel_temperature is None
    if torch.cuda.is_available() and gumbel_sampling.HAS_TRITON:
        gpu = build_sampling_metadata(rows, 12, torch.device("cuda"))
        assert gpu.gumbel_seeds.tolist()[1] == cpu.seeds[1]

"""Sampler and SamplingMetadata: greedy, truncation, seeds, penalties, masks, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampler import (
    Sampler,
    apply_logits_processors,
    apply_top_k_top_p,
    wide_argmax,
)
from tokenmill.worker.sampling_metadata import (
    SamplingMetadata,
    SamplingRow,
    bad_word_bans,
    build_sampling_metadata,
    step_seed,
)

V = 16
# Distinct logits in no particular order; every probability is at least ~1%, so the chi-square
# expected counts stay large.
LOGITS = torch.tensor(
    [0.3, 2.0, -1.0, 1.1, -0.2, 1.6, 0.0, -0.7, 0.9, 1.3, -0.5, 0.6, 1.8, -0.9, 0.4, 0.1]
)
NUM_DRAWS = 20_000

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _meta(
    params: list[SamplingParams],
    vocab_size: int = V,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    device: str = "cpu",
) -> SamplingMetadata:
    prompts = prompts or [[] for _ in params]
    outputs = outputs or [[] for _ in params]
    rows = [SamplingRow(p, pr, out) for p, pr, out in zip(params, prompts, outputs, strict=True)]
    return build_sampling_metadata(rows, vocab_size, torch.device(device))


def _draw_counts(params: SamplingParams, device: str = "cpu") -> np.ndarray:
    """Token counts of NUM_DRAWS draws: one forward over NUM_DRAWS identical rows of LOGITS."""
    torch.manual_seed(0)
    meta = _meta([params] * NUM_DRAWS, device=device)
    out = Sampler()(LOGITS.to(device).expand(NUM_DRAWS, -1), meta)
    return torch.bincount(out.sampled_token_ids, minlength=V).cpu().numpy()


def _assert_matches(counts: np.ndarray, expected: np.ndarray) -> None:
    """No draw outside the support of ``expected``; chi-square goodness of fit inside it."""
    support = expected > 0
    assert counts[~support].sum() == 0, f"tokens outside the allowed set: {counts}"
    if support.sum() == 1:
        return
    expected_counts = expected[support] / expected[support].sum() * counts.sum()
    p_value = stats.chisquare(counts[support], expected_counts).pvalue
    assert p_value > 1e-3, (counts, expected_counts)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def _reference(
    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """The truncated distribution of LOGITS, computed the slow, obvious way."""
    probs = _softmax(LOGITS.double().numpy() / temperature)
    keep = probs >= min_p * probs.max()
    order = np.argsort(-probs)
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        kept = [i for i in order if keep[i]]
        p = probs[kept] / probs[kept].sum()
        cutoff = int(np.searchsorted(np.cumsum(p), top_p)) + 1
        keep[kept[cutoff:]] = False
    return np.where(keep, probs, 0.0)


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(device: str, dtype: torch.dtype) -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    meta = _meta([SamplingParams(temperature=0.0)] * 8, vocab_size=50, device=device)
    assert meta.all_greedy and meta.top_k is None and meta.seeds is None
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.logprobs is None


def test_greedy_rows_unaffected_by_random_rows() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    greedy = SamplingParams(temperature=0.0)
    params = [
        greedy,
        SamplingParams(temperature=1.5, top_k=5),
        greedy,
        SamplingParams(top_p=0.3, min_p=0.1, seed=3),
        SamplingParams(temperature=0.7),
        greedy,
    ]
    meta = _meta(params, vocab_size=40)
    assert not meta.all_greedy and not meta.all_random
    for seed in range(5):
        torch.manual_seed(seed)
        sampled = Sampler()(logits, meta).sampled_token_ids
        for row in (0, 2, 5):
            assert sampled[row] == logits[row].argmax()


def test_float32_logits_are_not_modified() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    params = SamplingParams(
        temperature=0.5, top_k=4, top_p=0.8, repetition_penalty=1.5, presence_penalty=1.0
    )
    params.logit_bias = {1: 3.0}
    meta = _meta([params] * 3, prompts=[[1, 2]] * 3, outputs=[[3]] * 3)
    Sampler()(logits, meta)
    assert torch.equal(logits, before)


def test_half_precision_input_same_draws_and_left_untouched() -> None:
    """The in-place path (float32 copies of bf16 logits) draws exactly the out-of-place one."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)] * 3
    params[2] = SamplingParams(temperature=1.3, seed=11)
    draws = []
    for x in (logits, logits.float()):
        torch.manual_seed(5)
        draws.append(Sampler()(x, _meta(params)).sampled_token_ids)
    assert torch.equal(draws[0], draws[1])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [49152, 128256, 262144, 50257])
def test_wide_argmax_is_argmax_ties_included(device: str, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=gen)
    x[1] = 0.0  # all tied: index 0
    x[2, 7], x[2, vocab - 3] = 99.0, 99.0  # a tie across chunks: the first
    x[3, :] = float("-inf")
    x[3, vocab - 1] = -1.0  # the only finite entry is the last
    x[4, 1000:1010] = 50.0  # a tie inside one chunk
    x = x.to(device)
    got = wide_argmax(x, force=True)
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert got.tolist()[1:] == [0, 7, vocab - 1, 1000]


# ---------------------------------------------------------------- random sampling


def test_plain_sampling_matches_softmax() -> None:
    _assert_matches(_draw_counts(SamplingParams()), _reference())


@pytest.mark.parametrize("device", DEVICES)
def test_two_equal_top_tokens_are_drawn_evenly_at_a_tiny_temperature(device: str) -> None:
    # Large logits at T = 1e-5 scale to ~3e6, where float32 could round the noise away and
    # hand ties to the lower token id; the drawn pair must stay a fair coin.
    logits = torch.full((V,), 20.0)
    logits[3] = logits[11] = 31.123457
    torch.manual_seed(0)
    meta = _meta([SamplingParams(temperature=1e-5)] * NUM_DRAWS, device=device)
    out = Sampler()(logits.to(device).expand(NUM_DRAWS, -1), meta).sampled_token_ids
    counts = torch.bincount(out, minlength=V).cpu()
    assert counts[3] + counts[11] == NUM_DRAWS
    assert stats.binomtest(int(counts[3]), NUM_DRAWS, 0.5).pvalue > 1e-3, counts


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_reshapes_distribution(temperature: float) -> None:
    counts = _draw_counts(SamplingParams(temperature=temperature))
    _assert_matches(counts, _reference(temperature=temperature))
    # A sharper (flatter) distribution puts more (less) mass on the top token than T = 1.
    top = int(LOGITS.argmax())
    plain = _reference()[top]
    assert (counts[top] / NUM_DRAWS > plain) == (temperature < 1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": 1},
        {"top_k": 5},
        {"top_p": 0.45},
        {"top_p": 0.8},
        {"min_p": 0.3},
        {"top_k": 8, "top_p": 0.7},
        {"temperature": 0.7, "min_p": 0.05, "top_k": 10, "top_p": 0.9},
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_truncation_keeps_allowed_set_and_renormalises(kwargs: dict, device: str) -> None:
    counts = _draw_counts(SamplingParams(**kwargs), device)
    _assert_matches(counts, _reference(**kwargs))


def test_top_p_exact_kept_set() -> None:
    # probs 0.5, 0.25, 0.125, 0.125 (tokens 1, 2, 0, 3): top_p 0.6 needs the two largest,
    # 0.45 only the largest (it alone reaches it), 0.8 three; 1.0 keeps all.
    logits = torch.tensor([[math.log(0.125), math.log(0.5), math.log(0.25), math.log(0.125)]] * 4)
    top_p = torch.tensor([0.6, 0.45, 0.8, 1.0])
    kept = torch.isfinite(apply_top_k_top_p(logits, None, top_p))
    assert kept[:2].tolist() == [[False, True, True, False], [False, True, False, False]]
    assert kept[2, 1:3].all() and kept[2].sum() == 3  # either of the tied 0.125 tokens
    assert kept[3].all()
    # top-k applies first: k = 1 leaves only the top token whatever top_p says.
    top_k = torch.tensor([1, 2, 4, 3])
    kept = torch.isfinite(apply_top_k_top_p(logits, top_k, top_p))
    assert kept.sum(dim=-1).tolist() == [1, 1, 3, 3]
    # Through the topk path (only max_top_k columns sorted); row 2's top-p then sees
    # 0.5 / 0.875 and 0.25 / 0.875 above the third token: 0.857 >= 0.8 drops it.
    top_k = torch.tensor([1, 2, 3, 3])
    kept = torch.isfinite(apply_top_k_top_p(logits, top_k, top_p, max_top_k=3))
    assert kept.sum(dim=-1).tolist() == [1, 1, 2, 3]
    assert kept[:, 1].all() and not kept[0, 2]


def test_top_p_one_keeps_tail_in_mixed_batch() -> None:
    # Tiny tail probabilities must survive for a row at top_p = 1 next to a top_p row.
    logits = torch.cat([torch.tensor([30.0]), torch.zeros(999)])[None].expand(2, -1)
    out = apply_top_k_top_p(logits, None, torch.tensor([1.0, 0.5]))
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1]).sum() == 1


def test_top_k_larger_than_vocab_disables_it() -> None:
    meta = _meta([SamplingParams(top_k=V + 10), SamplingParams(top_k=-1)])
    assert meta.top_k is None


# ---------------------------------------------------------------- seeds


def _seeded_tokens(
    seed: int, steps: int, position: int | None, logits_row: torch.Tensor, device: str = "cpu"
) -> list[int]:
    """Tokens of a seeded row over ``steps`` steps, alone or at ``position`` in a batch."""
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3, top_p=0.9),
        SamplingParams(seed=seed + 1),
        SamplingParams(min_p=0.2, presence_penalty=0.5),
    ]
    sampler = Sampler()
    tokens: list[int] = []
    for step in range(steps):
        torch.manual_seed(1000 + step)  # the shared generator's state must not matter
        seeded = SamplingParams(temperature=0.9, seed=seed)
        if position is None:
            params, outputs, logits = [seeded], [list(tokens)], logits_row[None]
        else:
            params = others[:position] + [seeded] + others[position:]
            outputs = [[1, 2][: step % 3] for _ in params]
            outputs[position] = list(tokens)
            logits = torch.randn(len(params), V)
            logits[position] = logits_row
        meta = _meta(params, outputs=outputs, device=device)
        sampled = sampler(logits.to(device), meta).sampled_token_ids
        tokens.append(int(sampled[position or 0]))
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens_alone_or_batched(device: str) -> None:
    flat = torch.zeros(V)
    alone = _seeded_tokens(42, 12, None, flat, device)
    assert alone == _seeded_tokens(42, 12, 0, flat, device)
    assert alone == _seeded_tokens(42, 12, 3, flat, device)
    assert len(set(alone)) > 1  # the stream moves with the step


def test_different_seeds_differ() -> None:
    flat = torch.zeros(V)
    assert _seeded_tokens(1, 12, None, flat) != _seeded_tokens(2, 12, None, flat)


def test_step_seed_depends_on_seed_and_step_only() -> None:
    assert step_seed(7, 3) == step_seed(7, 3)
    assert len({step_seed(s, n) for s in range(20) for n in range(20)}) == 400
    assert 0 <= step_seed(-5, 0) < 2**63


def test_seeded_rows_follow_the_distribution() -> None:
    # Every row has its own seed: the per-row streams still sample the right distribution.
    torch.manual_seed(0)
    params = [SamplingParams(top_k=5, seed=s) for s in range(4000)]
    out = Sampler()(LOGITS.expand(4000, -1), _meta(params))
    counts = torch.bincount(out.sampled_token_ids, minlength=V).numpy()
    _assert_matches(counts, _reference(top_k=5))


# ---------------------------------------------------------------- penalties and masks

BASE = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0, 0.0]])


def _processed(params: list[SamplingParams], prompts=None, outputs=None) -> torch.Tensor:
    meta = _meta(params, vocab_size=6, prompts=prompts, outputs=outputs)
    return apply_logits_processors(BASE.expand(len(params), -1), meta)


def test_frequency_and_presence_penalties_over_output_only() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = _processed([params, params], prompts=[[0], [0]], outputs=[[1, 1, 4], [2]])
    assert torch.allclose(out[0], torch.tensor([1.0, 0.75, -1.0, 0.5, 2.25, 0.0]))
    assert torch.allclose(out[1], torch.tensor([1.0, 2.0, -1.75, 0.5, 3.0, 0.0]))


def test_repetition_penalty_over_prompt_and_output() -> None:
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(repetition_penalty=0.5)]
    out = _processed(params, prompts=[[0, 2], [2, 2, 2]], outputs=[[4], []])
    # positive logits divided, negative multiplied; an unseen token keeps its logit
    assert torch.allclose(out[0], torch.tensor([0.5, 2.0, -2.0, 0.5, 1.5, 0.0]))
    assert torch.allclose(out[1], torch.tensor([1.0, 2.0, -0.5, 0.5, 3.0, 0.0]))


def test_penalties_only_on_rows_that_ask() -> None:
    out = _processed(
        [SamplingParams(), SamplingParams(presence_penalty=1.0, repetition_penalty=1.5)],
        prompts=[[0, 1], [0]],
        outputs=[[4, 4], [4]],
    )
    assert torch.equal(out[0], BASE[0])
    assert torch.allclose(out[1], torch.tensor([1 / 1.5, 2.0, -1.0, 0.5, 3.0 / 1.5 - 1.0, 0.0]))


def test_logit_bias_is_added() -> None:
    params = SamplingParams(logit_bias={3: 5.0, 5: -100.0})
    out = _processed([params, SamplingParams()])
    assert torch.allclose(out[0], torch.tensor([1.0, 2.0, -1.0, 5.5, 3.0, -100.0]))
    assert torch.equal(out[1], BASE[0])


def test_min_tokens_masks_stop_and_eos_until_reached() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1])
    params.eos_token_ids = [4]
    ignore = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1], ignore_eos=True)
    ignore.eos_token_ids = [4]
    out = _processed([params, params, ignore], outputs=[[0, 0], [0, 0, 0], []])
    inf = float("-inf")
    assert out[0].tolist() == [1.0, inf, -1.0, 0.5, inf, 0.0]
    assert torch.equal(out[1], BASE[0])  # min_tokens reached
    assert out[2].tolist() == [1.0, inf, -1.0, 0.5, 3.0, 0.0]  # EOS allowed with ignore_eos
    meta = _meta([params, params], vocab_size=6, outputs=[[0, 0], [0, 0, 0]])
    sampled = Sampler()(BASE.expand(2, -1), meta).sampled_token_ids
    assert sampled.tolist() == [0, 4]


def test_allowed_token_ids() -> None:
    params = SamplingParams(allowed_token_ids=[0, 2])
    out = _processed([params, SamplingParams()])
    inf = float("-inf")
    assert out[0].tolist() == [1.0, inf, -1.0, inf, inf, inf]
    assert torch.equal(out[1], BASE[0])
    torch.manual_seed(0)
    meta = _meta([params] * 2000, vocab_size=6)
    sampled = Sampler()(BASE.expand(2000, -1), meta).sampled_token_ids
    assert set(sampled.tolist()) == {0, 2}


def test_nothing_optional_when_unused() -> None:
    meta = _meta([SamplingParams(), SamplingParams(temperature=0.3)])
    assert meta.all_random
    for name in (
        "greedy_mask",
        "top_k",
        "top_p",
        "min_p",
        "presence_penalties",
        "repetition_penalties",
        "prompt_token_ids",
        "output_token_ids",
        "banned_tokens",
        "logit_bias",
        "allowed_token_mask",
        "seeds",
        "num_logprobs",
        "max_num_logprobs",
    ):
        assert getattr(meta, name) is None, name


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_forward_has_no_host_device_sync() -> None:
    params = [
        SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.2),
        SamplingParams(top_k=5, top_p=0.9, min_p=0.05, presence_penalty=0.5, seed=1),
        SamplingParams(logit_bias={1: 2.0}, allowed_token_ids=[1, 2, 3], min_tokens=2),
    ]
    params[2].eos_token_ids = [0]
    meta = _meta(params, vocab_size=64, prompts=[[1, 2]] * 3, outputs=[[3]] * 3, device="cuda")
    logits = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    sampler = Sampler()
    sampler(logits, meta)  # warm up (lazy initialisation may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.device.type == "cuda"
    assert 1 <= int(out.sampled_token_ids[2]) <= 3


def test_top_p_below_float32_range_keeps_the_top_token() -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(6))
    meta = _meta([SamplingParams(top_p=1e-46)] * 2)
    sampled = Sampler()(logits, meta).sampled_token_ids
    assert sampled.tolist() == logits.argmax(dim=-1).tolist()


def test_bad_word_bans_match_the_end_of_the_output() -> None:
    words = [[7], [3, 4, 5], [9, 4]]
    assert bad_word_bans(words, []) == [7]  # a one-token word: always
    assert bad_word_bans(words, [1, 3, 4]) == [7, 5]  # 3 4 ends the output: not 5 next
    assert bad_word_bans(words, [3, 4, 1]) == [7]
    assert bad_word_bans(words, [9]) == [7, 4]
    rows = [SamplingRow(SamplingParams(), [1], [3, 4]) for _ in range(2)]
    rows[1].params.bad_words_token_ids = words
    meta = build_sampling_metadata(rows, 10, torch.device("cpu"))
    assert meta.banned_tokens is not None
    assert [t.tolist() for t in meta.banned_tokens] == [[1, 1], [7, 5]]
    logits = apply_logits_processors(torch.zeros(2, 10), meta)
    assert torch.isinf(logits[1, [5, 7]]).all() and not torch.isinf(logits[0]).any()


@pytest.mark.parametrize("device", DEVICES)
def test_a_ban_that_leaves_no_token_is_lifted(device: str) -> None:
    """Allowed tokens 5 and 7, where each completes a bad word after the output so far: the
    row samples among its allowed tokens (never token 0). A row the bans leave a token keeps
    them."""
    params = SamplingParams(allowed_token_ids=[5, 7], temperature=0.0)
    params.bad_words_token_ids = [[3, 5], [3, 7]]
    rows = [SamplingRow(params, [1], [3]), SamplingRow(params, [1], [4])]
    meta = build_sampling_metadata(rows, 10, torch.device(device))
    logits = torch.arange(10, dtype=torch.float32).expand(2, -1).to(device)
    processed = apply_logits_processors(logits, meta).cpu()
    assert torch.isfinite(processed[0, [5, 7]]).all()
    sampled = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert sampled == [7, 7]
    blocked = SamplingParams(allowed_token_ids=[5, 7], temperature=0.0)
    blocked.bad_words_token_ids = [[3, 7]]
    meta = build_sampling_metadata([SamplingRow(blocked, [1], [3])], 10, torch.device(device))
    assert Sampler()(logits[:1], meta).sampled_token_ids.tolist() == [5]

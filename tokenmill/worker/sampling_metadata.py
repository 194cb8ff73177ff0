"""SamplingMetadata: the sampling parameters of one step's batch, as tensors.

The model runner describes each row that samples this step with a ``SamplingRow``;
``build_sampling_metadata`` turns the rows into a ``SamplingMetadata`` whose tensors live on the
logits' device. Every optional feature stays ``None`` unless some row uses it, so the sampler
branches on Python flags only (no host-device syncs) and an all-greedy batch costs one argmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.kernels.device import HAS_TRITON
from tokenmill.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One row of the batch that samples a token this step.

    Attributes:
        params: the request's sampling parameters.
        prompt_token_ids: the prompt, as token ids.
        output_token_ids: tokens generated so far, before this step.
        token_bitmask: ``[ceil(V / 32)]`` int32, bit ``t % 32`` of word ``t // 32`` set
            where token ``t`` may come next (the request's grammar; structured outputs),
            else None.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    token_bitmask: np.ndarray | None = None


@dataclass
class SamplingMetadata:
    """Sampling parameters of the ``B`` rows that sample this step, in batch order.

    Tensors are on the logits' device. Optional fields are ``None`` when no row uses them.

    Attributes:
        temperature: [B] float32; 1.0 for greedy rows (they never divide by it).
        all_greedy: every row decodes by argmax.
        all_random: no row is greedy.
        greedy_mask: [B] bool, True for greedy rows; only in mixed batches.
        top_k: [B] int64 in [1, V]; V for rows that do not use top-k.
        max_top_k: the largest value in ``top_k`` (a Python int, for ``torch.topk``).
        top_p: [B] float32 in (0, 1]; 1.0 for rows that do not use it.
        min_p: [B] float32 in [0, 1]; 0.0 for rows that do not use it.
        presence_penalties: [B] float32; set with ``frequency_penalties``.
        frequency_penalties: [B] float32.
        repetition_penalties: [B] float32; 1.0 disables it for a row.
        prompt_token_ids: [B, Lp] int64, padded with V; only with repetition penalties.
        output_token_ids: [B, Lo] int64, padded with V; only with any penalty.
        banned_tokens: (row indices, token ids), both [M] int64: tokens that may not be
            sampled this step: stop/EOS tokens while the row has fewer than ``min_tokens``
            outputs, and the last token of each bad word whose other tokens end the output.
        logit_bias: (row indices [N] int64, token ids [N] int64, values [N] float32).
        allowed_token_mask: [B, V] bool, True where a token may be sampled (allowed_token_ids
            and the grammar of structured outputs).
        seeds: row index -> seed of this step's noise, for rows with ``SamplingParams.seed``
            (already mixed with the number of output tokens, see ``step_seed``).
        gumbel_temperature: [B] float32, 0 for greedy rows; with ``gumbel_seeds``, set when
            the batch samples through ``kernels.sampling.gumbel.gumbel_argmax`` (on CUDA).
        gumbel_seeds: [B] int64 Philox keys: ``seeds``' value for seeded rows, a fresh draw
            from torch's default CPU generator for the others.
        num_logprobs: per row, the number of top logprobs asked for (``-1``: the whole
            vocabulary), or None when the row asked for none.
        max_num_logprobs: the K of the batch's logprobs tensors (``-1`` resolved to V), or None
            when no row asked for logprobs.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    banned_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    allowed_token_mask: torch.Tensor | None = None
    seeds: dict[int, int] | None = None
    gumbel_temperature: torch.Tensor | None = None
    gumbel_seeds: torch.Tensor | None = None
    num_logprobs: list[int | None] | None = None
    max_num_logprobs: int | None = None


def step_seed(seed: int, num_output_tokens: int) -> int:
    """The seed of a seeded row's noise at one step.

    A function of the request's seed and how many tokens it has generated only, so the same
    seed and prompt give the same tokens whatever else is in the batch, wherever the row sits
    in it, and after preemption by recompute. Mixed with the splitmix64 finaliser (Steele, Lea
    and Flood, "Fast Splittable Pseudorandom Number Generators", OOPSLA 2014) so that
    neighbouring (seed, step) pairs give unrelated streams.

    Returns:
        A seed in [0, 2**63) for ``torch.Generator.manual_seed``.
    """
    x = (seed * 0x9E3779B97F4A7C15 + num_output_tokens + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def build_sampling_metadata(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """Build the tensors the sampler needs for ``rows``.

    Args:
        rows: the rows that sample this step, in batch order (at least one).
        vocab_size: V, the width of the logits.
        device: where the logits are.

    Returns:
        The batch's SamplingMetadata; token ids outside [0, V) must have been rejected
        before (``SamplingParams.verify_for_model``).
    """
    params = [row.params for row in rows]
    greedy = [p.sampling_type_greedy for p in params]
    all_greedy, all_random = all(greedy), not any(greedy)
    temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
    meta = SamplingMetadata(
        temperature=_floats(temperature, device),
        all_greedy=all_greedy,
        all_random=all_random,
    )
    if not (all_greedy or all_random):
        meta.greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
    if not all_greedy:
        _add_truncation(meta, params, vocab_size, device)
        meta.seeds = {
            i: step_seed(row.params.seed, len(row.output_token_ids))
            for i, row in enumerate(rows)
            if row.params.seed is not None and not greedy[i]
        } or None
    _add_penalties(meta, rows, vocab_size, device)
    _add_masks(meta, rows, vocab_size, device)
    num_logprobs = [p.logprobs for p in params]
    if any(n is not None for n in num_logprobs):
        meta.num_logprobs = num_logprobs
        meta.max_num_logprobs = max(
            vocab_size if n == -1 else n for n in num_logprobs if n is not None
        )
    if uses_fused_sampler(device):
        pairs = zip(params, greedy, strict=True)
        temperature = np.array([0.0 if g else p.temperature for p, g in pairs])
        add_gumbel_inputs(meta, temperature, meta.seeds, device)
    return meta


def build_plain_sampling_metadata(
    greedy: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    vocab_size: int,
    device: torch.device,
    to_device: Callable[[np.ndarray], torch.Tensor] | None = None,
) -> SamplingMetadata:
    """``build_sampling_metadata`` for rows that use temperature, top-k, top-p and min-p
    only, from per-row numpy arrays (one gather each, no per-row Python).

    Args:
        greedy: [B] bool; temperature, top_p, min_p: [B] float32; top_k: [B] int64, values
            <= 0 or >= ``vocab_size`` meaning no top-k.
        to_device: puts a host array on ``device`` (the model runner's one copy per step,
            ``step_staging.StepStaging.put``); default its own copy per array.
    """
    v = vocab_size
    put = to_device or (lambda values: _device(values, device))
    all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
    meta = SamplingMetadata(
        temperature=put(np.where(greedy, np.float32(1.0), temperature).astype(np.float32)),
        all_greedy=all_greedy,
        all_random=all_random,
    )
    if not (all_greedy or all_random):
        meta.greedy_mask = put(greedy)
    if not all_greedy:
        top_k = np.where((top_k <= 0) | (top_k >= v), v, top_k)
        if (top_k < v).any():
            meta.top_k = put(top_k.astype(np.int64))
            meta.max_top_k = int(top_k.max())
        if (top_p < 1.0).any():
            meta.top_p = put(top_p)
        if (min_p > 0.0).any():
            meta.min_p = put(min_p)
    if uses_fused_sampler(device):
        add_gumbel_inputs(meta, np.where(greedy, 0.0, temperature), None, device, to_device)
    return meta


def _device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    # NOTE: non-blocking from pageable memory: the driver copies the bytes to its staging
    # memory before it returns, and may wait for the stream first (CUDA's "API
    # synchronization behavior"); the runner's pinned buffers would rule that out.
    return torch.from_numpy(values).to(device, non_blocking=True)


def uses_fused_sampler(device: torch.device) -> bool:
    """Whether batches on ``device`` sample through ``kernels.sampling.gumbel``'s fused
    kernel: on CUDA with Triton."""
    return device.type == "cuda" and HAS_TRITON


def add_gumbel_inputs(
    meta: SamplingMetadata,
    temperature: np.ndarray,
    seeds: dict[int, int] | None,
    device: torch.device,
    to_device: Callable[[np.ndarray], torch.Tensor] | None = None,
) -> None:
    """Set the fused kernel's fields of ``meta``.

    Args:
        temperature: [B] per-row temperature, 0 for greedy rows.
        seeds: row -> this step's seed (``step_seed``) for seeded rows; the other rows get
            fresh keys from torch's default CPU generator.
        to_device: as for ``build_plain_sampling_metadata``.
    """
    rows = len(temperature)
    if meta.all_greedy and to_device is None:  # no noise: nothing to copy from the host
        meta.gumbel_seeds = torch.zeros(rows, dtype=torch.int64, device=device)
        meta.gumbel_temperature = torch.zeros(rows, dtype=torch.float32, device=device)
        return
    put = to_device or (lambda values: _device(values, device))
    if meta.all_greedy:  # zeros staged with the step's inputs cost no launch of their own
        keys = np.zeros(rows, dtype=np.int64)
    else:
        keys = torch.randint(0, 2**62, (rows,), dtype=torch.int64).numpy()
        for row, seed in (seeds or {}).items():
            keys[row] = seed
    meta.gumbel_seeds = put(keys)
    meta.gumbel_temperature = put(temperature.astype(np.float32))


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _add_truncation(
    meta: SamplingMetadata, params: list[SamplingParams], vocab_size: int, device: torch.device
) -> None:
    """top-k, top-p and min-p; greedy rows have them disabled by SamplingParams already."""
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    if any(k < vocab_size for k in top_k):
        meta.top_k = torch.tensor(top_k, dtype=torch.int64, device=device)
        meta.max_top_k = max(top_k)
    if any(p.top_p < 1.0 for p in params):
        meta.top_p = _floats([p.top_p for p in params], device)
    if any(p.min_p > 0.0 for p in params):
        meta.min_p = _floats([p.min_p for p in params], device)


def _add_penalties(
    meta: SamplingMetadata, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> None:
    params = [row.params for row in rows]
    use_repetition = any(p.repetition_penalty != 1.0 for p in params)
    use_additive = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
    if not (use_repetition or use_additive):
        return
    meta.output_token_ids = _pad_2d([row.output_token_ids for row in rows], vocab_size, device)
    if use_repetition:
        meta.repetition_penalties = _floats([p.repetition_penalty for p in params], device)
        meta.prompt_token_ids = _pad_2d([row.prompt_token_ids for row in rows], vocab_size, device)
    if use_additive:
        meta.presence_penalties = _floats([p.presence_penalty for p in params], device)
        meta.frequency_penalties = _floats([p.frequency_penalty for p in params], device)


def _add_masks(
    meta: SamplingMetadata, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> None:
    """min_tokens, bad words, logit_bias and allowed_token_ids, as sparse (row, token) index
    lists."""
    banned_rows: list[int] = []
    banned_tokens: list[int] = []
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    allowed_rows: list[int] = []
    allowed_row_of_token: list[int] = []
    allowed_tokens: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) < p.min_tokens:
            ids = p.all_stop_token_ids
            banned_rows += [i] * len(ids)
            banned_tokens += ids
        if p.bad_words_token_ids:
            ids = bad_word_bans(p.bad_words_token_ids, row.output_token_ids)
            banned_rows += [i] * len(ids)
            banned_tokens += ids
        if p.logit_bias:
            bias_rows += [i] * len(p.logit_bias)
            bias_tokens += p.logit_bias.keys()
            bias_values += p.logit_bias.values()
        if p.allowed_token_ids is not None:
            allowed_rows.append(i)
            allowed_row_of_token += [i] * len(p.allowed_token_ids)
            allowed_tokens += p.allowed_token_ids
    if banned_rows:
        meta.banned_tokens = (_longs(banned_rows, device), _longs(banned_tokens, device))
    if bias_rows:
        meta.logit_bias = (
            _longs(bias_rows, device),
            _longs(bias_tokens, device),
            _floats(bias_values, device),
        )
    if allowed_rows:
        mask = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)
        mask[_longs(allowed_rows, device)] = False
        mask[_longs(allowed_row_of_token, device), _longs(allowed_tokens, device)] = True
        meta.allowed_token_mask = mask
    grammar_rows = [i for i, row in enumerate(rows) if row.token_bitmask is not None]
    if grammar_rows:
        mask = grammar_token_mask([rows[i].token_bitmask for i in grammar_rows], vocab_size, device)
        allowed = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)
        allowed[_longs(grammar_rows, device)] = mask
        if meta.allowed_token_mask is not None:
            allowed &= meta.allowed_token_mask
        meta.allowed_token_mask = allowed


def grammar_token_mask(
    bitmasks: Sequence[np.ndarray], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[G, V]`` bool from ``G`` token bitmasks (``[W]`` int32 each, ``W * 32 >= V``: bit
    ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed), unpacked on the
    device so that only the packed words (V / 8 bytes a row) are copied there."""
    words = torch.from_numpy(np.stack(bitmasks).astype(np.int32, copy=False)).to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.view(len(bitmasks), -1)[:, :vocab_size].bool()


def bad_word_bans(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete one of ``bad_words`` (token-id sequences) after
    ``output``: a one-token word always, a longer one when its other tokens end the output
    (vLLM's ``bad_words``: matched against the generated tokens only)."""
    banned = []
    for word in bad_words:
        n = len(word) - 1
        if n == 0 or (len(output) >= n and list(output[len(output) - n :]) == list(word[:-1])):
            banned.append(word[-1])
    return banned


def _longs(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _pad_2d(seqs: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), max_len] int64, right-padded with ``pad`` (at least one column)."""
    width = max(1, max(len(s) for s in seqs))
    # NOTE: numpy converts each row in C; one copy to the device for the whole batch.
    out = np.full((len(seqs), width), pad, dtype=np.int64)
    for i, seq in enumerate(seqs):
        out[i, : len(seq)] = seq
    return torch.from_numpy(out).to(device)

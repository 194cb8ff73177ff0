"""The batched sampler: logits processors, penalties, truncation, seeded sampling, logprobs.

One ``Sampler.forward`` turns the logits of the ``B`` rows that sample this step into one token
per row, vectorised across rows (per-row parameters are tensors, not Python loops) and free of
host-device syncs: branches depend on ``SamplingMetadata``'s Python flags only.

Order of operations:

1. Logprobs returned to users are by default those of the model's raw distribution:
   ``log_softmax`` of the logits in float32 before any processing (vLLM's default
   ``--logprobs-mode raw_logprobs``; ``raw_logits`` returns the logits themselves). The
   ``processed_*`` modes return the distribution rows are drawn from instead: after step 2,
   divided by temperature (1 for greedy rows; an all-greedy batch is not divided) and
   truncated by min-p, top-k and top-p (dropped tokens at -inf), as vLLM's.
2. Processing, on float32 logits: allowed_token_ids mask, logit_bias (added), min_tokens (stop
   and EOS ids set to -inf), bad words (the token that would complete one set to -inf; both
   bans are lifted in a row they would leave with no token at all),
   repetition penalty (CTRL, Keskar et al. 2019, arXiv:1909.05858: over prompt and output
   tokens, positive logits divided, negative ones multiplied), frequency and presence
   penalties (OpenAI API reference: over output tokens only,
   ``logit -= frequency * count + presence * (count > 0)``).
3. Greedy rows: argmax of the processed logits.
4. Random rows: subtract the row's maximum and divide by temperature; min-p (drop tokens
   whose probability is below ``min_p`` times the largest; Nguyen et al. 2024,
   arXiv:2407.01082); top-k; top-p (nucleus
   sampling, Holtzman et al. 2019, arXiv:1904.09751: the smallest set of most likely tokens
   whose probability reaches ``top_p``); then one draw per row by the exponential race:
   ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` i.i.d. picks token i with probability p_i,
   because ``E_i / p_i ~ Exp(p_i)`` and the minimum of independent exponentials is the i-th
   with probability ``p_i / sum(p)``; it is the Gumbel-max trick (Gumbel 1954; Maddison et al.
   2014, "A* Sampling") with ``-log E`` as the Gumbel noise, and needs no sync, unlike
   ``torch.multinomial``. It runs in log space, ``argmax(logit_i - log E_i)``: the softmax's
   normalisation does not move the argmax, so no softmax runs.
5. Seeds: a row with ``SamplingParams.seed`` draws its noise from a generator seeded by
   ``step_seed(seed, num_output_tokens)``; other rows share torch's default generator.
6. Logprobs for the rows that asked (see ``LogprobsTensors``).

On CUDA, steps 3-5 are one fused kernel (``kernels/sampling/gumbel.py``; ``SamplingMetadata``'s
``gumbel_seeds`` is then set): the tokens that truncation drops are set to -inf in the
processed logits, and every row, greedy ones included, is drawn by the Gumbel-max trick in
float64, reading the logits in their own dtype when no processor ran. A seeded row keeps its
per-step seed as the kernel's Philox key: its draws do not depend on the batch, but differ
from those of the torch route (CPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.core.engine_io import LogprobsLists
from tokenmill.kernels.sampling import top_p as top_p_select
from tokenmill.kernels.sampling.gumbel import gumbel_argmax
from tokenmill.worker.sampling_metadata import SamplingMetadata

_NEG_INF = float("-inf")


@dataclass
class LogprobsTensors:
    """Logprobs of ``N`` positions (batch rows or prompt positions), still on the device.

    Attributes:
        token_ids: [N, K+1] int64: the chosen token, then the top-K tokens in descending
            probability.
        logprobs: [N, K+1] float32: natural-log probabilities of ``token_ids``.
        ranks: [N] int64: 1-based rank of the chosen token (1 + the number of tokens with a
            strictly larger logprob).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def to_lists(
        self, row_ranges: Sequence[tuple[int, int]], num_logprobs: Sequence[int]
    ) -> list[LogprobsLists]:
        """Copy to the host once and cut into one LogprobsLists per range.

        Args:
            row_ranges: per output, the rows ``[start, end)`` it covers (one row per sampled
                token; the prompt positions of one request for prompt logprobs).
            num_logprobs: per output, how many top logprobs to keep (``-1``: all K); each
                row keeps the chosen token and that many top-K entries.

        Returns:
            One LogprobsLists per range, in order.

        Raises:
            ValueError: the two sequences differ in length.
        """
        if len(row_ranges) != len(num_logprobs):
            raise ValueError(
                f"{len(row_ranges)} row ranges but {len(num_logprobs)} logprob counts."
            )
        width = self.token_ids.shape[1]
        # NOTE: float64 holds int64 token ids and ranks (< 2**53) and float32 logprobs exactly,
        # so one packed tensor means one device->host copy and one sync for the whole batch.
        packed = torch.cat(
            [self.token_ids.double(), self.logprobs.double(), self.ranks.double()[:, None]], dim=1
        ).cpu()
        token_ids = packed[:, :width].long().tolist()
        logprobs = packed[:, width : 2 * width].tolist()
        ranks = packed[:, -1].long().tolist()
        out = []
        for (start, end), n in zip(row_ranges, num_logprobs, strict=True):
            keep = width if n < 0 else n + 1
            out.append(
                LogprobsLists(
                    [ids[:keep] for ids in token_ids[start:end]],
                    [lps[:keep] for lps in logprobs[start:end]],
                    ranks[start:end],
                )
            )
        return out

    def to_lists_per_row(self, num_logprobs: Sequence[int | None]) -> list[LogprobsLists | None]:
        """One single-position LogprobsLists per row; None for rows whose count is None."""
        wanted = [i for i, n in enumerate(num_logprobs) if n is not None]
        lists = self.to_lists([(i, i + 1) for i in wanted], [num_logprobs[i] for i in wanted])
        out: list[LogprobsLists | None] = [None] * len(num_logprobs)
        for i, row_lists in zip(wanted, lists, strict=True):
            out[i] = row_lists
        return out


@dataclass
class SamplerOutput:
    """What the sampler returns for a batch of ``B`` rows.

    Attributes:
        sampled_token_ids: [B] int64, one token per row.
        logprobs: logprobs of the raw distribution with K = ``max_num_logprobs``, or None
            when no row asked for them.
    """

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


class Sampler(torch.nn.Module):
    """Samples one token per row from a batch of logits (see the module docstring).

    Args:
        logprobs_mode: what the returned logprobs hold (``ModelConfig.logprobs_mode``).
    """

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        super().__init__()
        self.logprobs_mode = logprobs_mode
        # One reusable generator per device for seeded rows: reseeding is cheap, creating
        # CUDA generators every step is not.
        self._generators: dict[torch.device, torch.Generator] = {}

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [B, V], any float dtype; not modified.
            metadata: the batch's parameters, built for the same B and V.

        Returns:
            SamplerOutput with [B] int64 tokens and, if asked for, the raw logprobs.
        """
        if metadata.gumbel_seeds is not None:
            return self._forward_gumbel(logits, metadata)
        # Below, in-place steps only touch float32 copies made here, never the caller's
        # tensor: at max_num_seqs rows each [B, V] float32 copy is hundreds of MiB, and the
        # sampler's peak is part of the memory the KV cache must leave free.
        owned = logits.dtype != torch.float32
        logits = logits.float()
        returned = self._raw_values(logits, metadata)
        processed = apply_logits_processors(logits, metadata)
        owned = owned or processed is not logits
        logits = processed
        if returned is None:
            returned = self._processed_values(logits, metadata)
        if metadata.all_greedy:
            sampled = wide_argmax(logits)
        else:
            # Before the random path scales and overwrites ``logits``; dividing by a positive
            # temperature would not change the argmax anyway.
            greedy = wide_argmax(logits) if metadata.greedy_mask is not None else None
            sampled = self._sample_random(logits, metadata, in_place=owned)
            if greedy is not None:
                sampled = torch.where(metadata.greedy_mask, greedy, sampled)
        logprobs = None
        if returned is not None:
            logprobs = gather_logprobs(returned, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)

    def _raw_values(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor | None:
        """[B, V] float32 logprobs (or logits) of a ``raw_*`` mode; None when none are asked
        for or the mode is a ``processed_*`` one. ``logits`` is not modified."""
        if metadata.max_num_logprobs is None or not self.logprobs_mode.startswith("raw"):
            return None
        if self.logprobs_mode == "raw_logits":
            return logits.float().clone()
        return torch.log_softmax(logits.float(), dim=-1)

    def _processed_values(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> torch.Tensor | None:
        """[B, V] float32 logprobs (or logits) of a ``processed_*`` mode from the processed
        logits (not modified): scaled by temperature and truncated unless the batch is all
        greedy; None when none are asked for or the mode is a ``raw_*`` one."""
        if metadata.max_num_logprobs is None or not self.logprobs_mode.startswith("processed"):
            return None
        if metadata.all_greedy:
            values = logits.float().clone()
        else:
            # ``_scaled_truncated`` takes the row's maximum off before dividing (for the
            # Gumbel draw's precision); the logits mode puts it back.
            values = self._scaled_truncated(logits.float(), metadata)
            if self.logprobs_mode == "processed_logits":
                values += wide_amax(logits.float()) / metadata.temperature[:, None]
        if self.logprobs_mode == "processed_logits":
            return values
        return torch.log_softmax(values, dim=-1)

    def _forward_gumbel(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """``forward`` through the fused kernel: processors and truncation (when a row uses
        them) turn tokens into -inf at the logits' own scale, then one draw per row.

        A truncated row is drawn from its unscaled logits with the dropped tokens at -inf,
        so a row that drops nothing gets exactly the draw it would get in a batch without
        truncation: a seeded row's tokens do not depend on the rest of the batch.
        """
        returned = self._raw_values(logits, metadata)
        owned = False  # whether ``logits`` is a tensor of this method's own
        if _has_processors(metadata):
            logits, owned = apply_logits_processors(logits.float(), metadata), True
        if returned is None:
            returned = self._processed_values(logits, metadata)
        if metadata.top_k is not None or metadata.top_p is not None or metadata.min_p is not None:
            copy = logits.dtype != torch.float32  # .float() makes a new tensor: scale it in place
            dropped = torch.isneginf(self._scaled_truncated(logits.float(), metadata, copy))
            logits = (
                logits.masked_fill_(dropped, _NEG_INF)
                if owned
                else logits.masked_fill(dropped, _NEG_INF)
            )
        sampled = gumbel_argmax(logits, metadata.gumbel_temperature, metadata.gumbel_seeds)
        logprobs = None
        if returned is not None:
            logprobs = gather_logprobs(returned, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)

    def _scaled_truncated(
        self, logits: torch.Tensor, metadata: SamplingMetadata, in_place: bool = False
    ) -> torch.Tensor:
        """[B, V] float32 ``(logits - row max) / temperature`` with the tokens min-p, top-k
        and top-p drop at -inf; with ``in_place`` the float32 ``logits`` are overwritten."""
        # The row's maximum comes off first, as in a softmax: at temperature 1e-5, logits
        # near 30 scale to ~3e6, where float32 steps by 0.25 and the Gumbel noise added
        # after would be rounded to that step (ties going to the lower token id).
        peak = wide_amax(logits)
        logits = logits.sub_(peak) if in_place else logits - peak
        logits = logits.div_(metadata.temperature[:, None])
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_p is not None and metadata.top_k is None and _sort_free(logits):
            threshold = top_p_select.top_p_threshold(logits, metadata.top_p)
            logits = logits.masked_fill_(logits < threshold[:, None], _NEG_INF)
        elif metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)
        elif metadata.top_k is not None:
            logits = apply_top_k(logits, metadata.top_k, metadata.max_top_k)
        return logits

    def _sample_random(
        self, logits: torch.Tensor, metadata: SamplingMetadata, in_place: bool = False
    ) -> torch.Tensor:
        """[B] int64 tokens drawn from the truncated, temperature-scaled distribution.

        With ``in_place`` the float32 ``logits`` are scaled and then noised in place.
        """
        logits = self._scaled_truncated(logits, metadata, in_place)
        # ``logits`` is this method's own tensor by now (scaled in place on the caller's
        # float32 copy, or a new one), so the Gumbel noise is added in place.
        noise = self._exponential_noise(torch.empty_like(logits), metadata.seeds)
        return wide_argmax(logits.sub_(noise.log_()))

    def _exponential_noise(self, out: torch.Tensor, seeds: dict[int, int] | None) -> torch.Tensor:
        """Fill ``out`` ([B, V] float32) with Exp(1) noise; seeded rows get their own stream
        (the one Python loop). Returns ``out``.

        On the CPU the noise is ``-log U`` for uniform ``U`` (inverse transform sampling):
        torch's CPU ``exponential_`` is ~7x slower than ``uniform_`` (13.7 vs 2.1 ms for 16
        rows of a 49,152-token vocabulary on two cores). ``U = 0`` (one draw in 2^24) gives
        infinite noise, which only rules that token out of that draw.
        """
        cpu = out.device.type == "cpu"

        def fill(t: torch.Tensor, generator: torch.Generator | None = None) -> None:
            if cpu:
                t.uniform_(generator=generator).log_().neg_()
            else:
                t.exponential_(generator=generator)

        fill(out)
        if seeds:
            generator = self._generator(out.device)
            for row, seed in seeds.items():
                generator.manual_seed(seed)
                fill(out[row], generator)
        # NOTE: some torch versions can return an exact 0 from exponential_, whose log is
        # -inf; the smallest normal float keeps every log E finite (about -87.3).
        return out.clamp_min_(torch.finfo(torch.float32).tiny)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]


# Rows at most this many and this wide take the two-stage argmax on CUDA (see wide_argmax).
WIDE_ARGMAX_MAX_ROWS = 8
WIDE_ARGMAX_MIN_VOCAB = 16384
WIDE_ARGMAX_CHUNKS = 256


def _sort_free(logits: torch.Tensor) -> bool:
    """Whether top-p takes the radix select (``kernels/sampling/top_p.py``) rather than a sort:
    CUDA logits with Triton."""
    return top_p_select.HAS_TRITON and logits.is_cuda


def _row_chunks(x: torch.Tensor, force: bool = False) -> int | None:
    """How many equal chunks the two-stage reductions cut each row of ``x`` ([B, V]) into,
    or None where one-stage torch reductions are used: more than ``WIDE_ARGMAX_MAX_ROWS``
    rows, rows narrower than ``WIDE_ARGMAX_MIN_VOCAB`` or without 16 equal chunks, or a
    device other than CUDA (``force``: any shape with at least 2 chunks, for tests)."""
    rows, vocab = x.shape
    chunks = math.gcd(vocab, WIDE_ARGMAX_CHUNKS)
    wide = rows <= WIDE_ARGMAX_MAX_ROWS and vocab >= WIDE_ARGMAX_MIN_VOCAB and chunks >= 16
    if (force or (wide and x.device.type == "cuda")) and chunks >= 2:
        return chunks
    return None


def wide_amax(x: torch.Tensor) -> torch.Tensor:
    """Each row's maximum, ``[B, 1]``; 0 for a row that is all -inf (subtracting it then
    leaves the row as it is). In two stages for few wide rows on CUDA, as ``wide_argmax``."""
    chunks = _row_chunks(x)
    if chunks is None:
        peak = x.amax(dim=-1, keepdim=True)
    else:
        peak = x.reshape(x.shape[0], chunks, -1).amax(dim=-1).amax(dim=-1, keepdim=True)
    return peak.masked_fill(torch.isneginf(peak), 0.0)


def wide_argmax(x: torch.Tensor, force: bool = False) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for [B, V] float32, in two stages on CUDA for few wide rows.

    torch's row reduction gives a lone 128k-wide row (batch-1 decode) few thread blocks,
    where the maxima of up to 256 chunks, then their argmax, parallelise. Both stages keep
    the first index of a tie, as ``torch.argmax`` does, so the index is the same. Many or
    narrow rows, and other devices unless ``force`` (tests), use ``torch.argmax``.

    Returns:
        [B] int64 indices.
    """
    chunks = _row_chunks(x, force)
    if chunks is None:
        return x.argmax(dim=-1)
    width = x.shape[1] // chunks
    chunk_max, chunk_arg = x.reshape(x.shape[0], chunks, width).max(dim=-1)
    best = chunk_max.argmax(dim=-1, keepdim=True)
    return (best * width + chunk_arg.gather(1, best)).squeeze(1)


def _has_processors(metadata: SamplingMetadata) -> bool:
    """Whether ``apply_logits_processors`` would change anything."""
    return (
        metadata.allowed_token_mask is not None
        or metadata.logit_bias is not None
        or metadata.banned_tokens is not None
        or metadata.repetition_penalties is not None
        or metadata.frequency_penalties is not None
    )


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Masks, logit_bias and penalties (step 2 of the module docstring), out of place.

    Args:
        logits: [B, V] float32.
        metadata: the batch's parameters.

    Returns:
        [B, V] float32 processed logits (``logits`` itself when nothing applies).
    """
    if metadata.allowed_token_mask is not None:
        logits = logits.masked_fill(~metadata.allowed_token_mask, _NEG_INF)
    if metadata.logit_bias is not None:
        rows, tokens, values = metadata.logit_bias
        logits = logits.index_put((rows, tokens), values, accumulate=True)
    if metadata.banned_tokens is not None:
        rows, tokens = metadata.banned_tokens
        # NOTE: a device-side fill; a Python scalar as the value would be a host copy.
        neg_inf = torch.full(rows.shape, _NEG_INF, dtype=logits.dtype, device=logits.device)
        banned = logits.index_put((rows, tokens), neg_inf)
        # A row whose every allowed token is banned (allowed_token_ids that each complete a
        # bad word after this output) keeps its tokens unbanned: a ban that left nothing to
        # sample would yield token 0, outside allowed_token_ids.
        nothing_left = torch.isneginf(banned).all(dim=-1, keepdim=True)
        logits = torch.where(nothing_left, logits, banned)
    if metadata.repetition_penalties is not None:
        logits = apply_repetition_penalty(
            logits,
            metadata.repetition_penalties,
            metadata.prompt_token_ids,
            metadata.output_token_ids,
        )
    if metadata.frequency_penalties is not None:
        logits = apply_frequency_presence_penalties(
            logits,
            metadata.frequency_penalties,
            metadata.presence_penalties,
            metadata.output_token_ids,
        )
    return logits


def apply_repetition_penalty(
    logits: torch.Tensor,
    penalties: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
) -> torch.Tensor:
    """CTRL repetition penalty (Keskar et al. 2019, arXiv:1909.05858).

    Tokens seen in the prompt or output have positive logits divided by the penalty and
    negative ones multiplied by it (both lower the token when the penalty is above 1).

    Args:
        logits: [B, V] float32.
        penalties: [B] float32, 1.0 for rows without the penalty.
        prompt_token_ids: [B, Lp] int64, padded with V.
        output_token_ids: [B, Lo] int64, padded with V.

    Returns:
        [B, V] float32.
    """
    batch, vocab = logits.shape
    seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, prompt_token_ids, True)
    seen.scatter_(1, output_token_ids, True)
    seen = seen[:, :vocab]
    penalty = penalties[:, None]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_frequency_presence_penalties(
    logits: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
    output_token_ids: torch.Tensor,
) -> torch.Tensor:
    """OpenAI frequency and presence penalties over the output tokens.

    ``logit[j] -= frequency * count[j] + presence * (count[j] > 0)`` (OpenAI API reference,
    "Frequency and presence penalties").

    Args:
        logits: [B, V] float32.
        frequency_penalties: [B] float32.
        presence_penalties: [B] float32.
        output_token_ids: [B, Lo] int64, padded with V.

    Returns:
        [B, V] float32.
    """
    batch, vocab = logits.shape
    counts = torch.zeros(batch, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_token_ids, torch.ones_like(output_token_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    return (
        logits
        - frequency_penalties[:, None] * counts
        - presence_penalties[:, None] * (counts > 0).to(logits.dtype)
    )


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's largest.

    Args:
        logits: [B, V] float32 (temperature already applied).
        min_p: [B] float32, 0.0 for rows without min-p.

    Returns:
        [B, V] float32 with dropped tokens at -inf.
    """
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (exactly k, ties broken by ``torch.topk``).

    Args:
        logits: [B, V] float32.
        top_k: [B] int64 in [1, V].
        max_top_k: ``top_k.max()`` as a Python int (no sync).

    Returns:
        [B, V] float32 with the others at -inf.
    """
    _, top_ids = logits.topk(max_top_k, dim=-1)
    in_row_k = torch.arange(max_top_k, device=logits.device)[None, :] < top_k[:, None]
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top_ids, in_row_k)
    return logits.masked_fill(~keep, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Top-k, then nucleus (top-p) truncation (Holtzman et al. 2019), with one sort.

    A token survives top-p when the probability of the tokens ranked above it is below
    ``top_p``: the kept set is the smallest prefix of the sorted tokens whose probability
    reaches ``top_p``, and always holds the most likely token. Top-p sees the distribution
    renormalised over what top-k kept.

    Args:
        logits: [B, V] float32.
        top_k: [B] int64 in [1, V], or None.
        top_p: [B] float32 in (0, 1]; rows at 1.0 keep everything top-k kept.
        max_top_k: ``top_k.max()`` as a Python int; below V, only that many columns are
            sorted (``torch.topk``), much cheaper than sorting the vocabulary.

    Returns:
        [B, V] float32 with the dropped tokens at -inf.
    """
    vocab = logits.shape[1]
    if top_k is not None and max_top_k is not None and max_top_k < vocab:
        sorted_logits, sorted_ids = logits.topk(max_top_k, dim=-1)
    else:
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        position = torch.arange(sorted_logits.shape[1], device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(position >= top_k[:, None], _NEG_INF)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    # NOTE: rounding can push mass_above past 1.0 at the tail; rows at 1.0 must keep all.
    drop = (mass_above >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False  # a top_p that float32 rounds to 0 must still keep the top token
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter_(1, sorted_ids, sorted_logits)


def gather_logprobs(
    logprobs: torch.Tensor, chosen_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """The chosen token's logprob and rank, and the top-K logprobs of each row.

    Args:
        logprobs: [N, V] float32 log-probabilities.
        chosen_token_ids: [N] int64.
        num_logprobs: K >= 0, or -1 for the whole vocabulary.

    Returns:
        LogprobsTensors with [N, K+1] token ids and logprobs, [N] ranks.
    """
    k = logprobs.shape[1] if num_logprobs < 0 else num_logprobs
    chosen = chosen_token_ids[:, None]
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([chosen, top_ids], dim=1),
        logprobs=torch.cat([chosen_logprobs, top_logprobs], dim=1),
        ranks=ranks,
    )


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int
) -> LogprobsTensors:
    """Logprobs of prompt tokens: the raw distribution at each position and its next token.

    Args:
        logits: [N, V], any float dtype: the model's logits at N prompt positions.
        next_token_ids: [N] int64: the prompt token that follows each position.
        k: top logprobs per position (``-1``: the whole vocabulary).

    Returns:
        LogprobsTensors with the next prompt token as the chosen one.
    """
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), next_token_ids, k)

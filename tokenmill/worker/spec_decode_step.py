"""The model runner's side of speculative decoding.

A step that verifies drafts is an ordinary step whose requests compute their last known
token and their drafts (the scheduler counted them in its token budget; the drafts are put
in the batch's token table after the known tokens, so inputs are gathered as usual). The
target's logits at every one of those positions go to the rejection sampler
(``rejection_sampler.py``), which returns the accepted drafts and one token of the target's
own per request; the computed-token counts are taken back by the rejected drafts, whose KV
slots the next step overwrites. Then the proposer drafts each request's next tokens.

Structured-output requests do not speculate: their grammar would have to check each draft,
so the proposer is not asked for theirs (and the scheduler drops any).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from tokenmill.config import EngineConfig
from tokenmill.core.engine_io import LogprobsLists
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.kernels.quant import int4_cpu
from tokenmill.spec_decode.proposer import Proposer, VerifiedStep
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.rejection_sampler import greedy_verify, rejection_sample
from tokenmill.worker.sampler import LogprobsTensors, Sampler, wide_argmax
from tokenmill.worker.sampling_metadata import (
    SamplingMetadata,
    SamplingRow,
    build_plain_sampling_metadata,
    build_sampling_metadata,
)
from tokenmill.worker.step_io import StepInputs


class ModelRunner(Protocol):
    """What this module reads of the model runner (``worker/model_runner.py``)."""

    model: nn.Module | None
    device: torch.device
    sampler: Sampler
    input_batch: InputBatch
    input_ids: Any  # its host array ``.np`` holds the step's input ids
    query_start_loc: Any

    def sample_tokens(
        self,
        inputs: StepInputs,
        hidden: torch.Tensor,
        grammar_bitmasks: Mapping[str, np.ndarray],
    ) -> tuple[list[int], dict[str, LogprobsLists]]: ...

    def _advance_computed(self, inputs: StepInputs) -> None: ...


def create_proposer(config: EngineConfig, device: torch.device) -> Proposer:
    """The proposer of ``config.speculative_config``'s method."""
    spec = config.speculative_config
    assert spec is not None
    if spec.method == "ngram":
        from tokenmill.spec_decode.ngram import NgramProposer

        return NgramProposer(
            spec.num_speculative_tokens,
            spec.prompt_lookup_min,
            spec.prompt_lookup_max,
            config.model_config.max_model_len,
        )
    if spec.method == "draft_model":
        from tokenmill.worker.proposers.draft_model import DraftModelProposer

        return DraftModelProposer(config, device)
    from tokenmill.worker.proposers.eagle import EagleProposer

    return EagleProposer(config, device)


class SpecDecodeStep:
    """Drafts into the batch, the verify step's logits rows, rejection sampling, and the
    next drafts.

    Args:
        config: the engine configuration (with a speculative configuration).
        proposer: drafts the next tokens.
    """

    def __init__(self, config: EngineConfig, proposer: Proposer) -> None:
        self.proposer = proposer
        self.max_model_len = config.model_config.max_model_len
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.vocab_size = config.model_config.vocab_size
        # Per InputBatch row: drafts it verifies in the current step.
        self.num_drafts = np.zeros(config.scheduler_config.max_num_seqs, dtype=np.int64)

    @classmethod
    def create(cls, config: EngineConfig, device: torch.device) -> SpecDecodeStep | None:
        """None without speculative decoding."""
        if config.speculative_config is None:
            return None
        return cls(config, create_proposer(config, device))

    # ---- set-up (delegated to the proposer) -------------------------------------------

    def load_model(self, target: torch.nn.Module) -> None:
        self.proposer.load_model(target)
        layers = self.proposer.aux_hidden_layers()
        if layers:
            keep = getattr(target.model, "keep_aux_hidden_states", None)
            if keep is None:
                raise ValueError(f"{type(target).__name__} cannot serve an EAGLE-3 head")
            keep(layers, self.max_num_tokens)

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of the proposer's own KV in one block (K and V of every layer)."""
        size = torch.tensor([], dtype=dtype).element_size()
        return sum(2 * block_size * h * d * size for h, d in self.proposer.kv_cache_layers())

    def initialize_kv_cache(
        self, num_blocks: int, allocate: Callable[[int, int], torch.Tensor]
    ) -> None:
        """Give the proposer its KV caches, ``allocate(num_kv_heads, head_dim)`` each (the
        model runner's layout over ``num_blocks`` blocks)."""
        layers = self.proposer.kv_cache_layers()
        if layers:
            self.proposer.bind_kv_caches([allocate(h, d) for h, d in layers])

    # ---- one step ---------------------------------------------------------------------

    def write_drafts(self, batch: InputBatch, drafts: dict[str, list[int]]) -> None:
        """Put each request's drafts in its token row after its known tokens (the row's
        ``num_tokens`` stays: they become tokens only once accepted)."""
        self.num_drafts[:] = 0
        for req_id, tokens in drafts.items():
            row = batch.row_of[req_id]
            start = int(batch.num_tokens[row])
            tokens = tokens[: self.max_model_len - start]
            batch.token_ids[row, start : start + len(tokens)] = tokens
            self.num_drafts[row] = len(tokens)

    def logits_indices(self, last: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The step's token indices whose logits are verified: for each sampling request
        (``rows``, InputBatch rows, whose last token is at ``last``), its last known token
        and its drafts, in order.

        Returns:
            ``[sum(drafts + 1)]`` int64.
        """
        counts = self.num_drafts[rows] + 1
        first = last - counts + 1
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(first, counts) + offsets

    @torch.inference_mode()
    def finish_step(
        self,
        runner: ModelRunner,
        bitmasks: Mapping[str, np.ndarray],
        inputs: StepInputs,
        hidden: torch.Tensor,
        prompt_logprobs: dict[str, LogprobsLists],
    ) -> ModelRunnerOutput:
        """Sample (verifying the drafts, if any), record the tokens, take back the
        rejected drafts and propose the next ones."""
        batch = runner.input_batch
        req_ids = inputs.req_ids
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        num_rejected = np.zeros(len(req_ids), dtype=np.int64)
        if inputs.sample_rows:
            rows = inputs.batch_rows[inputs.sample_rows]
            num_drafts = self.num_drafts[rows]
            if num_drafts.any():
                tokens, logprobs = self._verify(runner, bitmasks, inputs, hidden, rows, num_drafts)
            else:
                plain, logprobs = runner.sample_tokens(inputs, hidden, bitmasks)
                tokens = [[t] for t in plain]
            for i, row_tokens, k in zip(inputs.sample_rows, tokens, num_drafts.tolist(),
                                        strict=True):  # fmt: skip
                sampled[i] = row_tokens
                num_rejected[i] = k + 1 - len(row_tokens)
                for token in row_tokens:
                    batch.append_token(req_ids[i], token)
        runner._advance_computed(inputs)
        if num_rejected.any():
            self._take_back(batch, inputs, num_rejected)
        drafts = self.proposer.propose(
            self._verified_step(runner, inputs, hidden, sampled, num_rejected)
        )
        return ModelRunnerOutput(
            req_ids, sampled, logprobs, prompt_logprobs, drafts, inputs.failed_requests
        )

    def _verify(
        self,
        runner: ModelRunner,
        bitmasks: Mapping[str, np.ndarray],
        inputs: StepInputs,
        hidden: torch.Tensor,
        rows: np.ndarray,
        num_drafts: np.ndarray,
    ) -> tuple[list[list[int]], dict[str, LogprobsLists]]:
        """Rejection sampling of the sampling requests' drafts; their tokens (in
        ``inputs.sample_rows`` order) and logprobs by request id."""
        assert runner.model is not None
        batch = runner.input_batch
        with int4_cpu.prompt_rows(inputs.sample_prompt_rows):
            logits = runner.model.compute_logits(hidden[inputs.logits_indices])
        counts = num_drafts.tolist()
        starts = batch.num_tokens[rows].astype(np.int64)
        cols = np.repeat(starts, num_drafts) + (
            np.arange(int(num_drafts.sum())) - np.repeat(np.cumsum(num_drafts) - num_drafts,
                                                         num_drafts)
        )  # fmt: skip
        draft_ids = batch.token_ids[np.repeat(rows, num_drafts), cols].astype(np.int64)
        if batch.simple_sampling[rows].all() and batch.greedy[rows].all():
            # Greedy without processors: the argmax is the whole verdict, one small copy.
            targets = np.asarray(wide_argmax(logits).tolist(), dtype=np.int64)
            return greedy_verify(targets, draft_ids, num_drafts), {}
        metadata = self._metadata(runner, bitmasks, inputs, rows, num_drafts)
        out = rejection_sample(
            logits,
            metadata,
            torch.from_numpy(draft_ids).to(logits.device),
            counts,
            sampler=runner.sampler,
        )
        # One copy to the host: each row's count, then its tokens.
        packed = torch.cat([out.num_tokens[:, None], out.token_ids], dim=1).tolist()
        num_tokens = [row[0] for row in packed]
        tokens = [row[1 : 1 + row[0]] for row in packed]
        logprobs: dict[str, LogprobsLists] = {}
        if out.logprobs is not None:
            logprobs = self._logprobs(batch, inputs, out.logprobs, num_tokens)
        return tokens, logprobs

    def _metadata(
        self,
        runner: ModelRunner,
        bitmasks: Mapping[str, np.ndarray],
        inputs: StepInputs,
        rows: np.ndarray,
        num_drafts: np.ndarray,
    ) -> SamplingMetadata:
        """Sampling parameters of every verified position: a request's row repeated, with
        its drafts before each position counted as output (penalties, bans, seeds)."""
        batch = runner.input_batch
        expanded = np.repeat(rows, num_drafts + 1)
        if batch.simple_sampling[rows].all():
            return build_plain_sampling_metadata(
                batch.greedy[expanded], batch.temperature[expanded], batch.top_k[expanded],
                batch.top_p[expanded], batch.min_p[expanded], self.vocab_size, runner.device,
            )  # fmt: skip
        sampling_rows = []
        for i, k in zip(inputs.sample_rows, num_drafts.tolist(), strict=True):
            state = batch.requests[inputs.req_ids[i]]
            row = batch.row_of[state.req_id]
            start = int(batch.num_tokens[row])
            drafts = batch.token_ids[row, start : start + k].tolist()
            # Only requests without drafts may have a grammar (theirs is never asked for).
            bitmask = bitmasks.get(state.req_id) if k == 0 else None
            for j in range(k + 1):
                output = state.output_token_ids + drafts[:j]
                sampling_rows.append(
                    SamplingRow(state.sampling_params, state.prompt_token_ids, output, bitmask)
                )
        return build_sampling_metadata(sampling_rows, self.vocab_size, runner.device)

    @staticmethod
    def _logprobs(
        batch: InputBatch, inputs: StepInputs, lp: LogprobsTensors, num_tokens: list[int]
    ) -> dict[str, LogprobsLists]:
        """Split the emitted tokens' logprobs (one row per token, request by request) per
        request that asked for them."""
        ranges, wanted, ids = [], [], []
        start = 0
        for i, n in zip(inputs.sample_rows, num_tokens, strict=True):
            req_id = inputs.req_ids[i]
            k = batch.requests[req_id].sampling_params.logprobs
            if k is not None:
                ranges.append((start, start + n))
                wanted.append(k)
                ids.append(req_id)
            start += n
        return dict(zip(ids, lp.to_lists(ranges, wanted), strict=True))

    @staticmethod
    def _take_back(batch: InputBatch, inputs: StepInputs, num_rejected: np.ndarray) -> None:
        """Computed-token counts less the rejected drafts (their KV is to be overwritten)."""
        for req_id, rejected in zip(inputs.req_ids, num_rejected.tolist(), strict=True):
            if rejected:
                state = batch.requests[req_id]
                batch.set_num_computed(req_id, state.num_computed_tokens - rejected)

    def _verified_step(
        self,
        runner: ModelRunner,
        inputs: StepInputs,
        hidden: torch.Tensor,
        sampled: list[list[int]],
        num_rejected: np.ndarray,
    ) -> VerifiedStep:
        batch = runner.input_batch
        got = np.array([bool(s) for s in sampled], dtype=bool)
        wants = np.array(
            [batch.requests[r].sampling_params.structured_outputs is None for r in inputs.req_ids],
            dtype=bool,
        )
        proposer = self.proposer
        aux = None
        if proposer.aux_hidden_layers():
            aux = runner.model.model.aux_hidden_states  # type: ignore[union-attr]
        return VerifiedStep(
            token_ids=batch.token_ids,
            num_tokens=batch.num_tokens,
            block_table=batch.block_table,
            rows=inputs.batch_rows,
            num_computed=inputs.num_computed,
            num_scheduled=inputs.num_scheduled,
            num_rejected=num_rejected,
            sampled=got,
            propose=got & wants,
            input_ids=runner.input_ids.np[: inputs.num_tokens],
            query_start_loc=runner.query_start_loc.np[: len(inputs.req_ids) + 1],
            hidden_states=hidden if proposer.needs_hidden_states else None,
            aux_hidden_states=aux,
        )

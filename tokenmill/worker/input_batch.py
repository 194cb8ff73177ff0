"""The worker's persistent per-request state, kept in numpy rows between steps.

A request gets a row when it is first scheduled and keeps it until it finishes or is
preempted, so a step only writes what changed (new block ids, the sampled token) and batch
preparation is a handful of vectorised numpy gathers instead of per-token Python loops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenmill.core.scheduler_output import NewRequestData
from tokenmill.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the worker knows about one request.

    Attributes:
        req_id: the request id.
        prompt_token_ids: the prompt.
        output_token_ids: tokens generated so far (the worker appends what it samples).
        sampling_params: decoding parameters.
        num_computed_tokens: tokens with KV in the cache before the current step.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Rows of token ids and block tables for up to ``max_num_reqs`` live requests.

    Args:
        max_num_reqs: most requests held at once.
        max_model_len: most tokens per request.
        max_blocks_per_req: block-table width (``ceil(max_model_len / block_size)``).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        # int32 halves the memory of a [max_reqs, max_model_len] table; token ids fit.
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        # Per-row sampling parameters, so a step's SamplingMetadata is a numpy gather.
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.greedy = np.zeros(max_num_reqs, dtype=bool)
        # False for rows that need the general path (penalties, masks, seeds, logprobs).
        self.simple_sampling = np.zeros(max_num_reqs, dtype=bool)
        # Async scheduling: index of the row's last sampled token in the previous step's
        # device tensor while its host copy is not yet known (-1: none pending).
        self.pending_idx = np.full(max_num_reqs, -1, dtype=np.int64)
        # The row's LoRA adapter id (0: none).
        self.lora_id = np.zeros(max_num_reqs, dtype=np.int64)
        self.requests: dict[str, CachedRequestState] = {}
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, new: NewRequestData) -> None:
        """Take a new (or resumed) request into a free row.

        Raises:
            RuntimeError: no free row (the scheduler exceeded ``max_num_seqs``).
        """
        if new.req_id in self.row_of:
            self.remove(new.req_id)
        if not self._free_rows:
            raise RuntimeError(f"no free batch row for request {new.req_id!r}")
        row = self._free_rows.pop()
        state = CachedRequestState(
            new.req_id,
            list(new.prompt_token_ids),
            new.sampling_params,
            list(new.output_token_ids),
            new.num_computed_tokens,
        )
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.num_blocks[row] = 0
        self.lora_id[row] = new.lora_request.lora_int_id if new.lora_request else 0
        self.requests[new.req_id] = state
        self.row_of[new.req_id] = row
        self._set_sampling(row, new.sampling_params)
        self.append_blocks(new.req_id, new.block_ids)

    def _set_sampling(self, row: int, p: SamplingParams) -> None:
        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.greedy[row] = p.sampling_type_greedy
        self.simple_sampling[row] = not p.uses_full_sampler
        self.pending_idx[row] = -1

    def remove(self, req_id: str) -> None:
        """Drop a finished or preempted request (unknown ids are ignored)."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        del self.requests[req_id]
        self._free_rows.append(row)

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = self.row_of[req_id]
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def set_num_computed(self, req_id: str, num_computed_tokens: int) -> None:
        self.requests[req_id].num_computed_tokens = num_computed_tokens
        self.num_computed_tokens[self.row_of[req_id]] = num_computed_tokens

    def set_tokens(self, req_id: str, start: int, token_ids: list[int]) -> None:
        """Make ``token_ids`` the request's tokens from position ``start`` on (tokens the
        scheduler chose, replacing what this worker sampled there); ``start`` is at least
        the prompt's length."""
        state = self.requests[req_id]
        num_prompt = len(state.prompt_token_ids)
        state.output_token_ids[start - num_prompt :] = token_ids
        row = self.row_of[req_id]
        end = min(start + len(token_ids), self.max_model_len)
        self.token_ids[row, start:end] = token_ids[: end - start]
        self.num_tokens[row] = end

    def set_output_tokens(self, req_id: str, token_ids: list[int]) -> None:
        """Record tokens sampled elsewhere (a pipeline stage before the last), which
        continue the request from position ``max(num_computed_tokens, prompt length)``."""
        state = self.requests[req_id]
        row = self.row_of[req_id]
        start = max(state.num_computed_tokens, len(state.prompt_token_ids))
        end = min(start + len(token_ids), self.max_model_len)
        self.token_ids[row, start:end] = token_ids[: end - start]
        self.num_tokens[row] = max(int(self.num_tokens[row]), end)

    def append_token(self, req_id: str, token_id: int) -> None:
        """Record a sampled token (it is the next step's input for this request)."""
        state = self.requests[req_id]
        state.output_token_ids.append(token_id)
        row = self.row_of[req_id]
        n = int(self.num_tokens[row])
        if n < self.max_model_len:
            self.token_ids[row, n] = token_id
            self.num_tokens[row] = n + 1

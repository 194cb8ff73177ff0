"""Whole-step graphs of mixed batches: how a step is padded to a captured size (the capture
and replay run in tests/gpu/test_engine_gpu.py; the kernels' uniform grids on such batches
in tests/model/test_triton_attention.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenmill.worker.mixed_graph import MixedCUDAGraphRunner
from tokenmill.worker.model_runner import ModelRunner


def _runner(max_num_reqs: int, max_num_tokens: int = 256) -> SimpleNamespace:
    buf = lambda n, fill=7: SimpleNamespace(device=torch.full((n,), fill))  # noqa: E731
    runner = SimpleNamespace(
        max_num_reqs=max_num_reqs,
        max_num_tokens=max_num_tokens,
        max_model_len=4096,
        input_ids=buf(max_num_tokens),
        positions=buf(max_num_tokens),
        slot_mapping=buf(max_num_tokens),
        query_start_loc=SimpleNamespace(device=torch.zeros(max_num_reqs + 1, dtype=torch.int32)),
        seq_lens=SimpleNamespace(device=torch.full((max_num_reqs,), 9, dtype=torch.int32)),
        block_table=SimpleNamespace(device=torch.zeros(max_num_reqs, 4, dtype=torch.int32)),
        prefill_range=SimpleNamespace(device=torch.tensor([2, 1], dtype=torch.int32)),
    )
    runner.pad_token_inputs = lambda n, padded: ModelRunner.pad_token_inputs(runner, n, padded)
    runner.buffer_metadata = lambda *args, **fields: ModelRunner.buffer_metadata(
        runner, *args, **fields
    )
    return runner


def test_a_step_pads_with_one_token_requests_then_empty_ones():
    runner = _runner(max_num_reqs=64)
    graphs = MixedCUDAGraphRunner(runner)  # type: ignore[arg-type]
    # 3 requests, 29 tokens: 1 + 1 + 27; the graph of 32 tokens has 32 request rows.
    runner.query_start_loc.device[:4] = torch.tensor([0, 1, 2, 29])
    md = graphs.pad_batch(29, 3, 32)
    assert md.prefill_range is runner.prefill_range.device  # as the runner staged it
    assert md.uniform_grids and md.num_actual_tokens == 32 and md.num_reqs == 32
    qsl = md.query_start_loc.tolist()
    assert qsl[:4] == [0, 1, 2, 29]
    assert qsl[4:7] == [30, 31, 32]  # the three padding tokens, one request each
    assert qsl[7:] == [32] * 26  # then requests without tokens
    assert md.seq_lens[3:].eq(0).all() and md.seq_lens[:3].eq(9).all()
    assert md.slot_mapping[29:].eq(-1).all() and md.slot_mapping[:29].eq(7).all()
    assert md.max_seq_len == runner.max_model_len


def test_request_rows_stop_at_the_request_budget():
    graphs = MixedCUDAGraphRunner(_runner(max_num_reqs=16))  # type: ignore[arg-type]
    assert graphs.request_rows(8) == 8 and graphs.request_rows(256) == 16
    md = graphs.pad_batch(40, 16, 64)  # every request row is real: nothing to pad
    assert md.num_reqs == 16 and md.query_start_loc.shape == (17,)

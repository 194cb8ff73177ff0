"""The model proposers' passes over persistent buffers (``worker/proposers/draft_passes.py``): the
host side of the single-token passes, the graphs' batch buckets, and a step that uploads
nothing one array at a time and reads the device once (the draft table), not once per
pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from tokenmill import LLM, SamplingParams
from tokenmill.worker.proposers.draft_passes import (
    MAX_GRAPH_BATCH,
    DraftBuffers,
    DraftGraphs,
    first_pass_table_width,
    single_token_seq_lens,
)
from tokenmill.worker.step_graphs import StepGraphs

# Tensor methods that bring device values to the host.
HOST_READS = {"tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}


def test_single_token_context_lengths_clamp_and_pad():
    first = np.array([5, 9, -1, 14], dtype=np.int64)
    assert single_token_seq_lens(first, 0, 16).tolist() == [6, 10, 0, 15]
    # Past max_model_len the position stays at its last: the draft is never used.
    assert single_token_seq_lens(first, 2, 16).tolist() == [8, 12, 0, 16]
    assert single_token_seq_lens(first, 2, 16).dtype == np.int32


def test_the_table_covers_the_single_token_passes():
    seq_lens = np.array([17, 3], dtype=np.int32)
    # Context 17 needs 2 blocks of 16; a request drafting at 31..33 needs 3.
    assert first_pass_table_width(seq_lens, np.array([31]), 3, 16, 10) == 3
    assert first_pass_table_width(seq_lens, np.array([5]), 3, 16, 10) == 2
    assert first_pass_table_width(seq_lens, np.array([], dtype=np.int64), 3, 16, 10) == 2
    assert first_pass_table_width(seq_lens, np.array([400]), 3, 16, 10) == 10  # table width


def test_graph_buckets_pad_to_the_next_captured_size():
    buffers = DraftBuffers(64, 300, 4, 64, 4, torch.device("cpu"))
    graphs = DraftGraphs(buffers)
    assert graphs.sizes[:4] == [1, 2, 4, 8] and graphs.sizes[-1] == MAX_GRAPH_BATCH
    assert [graphs.padded_size(b) for b in (1, 3, 5, 17, 256)] == [1, 4, 8, 32, 256]
    with pytest.raises(ValueError):
        graphs.padded_size(MAX_GRAPH_BATCH + 1)
    assert not graphs.can_run(1)  # nothing captured: the passes run eagerly
    small = DraftGraphs(DraftBuffers(64, 6, 4, 64, 4, torch.device("cpu")))
    assert small.sizes == [1, 2, 4]


def test_the_runner_captures_the_proposers_graphs_last_in_its_pool():
    graphs = StepGraphs(pool=(1, 2))
    seen = []
    sentinel = DraftGraphs(DraftBuffers(8, 2, 2, 32, 2, torch.device("cpu")))
    graphs.add_proposer(lambda pool: seen.append(pool) or sentinel)
    assert seen == [(1, 2)] and graphs.sets == [sentinel]


class _HostReads(TorchFunctionMode):
    """Records host reads of tensor values and one-off uploads (``.to(device)``,
    ``torch.tensor``: on CUDA a copy from pageable memory waits for the stream) made by the
    proposer's own code (the CPU attention backend reads host copies of its metadata by
    design)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import sys

        name = getattr(func, "__name__", "")
        caller = sys._getframe(1).f_code.co_filename
        if "proposers" in caller:
            kwargs_ = kwargs or {}
            to_device = name == "to" and (
                "device" in kwargs_ or any(isinstance(a, (str, torch.device)) for a in args[1:])
            )
            if name in HOST_READS or to_device or name in ("tensor", "as_tensor"):
                self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_a_step_reads_the_device_once(method, request, tiny_target, smollm2_gguf_path, tmp_path):
    from tests.spec_decode.conftest import save_llama

    path = (save_llama(tmp_path / "draft", seed=5) if method == "draft_model"
            else request.getfixturevalue("eagle_head"))  # fmt: skip
    spec = {"method": method, "model": path, "num_speculative_tokens": 4}
    llm = LLM(tiny_target, tokenizer=smollm2_gguf_path, speculative_config=spec,
              max_model_len=256, kv_cache_memory=16 << 20)  # fmt: skip
    proposer = llm.llm_engine.engine_core.executor.worker.model_runner.spec_decode.proposer
    calls, propose = [], proposer.propose

    def counted(step):
        with _HostReads() as mode:
            drafts = propose(step)
        calls.append((int(step.propose.sum()), mode.reads))
        return drafts

    proposer.propose = counted
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(5, 40))}] * 2, params, use_tqdm=False)
    assert calls and any(n for n, _ in calls)
    for n, reads in calls:
        assert reads == (["tolist"] if n else []), reads

"""ModelRunner set-up: the profiling pass leaves no scratch KV cache behind; when cascade
attention is on."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine_args import EngineArgs
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.layers.attention import Attention
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.start_up_passes import profile_run


def _runner(tmp_path, sliding_window: int | None = None, **engine_kwargs) -> ModelRunner:
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    shape = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=256,
    )  # fmt: skip
    if sliding_window:
        config = MistralConfig(sliding_window=sliding_window, **shape)
    else:
        config = LlamaConfig(**shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    engine = EngineArgs(
        model=str(tmp_path), max_num_batched_tokens=512, max_num_seqs=4, **engine_kwargs
    ).create_engine_config()
    runner = ModelRunner(engine, torch.device("cpu"))
    runner.load_model()
    return runner


def test_profile_run_releases_its_scratch_cache(tmp_path):
    runner = _runner(tmp_path)
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    assert profile_run(runner) == 0  # no peak accounting off CUDA
    assert all(layer.kv_cache is None for layer in layers)
    assert runner.kv_caches == []

    runner.initialize_kv_cache(8)
    caches = list(runner.kv_caches)
    profile_run(runner)
    assert [layer.kv_cache for layer in layers] == caches
    assert runner.model_weight_bytes() > 0


@pytest.mark.parametrize(
    "kwargs,expected",
    [({}, True), ({"disable_cascade_attn": True}, False), ({"sliding_window": 64}, False)],
)
def test_cascade_attention_needs_backend_flag_and_a_full_attention_layer(
    tmp_path, monkeypatch, kwargs, expected
):
    monkeypatch.setattr(TorchAttentionBackend, "supports_cascade", True)
    assert _runner(tmp_path, **kwargs).cascade_attn is expected
    monkeypatch.setattr(TorchAttentionBackend, "supports_cascade", False)
    assert _runner(tmp_path / "plain").cascade_attn is False


class _WholeStepGraphs:
    """Stands in for captured whole-step graphs (decode or mixed): runs any size."""

    def __init__(self, name: str) -> None:
        self.name = name

    def can_run(self, n: int) -> bool:
        return True

    def run(self, *args) -> str:
        return self.name


@pytest.mark.parametrize("max_query_len", [1, 3])
def test_steps_that_read_kv_written_in_the_step_skip_whole_step_graphs(
    tmp_path, monkeypatch, max_query_len
):
    """The captured decode and mixed graphs hold decode kernels that read earlier tokens'
    KV before the step's KV writes finish; a step flagged ``reads_step_kv`` runs outside
    them, with its own metadata (so its kernels wait first)."""
    import dataclasses

    import numpy as np

    from tokenmill.worker.step_graphs import StepGraphs
    from tokenmill.worker.step_io import StepInputs

    runner = _runner(tmp_path)
    runner.graphs = StepGraphs(
        _WholeStepGraphs("decode graph"), _WholeStepGraphs("mixed graph"), None, 8
    )
    runner.model = lambda ids, positions, metadata: ("eager", metadata.reads_step_kv)
    metadata = dataclasses.replace(
        runner.decode_metadata(2), max_query_len=max_query_len, num_decodes=1
    )

    def run(reads_step_kv: bool):
        md = dataclasses.replace(metadata, reads_step_kv=reads_step_kv)
        none = np.zeros(2, dtype=np.int64)
        return runner._run_model(StepInputs(["a", "b"], 2, md, [], None, none, none, none))

    assert run(False) == ("decode graph" if max_query_len == 1 else "mixed graph")
    assert run(True) == ("eager", True)
    # the step log's count of steps by path
    assert runner.graphs.paths == {"decode" if max_query_len == 1 else "mixed": 1, "eager": 1}


def test_padding_rows_of_a_decode_batch_report_no_context(tmp_path):
    runner = _runner(tmp_path)
    runner.seq_lens.np[:4] = [50, 60, 70, 80]  # left over from an earlier, larger step
    metadata = runner.pad_decode_batch(1, 4)
    assert metadata.seq_lens_cpu.tolist() == [50, 0, 0, 0]
    assert runner.seq_lens.device[1:4].eq(0).all()

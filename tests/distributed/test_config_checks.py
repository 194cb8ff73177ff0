"""Parallel layouts are checked at start-up, each error in one line before anything loads."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from tokenmill.config import ConfigError
from tokenmill.distributed.config_checks import check_ray_address
from tokenmill.distributed.parallel_state import pipeline_stage_layers
from tokenmill.engine_args import EngineArgs

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 128,
}
MOE = {
    **CONFIG,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "num_attention_heads": 4,
    "num_local_experts": 3,
    "num_experts_per_tok": 2,
    "intermediate_size": 90,
}


NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


def _folder(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _config(path, **kwargs):
    return EngineArgs(model=path, device="cpu", load_format="dummy", **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tensor_parallel_size": 4}, r"attention heads \(6\) must be divisible by tensor "
                                      r"parallel size \(4\)"),
        ({"tensor_parallel_size": 3}, r"KV heads \(2\) and tensor parallel size \(3\)"),
        ({"pipeline_parallel_size": 4}, r"pipeline parallel size \(4\) is larger than the "
                                        r"number of layers \(3\)"),
        ({"tensor_parallel_size": 0}, "--tensor-parallel-size must be at least 1"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
         "uni runs one rank"),
        ({"data_parallel_size": 2}, "offline, run one LLM per replica"),
        ({"pipeline_parallel_size": 3, "async_scheduling": True},
         "--async-scheduling does not apply with pipeline parallelism"),
    ],
)
def test_layout_errors(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        _config(_folder(tmp_path, CONFIG), **kwargs).create_engine_config()


def test_experts_that_do_not_split(tmp_path):
    path = _folder(tmp_path, MOE)
    with pytest.raises(ConfigError, match=r"experts' intermediate size \(90\) is not divisible "
                                          r"by tensor parallel size \(4\); --enable-expert"):
        _config(path, tensor_parallel_size=4).create_engine_config()
    with pytest.raises(ConfigError, match="3 experts cannot be spread over 4"):
        _config(path, tensor_parallel_size=4, enable_expert_parallel=True).create_engine_config()
    with pytest.raises(ConfigError, match="with --data-parallel-size > 1 is not implemented"):
        _config(
            path, tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True
        ).create_engine_config("server")
    # Whole experts need no division of their width; 3 experts spread 2 + 1.
    cfg = _config(path, tensor_parallel_size=2, enable_expert_parallel=True)
    pc = cfg.create_engine_config().parallel_config
    assert (pc.world_size, pc.enable_expert_parallel, pc.distributed_executor_backend) == (
        2, True, "mp",
    )


def test_defaults_resolve_the_executor(tmp_path):
    path = _folder(tmp_path, CONFIG)
    single = _config(path).create_engine_config()
    assert single.parallel_config.distributed_executor_backend == "uni"
    layout = _config(path, tensor_parallel_size=2, pipeline_parallel_size=3)
    cfg = layout.create_engine_config("server")
    assert cfg.parallel_config.distributed_executor_backend == "mp"
    assert cfg.parallel_config.world_size == 6
    assert cfg.scheduler_config.async_scheduling is False
    dp = _config(path, data_parallel_size=2).create_engine_config("server")
    assert dp.parallel_config.data_parallel_size == 2


def test_lora_with_every_layout(tmp_path):
    """LoRA adapters run under tensor and pipeline parallelism and in each data-parallel
    engine; ``--fully-sharded-loras`` splits each slot's ranks over the tensor-parallel
    ranks (a no-op on one)."""
    path = _folder(tmp_path, CONFIG)
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 3},
                   {"tensor_parallel_size": 2, "pipeline_parallel_size": 3},
                   {"data_parallel_size": 2}):
        cfg = _config(path, enable_lora=True, **layout).create_engine_config("server")
        assert cfg.lora_config is not None and not cfg.lora_config.fully_sharded_loras
    for tp in (1, 2):
        cfg = _config(path, enable_lora=True, fully_sharded_loras=True, max_lora_rank=8,
                      tensor_parallel_size=tp).create_engine_config()
        assert cfg.lora_config.fully_sharded_loras


def test_more_ranks_than_gpus(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = EngineArgs(model=_folder(tmp_path, CONFIG), device="cuda", tensor_parallel_size=2,
                      pipeline_parallel_size=3)
    with pytest.raises(ConfigError, match=r"needs 6 GPUs .* more than the 2 of this node"):
        args.create_engine_config()


def test_ray_address_that_does_not_answer(tmp_path, monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    args = _config(_folder(tmp_path, CONFIG), tensor_parallel_size=2,
                   distributed_executor_backend="ray")
    with pytest.raises(ConfigError, match=f"Ray cluster at RAY_ADDRESS 127.0.0.1:{port} does "
                                          "not answer"):
        args.create_engine_config()
    with pytest.raises(ConfigError, match="is not host:port"):
        check_ray_address("nohost")
    check_ray_address("auto")  # left to Ray


def test_embedding_models_run_on_one_device(tmp_path):
    config = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 32,
              "num_attention_heads": 2, "num_hidden_layers": 2, "vocab_size": 100,
              "max_position_embeddings": 64, "intermediate_size": 64}
    with pytest.raises(ConfigError, match="embedding models run on one device"):
        _config(_folder(tmp_path, config), tensor_parallel_size=2).create_engine_config()


def test_stage_layers_split_as_vllm():
    assert [pipeline_stage_layers(30, r, 4) for r in range(4)] == [
        (0, 7), (7, 15), (15, 23), (23, 30),
    ]
    assert [pipeline_stage_layers(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    with pytest.raises(ValueError, match="cannot be split"):
        pipeline_stage_layers(2, 0, 3)


def test_quantized_weights_that_do_not_split(tmp_path, smollm2_gguf_path):
    with pytest.raises(ConfigError, match="GGUF weights kept quantized do not split over 3 "
                                          "tensor-parallel ranks: add --gguf-dequantize"):
        EngineArgs(model=smollm2_gguf_path, device="cpu", tensor_parallel_size=3) \
            .create_engine_config()
    dequantized = EngineArgs(model=smollm2_gguf_path, device="cpu", tensor_parallel_size=3,
                             gguf_dequantize=True).create_engine_config()
    assert dequantized.model_config.quantization is None
    # Kept quantized, the blocks split over pipeline stages.
    EngineArgs(model=smollm2_gguf_path, device="cpu", pipeline_parallel_size=2) \
        .create_engine_config()
    awq = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
           "version": "gemm"}
    path = _folder(tmp_path, {**MOE, "quantization_config": awq})
    with pytest.raises(ConfigError, match=r"quantized experts \(awq\) do not split over 2"):
        _config(path, tensor_parallel_size=2, enable_expert_parallel=True).create_engine_config()


def test_vllm_multi_gpu_flags(tmp_path, capsys):
    """``--disable-custom-all-reduce`` means what tokenmill does anyway (NCCL all-reduces);
    vLLM's multi-node flags without Ray are refused in one line."""
    from tests.entrypoints.test_cli import run_main

    _config(_folder(tmp_path, CONFIG), tensor_parallel_size=2,
            disable_custom_all_reduce=True).create_engine_config()
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--disable-custom-all-reduce"]).disable_custom_all_reduce
    code, _, err = run_main(capsys, ["serve", "-tp", "2", "--nnodes", "2"])
    assert code == 2 and "does not implement --nnodes" in err


MLA = {
    **CONFIG,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
}


@pytest.mark.parametrize(
    "config, kwargs, message",
    [
        (MLA, {"tensor_parallel_size": 2},
         r"DeepseekV3ForCausalLM \(multi-head latent attention\) does not split"),
        ({**CONFIG, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"},
         {"pipeline_parallel_size": 2}, "GptOssForCausalLM .* does not split"),
        (CONFIG, {"pipeline_parallel_size": 2, "kv_offloading_size": 1.0},
         "--kv-offloading-size is not implemented with pipeline parallelism"),
        (CONFIG, {"tensor_parallel_size": 2, "speculative_config": NGRAM},
         "--speculative-config is not implemented with parallelism"),
        (CONFIG, {"tensor_parallel_size": 2, "enable_lora": True, "fully_sharded_loras": True,
                  "max_lora_rank": 1},
         r"--fully-sharded-loras: --max-lora-rank \(1\) must be divisible by "
         r"--tensor-parallel-size \(2\); e.g. 8"),
        (CONFIG, {"tensor_parallel_size": 2, "kv_cache_dtype": "fp8"},
         "--kv-cache-dtype fp8 is not implemented with parallelism"),
        (CONFIG, {"tensor_parallel_size": 2, "quantization": "fp8"},
         r"FP8 weights \(fp8\) are not implemented with tensor or pipeline parallelism"),
        (MLA, {"speculative_config": NGRAM}, "--speculative-config is not implemented for MLA"),
        (MLA, {"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8 is not implemented for MLA"),
        (MLA, {"quantization": "fp8"}, "--quantization fp8 is not implemented for MLA"),
        (CONFIG, {"speculative_config": NGRAM, "enable_sleep_mode": True},
         "--speculative-config does not combine with --enable-sleep-mode"),
        (CONFIG, {"speculative_config": NGRAM, "kv_offloading_size": 1.0},
         "--speculative-config does not combine with --kv-offloading-size"),
        (CONFIG, {"enable_lora": True, "enable_sleep_mode": True},
         "--enable-lora does not combine with --enable-sleep-mode"),
    ],
)  # fmt: skip
def test_combinations_refused_at_start_up(tmp_path, config, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        _config(_folder(tmp_path, config), **kwargs).create_engine_config()

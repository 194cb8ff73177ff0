"""``--speculative-config``: vLLM's JSON fields and defaults, and one-line errors for what
cannot work."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.entrypoints.conftest import SERVE_COMMAND
from tokenmill.config import ConfigError, SpeculativeConfig, UnsupportedQuantizationError
from tokenmill.engine_args import EngineArgs
from tokenmill.entrypoints.cli.main import build_parser


def _config(model: str, spec, **kwargs):
    args = EngineArgs(model=model, load_format="dummy", speculative_config=spec, **kwargs)
    return args.create_engine_config()


@pytest.mark.parametrize(
    "spec, expected",
    [
        ({"method": "ngram", "num_speculative_tokens": 4}, (5, 5)),
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, (3, 3)),
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}, (2, 2)),
        ({"model": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
          "prompt_lookup_max": 4}, (1, 4)),  # fmt: skip
        ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}', (2, 2)),
    ],
)
def test_ngram_fields_and_vllms_defaults(tiny_model_dir, spec, expected):
    config = _config(tiny_model_dir, spec).speculative_config
    assert isinstance(config, SpeculativeConfig) and config.method == "ngram"
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == expected
    assert config.num_lookahead_tokens == 0 and not config.uses_draft_kv_cache


def test_a_draft_model_shares_the_vocabulary_and_gets_lookahead(tiny_model_dir, tmp_path):
    config = _config(tiny_model_dir, {"model": tiny_model_dir, "num_speculative_tokens": 3})
    spec = config.speculative_config
    assert spec is not None and spec.method == "draft_model"
    assert spec.draft_model_config is not None
    assert spec.draft_model_config.dtype == config.model_config.dtype
    assert spec.num_lookahead_tokens == 3
    other = tmp_path / "other-vocab"
    other.mkdir()
    source = json.loads(open(f"{tiny_model_dir}/config.json").read())
    (other / "config.json").write_text(json.dumps({**source, "vocab_size": 1000}))
    with pytest.raises(ConfigError, match="must share the target's tokenizer"):
        _config(tiny_model_dir, {"model": str(other), "num_speculative_tokens": 3})


def test_method_is_inferred_from_the_model_path_as_vllm_does(tiny_model_dir, tmp_path):
    source = json.loads(open(f"{tiny_model_dir}/config.json").read())
    for name, method in (("EAGLE-tiny", "eagle"), ("tiny-eagle3", "eagle3")):
        head = tmp_path / name
        head.mkdir()
        (head / "config.json").write_text(json.dumps({**source, "num_hidden_layers": 1}))
        spec = _config(tiny_model_dir, {"model": str(head), "num_speculative_tokens": 2})
        assert spec.speculative_config is not None
        assert spec.speculative_config.method == method


def test_eagle_heads_must_match_the_targets_hidden_size(tiny_model_dir, tmp_path):
    source = json.loads(open(f"{tiny_model_dir}/config.json").read())
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({**source, "hidden_size": 32}))
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="hidden size 32"):
        _config(tiny_model_dir, spec)
    spec["method"] = "eagle3"
    with pytest.raises(ConfigError, match="reads hidden states of size 32"):
        _config(tiny_model_dir, spec)
    (head / "config.json").write_text(json.dumps({**source, "draft_vocab_size": 10**6}))
    with pytest.raises(ConfigError, match="drafts over 1000000 tokens, more than"):
        _config(tiny_model_dir, spec)


def test_a_quantized_eagle_head_is_refused(tiny_model_dir, tmp_path):
    source = json.loads(open(f"{tiny_model_dir}/config.json").read())
    head = tmp_path / "EAGLE-awq"
    head.mkdir()
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
           "version": "gemm"}  # fmt: skip
    (head / "config.json").write_text(json.dumps({**source, "quantization_config": awq}))
    with pytest.raises(ConfigError, match="is quantized \\(awq\\); heads load unquantized"):
        _config(tiny_model_dir, {"model": str(head), "num_speculative_tokens": 2})


def test_mtp_is_refused_for_a_model_without_mtp_layers(tiny_model_dir):
    with pytest.raises(ConfigError, match="method mtp needs a model that ships MTP layers"):
        _config(tiny_model_dir, {"method": "mtp", "num_speculative_tokens": 1})


def test_speculation_plans_each_step_after_the_last(tiny_model_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    assert not _config(tiny_model_dir, spec).scheduler_config.async_scheduling
    with pytest.raises(ConfigError, match="--async-scheduling does not combine"):
        _config(tiny_model_dir, spec, async_scheduling=True)


def test_lora_adapters_are_refused_beside_speculation(tiny_model_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="does not combine with --enable-lora"):
        _config(tiny_model_dir, spec, enable_lora=True)


@pytest.mark.slow
def test_a_draft_keeps_its_checkpoints_quantization(smollm2_gguf_path):
    spec = {"model": smollm2_gguf_path, "num_speculative_tokens": 2}

    def draft_quantization(**kwargs):
        args = EngineArgs(model=smollm2_gguf_path, device="cpu", speculative_config=spec,
                          **kwargs)  # fmt: skip
        config = args.create_engine_config().speculative_config
        assert config is not None and config.draft_model_config is not None
        return config.draft_model_config.quantization

    # A GGUF draft keeps its blocks as the target does, and is dequantized beside a
    # dequantized target.
    assert draft_quantization() == "gguf"
    assert draft_quantization(gguf_dequantize=True) is None
    spec = {**spec, "quantization": "awq"}
    # As for the target, an unsupported quantization is its own error (the CLI exits 2).
    with pytest.raises(UnsupportedQuantizationError, match="the draft .*the model is a GGUF file"
                       ) as info:  # fmt: skip
        draft_quantization()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("{", "--speculative-config is not valid JSON"),
        ("[1]", "must be a JSON object"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "must be a positive integer"),
        ({"method": "ngram", "num_speculative_tokens": True}, "must be a positive integer"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "is more than 32"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be <="),  # fmt: skip
        ({"method": "ngram", "num_speculative_tokens": 2, "speculative_tokens": 3},
         "unknown or unimplemented field 'speculative_tokens'"),  # fmt: skip
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
         "draft_tensor_parallel_size must be 1"),  # fmt: skip
        ({"model": "x", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"},
         "does not implement draft_sample_method='probabilistic'"),  # fmt: skip
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "awq"},
         "quantization applies to a draft model, not ngram"),  # fmt: skip
    ],
)
def test_bad_fields_are_refused_in_one_line(tiny_model_dir, spec, words):
    with pytest.raises(ConfigError, match=words) as info:
        _config(tiny_model_dir, spec)
    assert "\n" not in str(info.value)


def test_the_flag_reaches_the_engine_and_serve_fails_in_one_line(tiny_model_dir):
    flag = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    args = build_parser().parse_args(["serve", "--speculative-config", flag])
    assert args.speculative_config == flag
    result = subprocess.run(
        [*SERVE_COMMAND, tiny_model_dir, "--load-format", "dummy", "--port", "0",
         "--speculative-config", '{"method": "ngram"}'],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "num_speculative_tokens is required" in lines[0], result.stderr


def test_a_missing_draft_model_is_named_as_the_draft(tiny_model_dir, tmp_path):
    from tokenmill.hf_config import ModelLoadError

    spec = {"model": str(tmp_path / "nonexistent"), "num_speculative_tokens": 2}
    with pytest.raises(ModelLoadError, match=r"^--speculative-config: the draft model: model path"):
        _config(tiny_model_dir, spec)

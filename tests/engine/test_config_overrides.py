"""vLLM's configuration flags ``--override-generation-config``, ``--hf-overrides``,
``--tokenizer-mode``, ``--num-gpu-blocks-override``, ``--disable-sliding-window`` and
``--logprobs-mode``: what they change in the engine, and their errors in one line."""

from __future__ import annotations

import json

import pytest

from tokenmill.config import ConfigError
from tokenmill.engine_args import EngineArgs
from tokenmill.hf_config import ModelLoadError


@pytest.fixture
def model_dir(tmp_path, smollm2_tokenizer):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
              "max_position_embeddings": 2048, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-5, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6,
                                                                 "top_p": 0.9}))
    smollm2_tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


def _config(model_dir, **kwargs):
    return EngineArgs(model=model_dir, load_format="dummy", **kwargs).create_engine_config()


def test_generation_overrides_merge_over_the_models_defaults(model_dir):
    cfg = _config(model_dir, override_generation_config='{"temperature": 0.2, "top_k": 5}')
    assert cfg.model_config.generation_config == {"temperature": 0.2, "top_p": 0.9, "top_k": 5}
    alone = _config(model_dir, generation_config="vllm",
                    override_generation_config={"max_new_tokens": 9})
    assert alone.model_config.generation_config == {"max_new_tokens": 9}


@pytest.mark.parametrize("value, words", [
    ('{"seed": 1}', "unknown field(s) ['seed']"),
    ('{"top_p": 2}', "top_p"),
    ("[1]", "must be a JSON object"),
    ("{", "not valid JSON"),
])
def test_generation_overrides_refused(model_dir, value, words):
    with pytest.raises(ConfigError, match="--override-generation-config") as e:
        _config(model_dir, override_generation_config=value)
    assert words in str(e.value)


def test_hf_overrides_replace_config_keys_before_the_checks(model_dir):
    cfg = _config(model_dir, hf_overrides='{"max_position_embeddings": 512}')
    assert cfg.model_config.max_model_len == 512
    assert cfg.model_config.hf_config.max_position_embeddings == 512
    with pytest.raises(ModelLoadError, match="num_key_value_heads"):
        _config(model_dir, hf_overrides={"num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="--hf-overrides must be a JSON object"):
        _config(model_dir, hf_overrides='"x"')


def test_tokenizer_modes_other_than_hf_are_refused(model_dir):
    assert _config(model_dir, tokenizer_mode="hf").model_config is not None
    with pytest.raises(ConfigError, match="--tokenizer-mode mistral is not supported"):
        _config(model_dir, tokenizer_mode="mistral")


def test_num_gpu_blocks_override_sizes_the_cache(model_dir):
    from tokenmill import LLM, SamplingParams

    llm = LLM(model_dir, load_format="dummy", max_model_len=64, num_gpu_blocks_override=7,
              max_num_seqs=4)
    assert llm.llm_engine.config.cache_config.num_blocks == 7
    # Three 44-token sequences need 9 blocks: some are preempted, all finish.
    out = llm.generate(["hello"] * 3, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [40] * 3
    with pytest.raises(ConfigError, match="--num-gpu-blocks-override must be a positive"):
        _config(model_dir, num_gpu_blocks_override=0)


@pytest.mark.parametrize("override, words", [
    ({"architectures": []}, "architectures must be a non-empty list"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a non-empty list"),
    ({"eos_token_id": "x"}, "eos_token_id must be a token id"),
    ({"eos_token_id": [2, True]}, "eos_token_id must be a token id"),
    ({"sliding_window": -3}, "sliding_window must be null or an integer >= 0"),
    ({"max_position_embeddings": True}, "max_position_embeddings must be a positive integer"),
    ({"max_position_embeddings": "big"}, "max_position_embeddings must be a positive integer"),
])
def test_config_values_of_the_wrong_kind_are_refused_at_start_up(model_dir, override, words):
    """Values that would otherwise fail deep in the engine (or silently mean something else)
    are refused when the config is read, whether from config.json or --hf-overrides."""
    with pytest.raises(ModelLoadError, match=words):
        _config(model_dir, hf_overrides=override)


def test_disable_sliding_window_caps_the_context_to_the_window(model_dir):
    windowed = {"sliding_window": 48}
    cfg = _config(model_dir, hf_overrides=windowed, disable_sliding_window=True)
    assert cfg.model_config.max_model_len == 48
    assert cfg.model_config.hf_config.get("sliding_window") is None
    assert _config(model_dir, hf_overrides=windowed).model_config.max_model_len == 2048
    with pytest.raises(ConfigError, match="--disable-sliding-window caps it to the sliding"):
        _config(model_dir, hf_overrides=windowed, disable_sliding_window=True, max_model_len=64)
    # no window, or a Qwen2 config that does not use its window: the flag changes nothing
    assert _config(model_dir, disable_sliding_window=True).model_config.max_model_len == 2048
    qwen = {"sliding_window": 48, "model_type": "qwen2", "use_sliding_window": False}
    cfg = _config(model_dir, hf_overrides=qwen, disable_sliding_window=True)
    assert cfg.model_config.max_model_len == 2048


def test_disable_sliding_window_keeps_greedy_output_within_the_window(model_dir):
    """Within the window, full attention sees what the windowed layers saw: the same greedy
    tokens with and without the flag."""
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outputs = []
    for disable in (False, True):
        llm = LLM(model_dir, load_format="dummy", hf_overrides={"sliding_window": 48},
                  max_model_len=48, disable_sliding_window=disable, seed=3)  # fmt: skip
        outputs.append(llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids)
        del llm
    assert len(outputs[0]) == 30 and outputs[0] == outputs[1]


def test_logprobs_mode_reaches_the_sampler_and_its_refusals(model_dir):
    """processed_logprobs: the returned logprobs are those of the distribution drawn from (a
    top-2 row: two finite values summing to probability one); the modes other than raw
    logprobs are refused with speculative decoding, and unknown modes in one line."""
    import math

    from tokenmill import LLM, SamplingParams

    llm = LLM(model_dir, load_format="dummy", max_model_len=64, seed=1,
              logprobs_mode="processed_logprobs")  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=0.8, top_k=2, logprobs=4, seed=7)
    positions = llm.generate(["hello"], params)[0].outputs[0].logprobs
    assert len(positions) == 3
    for top in positions:
        finite = [lp.logprob for lp in top.values() if math.isfinite(lp.logprob)]
        assert len(finite) == 2 and sum(math.exp(v) for v in finite) == pytest.approx(1.0)
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    with pytest.raises(ConfigError, match="--logprobs-mode raw_logits does not combine with"):
        _config(model_dir, logprobs_mode="raw_logits", speculative_config=ngram)
    with pytest.raises(ConfigError, match="--logprobs-mode: 'probs' is not one of raw_logprobs"):
        _config(model_dir, logprobs_mode="probs")


@pytest.mark.parametrize("field, value", [("load_format", "pt"), ("device", "gpu"),
                                          ("block_size", 24), ("scheduling_policy", "lifo")])
def test_values_outside_a_flags_choices_are_refused_from_python(model_dir, field, value):
    """``LLM(...)`` / ``EngineArgs(...)`` refuse what the command line's parser refuses,
    naming the flag and its values (a misspelt value ran as the default)."""
    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')}: .* is not one of"):
        EngineArgs(model=model_dir, **{field: value}).create_engine_config()

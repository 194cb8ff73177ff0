"""InputProcessor: tokenization, validation messages, n / best_of fan-out, EOS ids."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tokenmill.config import ModelConfig
from tokenmill.engine.input_processor import InputProcessor, InvalidRequestError
from tokenmill.hf_config import HFConfig
from tokenmill.sampling_params import SamplingParams, SamplingParamsError

VOCAB = 49152
MAX_LEN = 2048


def make_config(
    generation_config: dict[str, Any] | None = None, eos_token_id: int | None = 2
) -> ModelConfig:
    hf_config = HFConfig(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": VOCAB,
            "max_position_embeddings": 8192,
            "hidden_size": 576,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "eos_token_id": eos_token_id,
        }
    )
    return ModelConfig(
        model="smollm2.gguf",
        tokenizer="smollm2.gguf",
        served_model_name="smollm2",
        hf_config=hf_config,
        generation_config=generation_config or {},
        dtype="float32",
        max_model_len=MAX_LEN,
    )


@pytest.fixture
def processor(smollm2_tokenizer) -> InputProcessor:
    return InputProcessor(make_config(), smollm2_tokenizer, max_logprobs=20)


def test_text_prompt_is_tokenized(processor, smollm2_tokenizer):
    req = processor.process("r1", "Hello world", SamplingParams(), arrival_time=5.0, priority=3)
    assert req.prompt == "Hello world"
    assert req.prompt_token_ids == smollm2_tokenizer.encode("Hello world")
    [core] = req.engine_requests
    assert core.request_id == "r1"
    assert core.prompt_token_ids == req.prompt_token_ids
    assert (core.arrival_time, core.priority) == (5.0, 3)
    assert core.sampling_params.n == 1


@pytest.mark.parametrize("priority", [2**63, -(2**63) - 1, 2**70])
def test_a_priority_beyond_64_bits_is_the_requests_error(processor, priority):
    # The engine's messages carry it as int64: msgspec's OverflowError was a 500.
    with pytest.raises(InvalidRequestError) as e:
        processor.process("r1", "Hello", SamplingParams(), priority=priority)
    assert e.value.param == "priority"
    processor.process("r2", "Hello", SamplingParams(), priority=-(2**63))


def test_prompt_forms(processor, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("Hello world")
    for prompt in (ids, {"prompt_token_ids": ids}, {"prompt": "Hello world"}):
        req = processor.process("r", prompt, SamplingParams())
        assert req.prompt_token_ids == ids
    assert processor.process("r", ids, SamplingParams()).prompt is None
    salted = processor.process("r", {"prompt": "Hi", "cache_salt": "s1"}, SamplingParams())
    assert salted.engine_requests[0].cache_salt == "s1"
    assert processor.process("r", "Hi", SamplingParams()).arrival_time > 0


@pytest.mark.parametrize("prompt", ["", [], {"prompt_token_ids": []}])
def test_empty_prompt(processor, prompt):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        processor.process("r", prompt, SamplingParams())


@pytest.mark.parametrize("prompt", [{"text": "x"}, 3.5, [1, "2"], [1, True]])
def test_malformed_prompt(processor, prompt):
    with pytest.raises(InvalidRequestError):
        processor.process("r", prompt, SamplingParams())


@pytest.mark.parametrize("bad_id", [VOCAB, -1, 10**9])
def test_token_ids_out_of_vocab(processor, bad_id):
    with pytest.raises(InvalidRequestError) as e:
        processor.process("r", [1, 2, bad_id], SamplingParams())
    message = str(e.value)
    assert f"[{bad_id}]" in message and "49152 tokens" in message and "0 to 49151" in message
    assert e.value.param == "prompt"


def test_prompt_plus_max_tokens_too_long(processor):
    with pytest.raises(InvalidRequestError) as e:
        processor.process("r", [5] * 2000, SamplingParams(max_tokens=100))
    assert str(e.value).startswith(
        "This model's maximum context length is 2048 tokens. However, you requested 2100 "
        "tokens (2000 in the prompt, 100 in the completion)."
    )
    assert e.value.param == "max_tokens"
    # Exactly the context length is fine.
    processor.process("r", [5] * 2000, SamplingParams(max_tokens=48))


def test_prompt_alone_too_long(processor):
    for num_tokens in (2048, 3000):
        with pytest.raises(InvalidRequestError) as e:
            processor.process("r", [5] * num_tokens, SamplingParams(max_tokens=None))
        message = str(e.value)
        assert "maximum context length is 2048 tokens" in message
        assert f"prompt has {num_tokens} tokens" in message
    # Without max_tokens the request may use what is left of the context.
    req = processor.process("r", [5] * 2047, SamplingParams(max_tokens=None))
    assert req.engine_requests[0].sampling_params.max_tokens is None


def test_logprobs_limits(processor):
    with pytest.raises(SamplingParamsError, match="logprobs=21 but at most 20") as e:
        processor.process("r", [1], SamplingParams(logprobs=21))
    assert e.value.param == "logprobs"
    with pytest.raises(SamplingParamsError, match="prompt_logprobs=25 but at most 20"):
        processor.process("r", [1], SamplingParams(prompt_logprobs=25))
    with pytest.raises(SamplingParamsError, match="whole vocabulary, 49152 tokens"):
        processor.process("r", [1], SamplingParams(logprobs=-1))
    processor.process("r", [1], SamplingParams(logprobs=20, prompt_logprobs=0))


def test_unlimited_logprobs(smollm2_tokenizer):
    processor = InputProcessor(make_config(), smollm2_tokenizer, max_logprobs=-1)
    processor.process("r", [1], SamplingParams(logprobs=-1, prompt_logprobs=1000))


def test_sampling_token_ids_out_of_vocab(processor):
    with pytest.raises(SamplingParamsError, match=r"\[49152\].*\[0, 49152\)"):
        processor.process("r", [1], SamplingParams(stop_token_ids=[49152]))
    with pytest.raises(SamplingParamsError, match="out of the vocabulary"):
        processor.process("r", [1], SamplingParams(logit_bias={50000: 1.0}))


def test_stop_strings_need_detokenize(processor):
    with pytest.raises(InvalidRequestError, match="detokenize"):
        processor.process("r", [1], SamplingParams(stop=["x"], detokenize=False))


def test_eos_ids_filled_without_touching_user_params(processor):
    params = SamplingParams()
    req = processor.process("r", [1], params)
    assert req.engine_requests[0].sampling_params.eos_token_ids == [2]
    assert req.params.eos_token_ids == [2]
    assert params.eos_token_ids == []  # the caller's object is reused across requests


def test_eos_ids_from_generation_config_and_tokenizer(smollm2_tokenizer):
    config = make_config(generation_config={"eos_token_id": [7, 8]})
    processor = InputProcessor(config, smollm2_tokenizer, max_logprobs=20)
    # generation_config wins over config.json; the tokenizer's EOS (2) is added.
    assert processor.process("r", [1], SamplingParams()).params.eos_token_ids == [7, 8, 2]
    # A tokenizer whose EOS differs from the model's (only these two attributes are read).
    tok = SimpleNamespace(eos_token_id=0, encode=smollm2_tokenizer.encode)
    processor = InputProcessor(make_config(eos_token_id=2), tok, max_logprobs=20)
    assert processor.eos_token_ids == [2, 0]


def test_parallel_sampling_fan_out(processor):
    params = SamplingParams(n=3, seed=5, prompt_logprobs=2)
    req = processor.process("req", "Hello", params)
    assert [r.request_id for r in req.engine_requests] == ["0_req", "1_req", "2_req"]
    children = [r.sampling_params for r in req.engine_requests]
    assert [(p.n, p.best_of) for p in children] == [(1, 1)] * 3
    assert [p.seed for p in children] == [5, 6, 7]
    assert [p.logprobs for p in children] == [None] * 3  # n == best_of: not needed
    # Prompt logprobs depend on the prompt only: one child computes them.
    assert [p.prompt_logprobs for p in children] == [2, None, None]
    assert all(p.eos_token_ids == [2] for p in children)
    assert len({id(p) for p in children}) == 3
    assert (req.params.n, req.params.seed) == (3, 5)


def test_best_of_children_compute_logprobs(processor):
    req = processor.process("r", [1], SamplingParams(n=2, best_of=4))
    children = [r.sampling_params for r in req.engine_requests]
    assert len(children) == 4
    assert [p.logprobs for p in children] == [0] * 4
    assert all(p.seed is None for p in children)
    req = processor.process("r", [1], SamplingParams(n=1, best_of=2, logprobs=3))
    assert [r.sampling_params.logprobs for r in req.engine_requests] == [3, 3]
    assert [r.request_id for r in req.engine_requests] == ["0_r", "1_r"]


def test_default_sampling_params(smollm2_tokenizer):
    config = make_config(
        generation_config={"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 50, "do_sample": 1}
    )
    params = InputProcessor(config, smollm2_tokenizer, 20).default_sampling_params()
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.9, 50)
    plain = InputProcessor(make_config(), smollm2_tokenizer, 20).default_sampling_params()
    assert plain == SamplingParams()


def test_truncate_prompt_tokens_keeps_the_last_tokens(processor):
    ids = list(range(10, 3010))  # longer than the 2048-token context
    req = processor.process("r", ids, SamplingParams(truncate_prompt_tokens=5))
    assert req.prompt_token_ids == ids[-5:]
    req = processor.process("r", "Hello world, again", SamplingParams(truncate_prompt_tokens=2))
    assert len(req.prompt_token_ids) == 2 and req.prompt is None  # the text no longer matches
    req = processor.process("r", "Hi", SamplingParams(truncate_prompt_tokens=50))
    assert req.prompt == "Hi"  # shorter than k: kept whole
    # -1: as much as leaves room for max_tokens.
    req = processor.process("r", ids, SamplingParams(truncate_prompt_tokens=-1, max_tokens=48))
    assert req.prompt_token_ids == ids[-2000:]
    with pytest.raises(InvalidRequestError, match="between 1 and 2047") as e:
        processor.process("r", ids, SamplingParams(truncate_prompt_tokens=2048))
    assert e.value.param == "truncate_prompt_tokens"
    for bad in (0, -2, 1.5):
        with pytest.raises(SamplingParamsError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_min_tokens_with_only_stop_tokens_allowed(processor):
    with pytest.raises(InvalidRequestError, match="no token could be sampled") as e:
        processor.process("r", [1], SamplingParams(min_tokens=2, allowed_token_ids=[2]))
    assert e.value.param == "allowed_token_ids"
    processor.process("r", [1], SamplingParams(min_tokens=2, allowed_token_ids=[2, 7]))
    processor.process("r", [1], SamplingParams(allowed_token_ids=[2]))


def test_bad_words_are_tokenized_alone_and_after_a_space(processor, smollm2_tokenizer):
    req = processor.process("r", [1], SamplingParams(bad_words=["Paris", " hello world"]))
    expected = []
    for text in ("Paris", " Paris", "hello world", " hello world"):
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        if ids not in expected:
            expected.append(ids)
    assert req.engine_requests[0].sampling_params.bad_words_token_ids == expected
    assert req.params.uses_full_sampler  # matched on the host's token history
    for bad in ([""], ["  "], "Paris", [3]):
        with pytest.raises(SamplingParamsError, match="bad_words"):
            SamplingParams(bad_words=bad)


def test_allowed_tokens_that_are_all_bad_words(processor, smollm2_tokenizer):
    [paris] = smollm2_tokenizer.encode(" Paris", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="no token could be sampled"):
        processor.process("r", [1], SamplingParams(bad_words=["Paris"], allowed_token_ids=[paris]))


def test_beam_search_is_refused_under_pipeline_parallelism(smollm2_tokenizer):
    from tokenmill.sampling_params import BeamSearchParams

    processor = InputProcessor(
        make_config(), smollm2_tokenizer, max_logprobs=20, max_num_seqs=8,
        pipeline_parallel_size=2,
    )  # fmt: skip
    with pytest.raises(InvalidRequestError, match="beam search is not implemented with "
                                                  "pipeline parallelism"):  # fmt: skip
        processor.process("r1", "Hello", BeamSearchParams(beam_width=2, max_tokens=4))


def test_beam_search_is_refused_with_speculation_or_an_adapter(smollm2_tokenizer, tmp_path):
    from tokenmill.lora.request import LoRARequest
    from tokenmill.sampling_params import BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=4)
    processor = InputProcessor(
        make_config(), smollm2_tokenizer, max_logprobs=20, max_num_seqs=8, speculative=True
    )
    with pytest.raises(InvalidRequestError, match="not implemented with speculative decoding"):
        processor.process("r1", "Hello", params)
    processor = InputProcessor(make_config(), smollm2_tokenizer, max_logprobs=20, max_num_seqs=8)
    adapter = LoRARequest("a", 1, str(tmp_path))
    with pytest.raises(InvalidRequestError, match="not implemented with LoRA adapters"):
        processor.process("r2", "Hello", params, lora_request=adapter)


def test_beam_search_is_refused_when_the_server_returns_logits(smollm2_tokenizer):
    import dataclasses

    from tokenmill.sampling_params import BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=4)
    for mode in ("raw_logits", "processed_logits"):
        config = dataclasses.replace(make_config(), logprobs_mode=mode)
        processor = InputProcessor(config, smollm2_tokenizer, max_logprobs=20, max_num_seqs=8)
        with pytest.raises(InvalidRequestError, match=f"--logprobs-mode {mode}"):
            processor.process("r1", "Hello", params)
    config = dataclasses.replace(make_config(), logprobs_mode="processed_logprobs")
    processor = InputProcessor(config, smollm2_tokenizer, max_logprobs=20, max_num_seqs=8)
    assert processor.process("r1", "Hello", params).engine_requests

"""LLM.beam_search on the real SmolLM2 (float32, CPU) against transformers' beam search on
the same weights: the same beams, in the same order, with the same scores; beams share the
prompt's KV blocks, and every block is free again afterwards."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, BeamSearchParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(smollm2_gguf_path):
    return LLM(
        smollm2_gguf_path,
        dtype="float32",
        gguf_dequantize=True,  # the float32 path, as transformers' reference
        kv_cache_memory=64 << 20,
        max_model_len=512,
        max_num_seqs=16,
    )


@pytest.fixture(scope="module")
def chat_prompt(llm):
    """A chat turn, so that beams end on the EOS token (<|im_end|>)."""
    tokenizer = llm.get_tokenizer()
    question = "What is 2+2? Answer with a number only."
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def hf_beams(hf, tokenizer, prompt, params: BeamSearchParams, eos_ids, add_special=True):
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=add_special).input_ids
    with torch.no_grad():
        out = hf.generate(
            ids,
            num_beams=params.beam_width,
            num_return_sequences=params.beam_width,
            do_sample=False,
            max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            eos_token_id=eos_ids,
            pad_token_id=eos_ids[0],
            output_scores=True,
            return_dict_in_generate=True,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    n = ids.shape[1]
    beams = []
    for i in range(params.beam_width):
        tokens = out.sequences[i, n:].tolist()
        if eos_ids[0] in tokens:  # padding after an early EOS
            tokens = tokens[: tokens.index(eos_ids[0]) + 1]
        beams.append((tokens, out.sequences_scores[i].item()))
    return ids[0].tolist(), beams


def check_equal(llm, hf, prompt, params, add_special=True):
    tokenizer = llm.get_tokenizer()
    eos = llm.llm_engine.input_processor.eos_token_ids
    prompt_ids, expected = hf_beams(hf, tokenizer, prompt, params, eos, add_special)
    [out] = llm.beam_search({"prompt_token_ids": prompt_ids}, params)
    got = [(s.tokens[len(prompt_ids) :], s.score) for s in out.sequences]
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert [g[1] for g in got] == pytest.approx([e[1] for e in expected], abs=2e-4)
    for seq in out.sequences:
        assert seq.tokens[: len(prompt_ids)] == prompt_ids
        n = len(seq.tokens) - len(prompt_ids)
        assert seq.score == pytest.approx(seq.cum_logprob / n**params.length_penalty)
    return out


@pytest.mark.parametrize(("width", "prompt"), [(2, 0), (2, 2), (3, 1), (4, 0), (4, 2)])
def test_beams_equal_transformers(llm, smollm2_hf, width, prompt):
    params = BeamSearchParams(beam_width=width, max_tokens=8)
    check_equal(llm, smollm2_hf, PROMPTS[prompt], params)
    llm.llm_engine.engine_core.check_integrity()


@pytest.mark.parametrize(
    ("length_penalty", "early_stopping"), [(1.0, False), (0.5, "never"), (2.0, True)]
)
def test_beams_ending_on_eos_equal_transformers(
    llm, smollm2_hf, chat_prompt, length_penalty, early_stopping
):
    params = BeamSearchParams(
        beam_width=3, max_tokens=24, length_penalty=length_penalty, early_stopping=early_stopping
    )
    out = check_equal(llm, smollm2_hf, chat_prompt, params, add_special=False)
    assert any(s.finish_reason == "stop" for s in out.sequences)
    for s in out.sequences:
        if s.finish_reason == "stop":  # the text decodes every token, as vLLM's
            assert s.text.startswith("<|im_start|>") and s.text.endswith("<|im_end|>")


def test_prompts_run_together_and_blocks_are_shared(llm):
    engine = llm.llm_engine
    kv = engine.engine_core.scheduler.kv_cache_manager
    free_before = kv.num_free_blocks
    prompt = "Tell me a long story about the sea. " * 12  # ~110 tokens: 7 full blocks
    prompt_ids = llm.get_tokenizer()(prompt).input_ids
    num_prompt_blocks = len(prompt_ids) // 16
    params = BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True)
    engine.add_request("shared", {"prompt_token_ids": prompt_ids}, params)
    most_used = max_ref = 0
    while engine.has_unfinished_requests():
        engine.step()
        most_used = max(most_used, kv.num_blocks - kv.num_free_blocks)
        max_ref = max(max_ref, max(b.ref_cnt for b in kv.block_pool.blocks))
        engine.engine_core.check_integrity()
    # Without sharing, four beams would hold 4 x 8 blocks; with it, the prompt's blocks once
    # plus each beam's own tail (at most 3 blocks for 20 tokens and the partial one).
    assert max_ref == 4
    assert most_used <= num_prompt_blocks + 4 * 3
    assert engine.last_scheduler_stats.kv_cache_usage == 0.0 or kv.num_free_blocks == free_before
    assert kv.num_free_blocks == free_before  # nothing leaked


def test_beam_search_text_and_shape(llm):
    prompts = ["The capital of France is", {"prompt": "2 + 2 ="}, "Once upon a time"]
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    outs = llm.beam_search(prompts, params)
    assert len(outs) == 3
    tokenizer = llm.get_tokenizer()
    for out, prompt in zip(outs, prompts, strict=True):
        assert len(out.sequences) == 2
        assert out.sequences[0].score >= out.sequences[1].score
        for seq in out.sequences:
            # As vLLM's: the text decodes the prompt's tokens and the beam's.
            assert seq.text == tokenizer.decode(seq.tokens)
            assert seq.text.startswith(prompt if isinstance(prompt, str) else prompt["prompt"])
            assert seq.finish_reason in ("stop", "length")
    # vLLM's concurrency_limit: the prompts run in groups, with the same beams.
    limited = llm.beam_search(prompts, params, use_tqdm=False, concurrency_limit=2)
    assert [[s.tokens for s in o.sequences] for o in limited] == [
        [s.tokens for s in o.sequences] for o in outs
    ]
    llm.llm_engine.engine_core.check_integrity()


def test_invalid_beam_search_is_refused(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max-num-seqs"):
        llm.beam_search("hi", BeamSearchParams(beam_width=17, max_tokens=4))
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    assert llm.beam_search([], params) == []
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search("hi", params, concurrency_limit=0)
    with pytest.raises(ValueError, match="LoRA"):
        llm.beam_search("hi", params, lora_request=object())
    # With a limit, every prompt is checked before the first group runs.
    with pytest.raises(ValueError, match="prompt"):
        llm.beam_search(["hi", "hi " * 600], params, concurrency_limit=1)
    assert not llm.llm_engine.has_unfinished_requests()

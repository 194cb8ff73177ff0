"""The checks the vision-language model tests share: the reference and the engine under
test, a chat message from text and image parts, tokenmill's prompt log-probs and greedy
tokens against transformers' on the same inputs, and an encoder-cache hit on a repeated
image."""

from __future__ import annotations

import pytest
import torch

from tests.model.vlm_checkpoints import random_image
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

# 16 greedy tokens with their log-probs, and every prompt position's.
PARITY_PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1,
                               prompt_logprobs=0)  # fmt: skip


def transformers_model(checkpoint: str):
    """transformers' model of ``checkpoint`` in float32 with eager attention (the reference)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def parity_llm(checkpoint: str) -> LLM:
    """tokenmill on ``checkpoint`` in float32 on the CPU, prompts in 256-token steps."""
    return LLM(model=checkpoint, dtype="float32", device="cpu", max_model_len=1024,
               max_num_batched_tokens=256)  # fmt: skip


def chat_content(parts: list[str], images: list) -> list[dict]:
    """``parts`` (``"image"`` for the next of ``images``, else text) as chat content."""
    it = iter(images)
    return [
        {"type": "image_pil", "image_pil": next(it)} if p == "image"
        else {"type": "text", "text": p}
        for p in parts
    ]  # fmt: skip


def assert_matches_transformers(out, hf_model, inputs: dict, atol: float = 2e-4) -> None:
    """``out`` (``LLM.chat`` with ``PARITY_PARAMS``) against ``hf_model`` on ``inputs``
    (its processor's tensors for the same prompt): the same prompt ids, every prompt
    position's log-prob and each greedy token and its log-prob."""
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        generated = hf_model.generate(**inputs, max_new_tokens=16, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True)  # fmt: skip
        prompt_len = inputs["input_ids"].shape[1]
        assert out.outputs[0].token_ids == generated.sequences[0, prompt_len:].tolist()
        logits = hf_model(**inputs).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    ids = inputs["input_ids"][0]
    for pos in range(1, len(ids)):
        ours = out.prompt_logprobs[pos][int(ids[pos])].logprob
        assert ours == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=atol), pos
    for step, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs,
                                         strict=True)):  # fmt: skip
        ref_step = torch.log_softmax(generated.logits[step][0].float(), -1)
        assert lp[tok].logprob == pytest.approx(float(ref_step[tok]), abs=atol), step


def assert_repeated_image_hits_the_encoder_cache(llm: LLM, height: int, width: int) -> None:
    """The same image after another text: the prefix cache stops before it, the encoder
    cache serves it (one hit)."""
    counters = llm.llm_engine.counters
    image = random_image(7, height, width)
    params = SamplingParams(max_tokens=4, temperature=0)
    before = counters.mm_cache_hits
    for text in ("First look.", "Second look, longer text."):
        chat = [{"role": "user", "content": [{"type": "text", "text": text},
                                             {"type": "image_pil", "image_pil": image}]}]
        assert llm.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids
    assert counters.mm_cache_hits - before == 1

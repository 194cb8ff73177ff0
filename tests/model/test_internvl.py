"""InternVL (transformers' form; Qwen2 and Qwen3 language models) against transformers on the same
random weights (float32, CPU): the prompt's ids as InternVLProcessor writes them (``<img>``,
4 context tokens per tile, ``</img>``; 1 to 4 tiles and a thumbnail by aspect ratio), the
log-probs of every prompt position and of 16 greedy tokens, for prompts with one and two
images; and the encoder cache on a repeated image."""

from __future__ import annotations

import pytest
import torch

from tests.model.vlm_checkpoints import random_image, write_internvl
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp(f"internvl_{request.param}"))
    return write_internvl(folder, text_model=request.param)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import InternVLForConditionalGeneration

    return InternVLForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(model=checkpoint, dtype="float32", device="cpu", max_model_len=1024,
               max_num_batched_tokens=256)  # fmt: skip


def _hf_inputs(checkpoint: str, text: str, images: list) -> dict:
    """transformers' inputs: the tiling image processor's pixels and the prompt's
    ``<IMG_CONTEXT>`` expanded as InternVLProcessor does."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    processed = AutoImageProcessor.from_pretrained(checkpoint)(
        images=images, crop_to_patches=True, return_tensors="pt"
    )  # fmt: skip
    ctx, start, end = tok.convert_tokens_to_ids(["<IMG_CONTEXT>", "<img>", "</img>"])
    tiles = iter(processed["num_patches"].tolist())
    ids: list[int] = []
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        ids.extend([start, *[ctx] * (4 * next(tiles)), end] if t == ctx else [t])
    return dict(input_ids=torch.tensor([ids]), pixel_values=processed["pixel_values"])


CASES = {
    "one image": ([(0, 100, 60)], ["image", "What is in the picture?"]),
    "two images": ([(1, 56, 56), (2, 40, 150)], ["First:", "image", "second:", "image", "?"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_and_greedy_tokens_match_transformers(case, checkpoint, hf_model, llm):
    specs, parts = CASES[case]
    images = [random_image(*s) for s in specs]
    it = iter(images)
    content = [
        {"type": "image_pil", "image_pil": next(it)} if p == "image"
        else {"type": "text", "text": p}
        for p in parts
    ]  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1,
                            prompt_logprobs=0)  # fmt: skip
    out = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0]
    inputs = _hf_inputs(checkpoint, out.prompt, images)
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
        assert ours == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=2e-4), pos
    for step, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs,
                                         strict=True)):  # fmt: skip
        ref_step = torch.log_softmax(generated.logits[step][0].float(), -1)
        assert lp[tok].logprob == pytest.approx(float(ref_step[tok]), abs=2e-4), step


def test_repeated_image_hits_the_encoder_cache(llm):
    counters = llm.llm_engine.counters
    image = random_image(7, 80, 120)
    params = SamplingParams(max_tokens=4, temperature=0)
    before = counters.mm_cache_hits
    for text in ("First look.", "Second look, longer text."):
        chat = [{"role": "user", "content": [{"type": "text", "text": text},
                                             {"type": "image_pil", "image_pil": image}]}]
        assert llm.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids
    assert counters.mm_cache_hits - before == 1

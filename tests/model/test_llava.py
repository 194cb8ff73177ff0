"""LLaVA (CLIP and SigLIP towers) against transformers on the same random weights
(float32, CPU): prompt log-probs and 16 greedy tokens for prompts with one and two images."""

from __future__ import annotations

import pytest
import torch

from tests.model.vlm_checkpoints import random_image, write_llava
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


_image = random_image


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_llava_matches_transformers(tower, tmp_path):
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    path = write_llava(str(tmp_path), tower)
    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=512)
    images = [_image(0, 64, 80), _image(1, 56, 56)]
    chats = [
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": images[0]},
                                      {"type": "text", "text": "What is it?"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "One"},
                                      {"type": "image_pil", "image_pil": images[0]},
                                      {"type": "text", "text": "two"},
                                      {"type": "image_pil", "image_pil": images[1]}]}],
    ]  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.chat(chats, params, use_tqdm=False)
    processor = AutoImageProcessor.from_pretrained(path)
    for out, used in zip(outs, [images[:1], images], strict=True):
        ids = torch.tensor([out.prompt_token_ids])
        pixels = processor(images=used, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            logits = hf(input_ids=ids, pixel_values=pixels).logits[0]
            greedy = hf.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=16,
                                 do_sample=False)  # fmt: skip
        assert out.outputs[0].token_ids == greedy[0, ids.shape[1] :].tolist()
        ref = torch.log_softmax(logits, -1)
        for pos in range(1, ids.shape[1]):
            tok = int(ids[0, pos])
            assert out.prompt_logprobs[pos][tok].logprob == pytest.approx(
                float(ref[pos - 1, tok]), abs=2e-4
            ), pos


def test_images_kept_whole_with_a_step_budget_below_one_image_are_refused_at_start_up(
    tmp_path,
):
    """--disable-chunked-mm-input with a step budget below LLaVA's fixed image size (16
    tokens here) could serve no image at all (each was refused as a request): the engine
    refuses the flags at start-up, and takes them with a budget of one image."""
    from tokenmill.config import ConfigError
    from tokenmill.engine_args import EngineArgs

    path = write_llava(str(tmp_path))
    with pytest.raises(ConfigError, match="below the 16 tokens of one image"):
        EngineArgs(model=path, device="cpu", max_num_batched_tokens=15,
                   disable_chunked_mm_input=True).create_engine_config()  # fmt: skip
    config = EngineArgs(model=path, device="cpu", max_num_batched_tokens=16,
                        disable_chunked_mm_input=True).create_engine_config()  # fmt: skip
    assert config.scheduler_config.disable_chunked_mm_input

"""Image embeddings given instead of images (vLLM's ``multi_modal_data`` forms): the
vision encoder's output computed by transformers on the same weights gives the greedy
tokens of the image itself -- LLaVA (``[F, D]`` / ``[N, F, D]`` tensors), Qwen2.5-VL and
Qwen3-VL (``image_embeds`` with ``image_grid_thw``; Qwen3-VL's rows carry its DeepStack
features) -- and forms a model does not take are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from tests.model.vlm_checkpoints import (
    random_image,
    write_llava,
    write_mistral3,
    write_qwen2_5_vl,
    write_qwen2_vl,
    write_qwen3_vl,
)
from tokenmill.engine.input_processor import InvalidRequestError
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _tokens(llm: LLM, prompt: str, data: dict) -> list[int]:
    out = llm.generate({"prompt": prompt, "multi_modal_data": data}, GREEDY, use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_llava_embeddings_give_the_images_tokens(tmp_path):
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    path = write_llava(str(tmp_path / "llava"))
    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    images = [random_image(1, 70, 90), random_image(2, 60, 60)]
    pixels = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
    with torch.no_grad():
        features = hf.model.get_image_features(
            pixel_values=pixels["pixel_values"], vision_feature_layer=-2,
            vision_feature_select_strategy="default",
        ).pooler_output  # fmt: skip
    embeds = torch.stack(list(features))  # [2, F, D]
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=512)
    prompt = "USER: <image>\nand <image>\nwhat? ASSISTANT:"
    expected = _tokens(llm, prompt, {"image": images})
    assert _tokens(llm, prompt, {"image": embeds}) == expected
    assert _tokens(llm, prompt, {"image": [embeds[0], embeds[1]]}) == expected
    with pytest.raises(InvalidRequestError, match="width 7; the model takes 64"):
        _tokens(llm, prompt, {"image": torch.zeros(2, embeds.shape[1], 7)})
    with pytest.raises(InvalidRequestError, match="embedding rows"):
        _tokens(llm, prompt, {"image": embeds[:, :-1]})
    with pytest.raises(InvalidRequestError, match=r"as a \[F, D\] tensor per image"):
        _tokens(llm, prompt, {"image": {"image_embeds": embeds.flatten(0, 1),
                                        "image_grid_thw": torch.tensor([[1, 4, 4]] * 2)}})


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_embeddings_with_their_grids_give_the_images_tokens(family, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    writer = write_qwen2_5_vl if family == "qwen2_5_vl" else write_qwen3_vl
    path = writer(str(tmp_path / family))
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    images = [random_image(1, 100, 60), random_image(2, 64, 90)]
    processed = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values=processed["pixel_values"],
                                          image_grid_thw=processed["image_grid_thw"])  # fmt: skip
    embeds = torch.cat(list(out.pooler_output))
    if family == "qwen3_vl":  # the DeepStack features follow the embeddings
        deepstack = [torch.cat(list(d)) if isinstance(d, (list, tuple)) else d
                     for d in out.deepstack_features]  # per level, maybe split by image
        embeds = torch.cat([embeds, *deepstack], dim=-1)
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=1024)
    prompt = f"Compare {QWEN_IMAGE} with {QWEN_IMAGE} please"
    given = {"image_embeds": embeds, "image_grid_thw": processed["image_grid_thw"]}
    assert _tokens(llm, prompt, {"image": given}) == _tokens(llm, prompt, {"image": images})
    with pytest.raises(InvalidRequestError, match="gives .* embedding rows"):
        _tokens(llm, prompt, {"image": dict(given, image_embeds=embeds[1:])})
    with pytest.raises(InvalidRequestError, match="as {'image_embeds'"):
        _tokens(llm, prompt, {"image": [embeds[:4], embeds[4:8]]})


def test_a_grid_off_the_merged_patches_is_refused_and_the_engine_serves_on(tmp_path):
    """Rows are placed on the 2x2-merged grid (M-RoPE): a grid whose height or width is
    not a multiple of the merge size, or whose size overflows 64 bits, is a 400 naming the
    field; it once killed the engine in its first step."""
    llm = LLM(model=write_qwen2_vl(str(tmp_path / "q2")), dtype="float32", device="cpu",
              max_model_len=256)  # fmt: skip
    prompt = f"a {QWEN_IMAGE} b"
    for rows, grid in [(1, [1, 1, 4]), (2, [1, 3, 3]), (0, [1, 2**32, 2**32])]:
        given = {"image_embeds": torch.zeros(rows, 64), "image_grid_thw": torch.tensor([grid])}
        with pytest.raises(InvalidRequestError) as e:
            _tokens(llm, prompt, {"image": given})
        assert e.value.param == "multi_modal_data"
    assert len(_tokens(llm, prompt, {"image": random_image(0, 56, 56)})) == 8


def test_a_model_with_its_own_layout_refuses_embeddings(tmp_path):
    llm = LLM(model=write_mistral3(str(tmp_path / "m3")), dtype="float32", device="cpu",
              max_model_len=256)  # fmt: skip
    with pytest.raises(InvalidRequestError, match="takes images, not image embeddings") as e:
        _tokens(llm, "[INST][IMG]?[/INST]", {"image": torch.zeros(12, 64)})
    assert e.value.param == "multi_modal_data"

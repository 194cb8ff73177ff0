"""Hostile image inputs through the Python API (``LLM.generate`` / ``LLM.chat``) of a tiny
random Qwen2.5-VL: each is refused with an error naming what is wrong, and the engine
keeps serving the next request."""

from __future__ import annotations

import pytest

from tests.model.vlm_checkpoints import random_image
from tokenmill.engine.input_processor import InvalidRequestError
from tokenmill.entrypoints.llm import LLM
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
          "<|im_start|>assistant\n")  # fmt: skip
GREEDY = SamplingParams(max_tokens=2, temperature=0)


def rgb(seed: int = 0, width: int = 56, height: int = 56):
    return random_image(seed, height, width)


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory) -> str:
    from tests.model.vlm_checkpoints import write_qwen2_5_vl

    return write_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl_hostile")))


@pytest.fixture(scope="module")
def llm(qwen_path) -> LLM:
    return LLM(model=qwen_path, dtype="float32", device="cpu", max_model_len=256)


def still_serves(llm: LLM) -> None:
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": rgb()}}, GREEDY,
                       use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 2


def test_mm_features_that_do_not_match_the_prompt_are_refused(llm):
    """Processed images given with a prompt are checked against its placeholders (wrong
    objects made the engine raise after the request was registered: the next generate
    waited forever; ranges off the placeholders would crash the engine)."""
    image_id = llm.llm_engine.config.model_config.hf_config.image_token_id
    ids = [1, image_id, image_id, 2]
    for features in (["junk"], [MultiModalFeature("image", "h", 0, 2)],
                     [MultiModalFeature("image", "h", 1, 1)],
                     [MultiModalFeature("image", "h", 1, 8)]):  # fmt: skip
        with pytest.raises(InvalidRequestError) as info:
            llm.generate({"prompt_token_ids": ids, "mm_features": features}, GREEDY,
                         use_tqdm=False)  # fmt: skip
        assert info.value.param == "mm_features"
    still_serves(llm)


def test_one_mm_feature_outside_a_list_is_read_as_a_list_of_one(llm):
    """``mm_features`` given as one feature (the check reads it as a list of one) reaches
    the engine as that list: the same tokens as the list form."""
    image_id = llm.llm_engine.config.model_config.hf_config.image_token_id
    ids, [feature] = llm.llm_engine.input_processor.process_multimodal(
        [1, image_id, 2], {"image": rgb(3)}
    )
    outs = [llm.generate({"prompt_token_ids": ids, "mm_features": f}, GREEDY,
                         use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
            for f in (feature, [feature])]
    assert outs[0] == outs[1]

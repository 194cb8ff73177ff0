"""Images with sleep mode and beam search, on a random Qwen2.5-VL (float32, CPU): weights
loaded in place (``update_weights``) re-encode a cached image, so the answer is the new
weights' own; beam search refuses images with an InvalidRequestError naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from tests.model.vlm_checkpoints import write_qwen2_5_vl
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import BeamSearchParams, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
TEXT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _image(seed: int):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 256, (112, 112, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("qwen2_5_vl_sleep")
    return write_qwen2_5_vl(str(root / "a"), seed=0), write_qwen2_5_vl(str(root / "b"), seed=1)


def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", max_model_len=512,
               max_num_batched_tokens=256, **kw)  # fmt: skip


def _tokens(llm: LLM, image) -> list[int]:
    prompt = {"prompt": TEXT, "multi_modal_data": {"image": image}}
    return list(llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_update_weights_encodes_cached_images_again(checkpoints):
    first, second = checkpoints
    image = _image(5)
    expected = _tokens(_llm(second), image)
    llm = _llm(first, enable_sleep_mode=True)
    before = _tokens(llm, image)
    assert before != expected  # the two random models differ
    counters = llm.llm_engine.counters
    llm.update_weights(second)
    hits = counters.mm_cache_hits
    assert _tokens(llm, image) == expected
    assert counters.mm_cache_hits == hits  # encoded again, not read from the cache
    llm.sleep(level=1)
    llm.wake_up()
    assert _tokens(llm, image) == expected
    core = llm.llm_engine.engine_core
    core.scheduler.kv_cache_manager.check_integrity()


def test_beam_search_refuses_images(checkpoints):
    from tokenmill.engine.input_processor import InvalidRequestError

    llm = _llm(checkpoints[0])
    prompt = {"prompt": TEXT, "multi_modal_data": {"image": _image(6)}}
    with pytest.raises(InvalidRequestError, match="images") as info:
        llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4))
    assert info.value.param == "multi_modal_data"

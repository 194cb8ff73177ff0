"""Qwen2.5-VL against transformers on the same random weights (float32, CPU): the log-probs
of every prompt position (text and image placeholders) and of 16 greedy tokens, for
prompts with one and with two images; and the encoder and prefix caches on a repeated image.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.vlm_checkpoints import random_image, write_qwen2_5_vl
from tests.model.vlm_parity import (
    PARITY_PARAMS,
    assert_matches_transformers,
    chat_content,
    parity_llm,
    transformers_model,
)
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


_image = random_image


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers_model(checkpoint)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return parity_llm(checkpoint)


def _hf_inputs(checkpoint: str, hf_model, text: str, images: list) -> dict:
    """transformers' inputs: the text tokenized, each image token repeated once per merged
    2x2 patch group, the image processor's pixels."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    processed = AutoImageProcessor.from_pretrained(checkpoint)(images=images, return_tensors="pt")
    image_id = hf_model.config.image_token_id
    counts = iter((processed["image_grid_thw"].prod(-1) // 4).tolist())
    ids: list[int] = []
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        ids.extend([image_id] * next(counts) if t == image_id else [t])
    input_ids = torch.tensor([ids])
    return dict(
        input_ids=input_ids,
        pixel_values=processed["pixel_values"],
        image_grid_thw=processed["image_grid_thw"],
        mm_token_type_ids=(input_ids == image_id).int(),
    )


CASES = {
    "one image": ([(0, 224, 224)], ["image", "What is in the picture?"]),
    "two images": (
        [(1, 224, 168), (2, 56, 84)],
        ["First:", "image", "second:", "image", "compare them."],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_and_greedy_tokens_match_transformers(case, checkpoint, hf_model, llm):
    specs, parts = CASES[case]
    images = [_image(*s) for s in specs]
    out = llm.chat([{"role": "user", "content": chat_content(parts, images)}], PARITY_PARAMS,
                   use_tqdm=False)[0]  # fmt: skip
    assert_matches_transformers(out, hf_model, _hf_inputs(checkpoint, hf_model, out.prompt, images))


def test_repeated_image_hits_the_encoder_and_prefix_caches(llm):
    counters = llm.llm_engine.counters
    image = _image(7, 224, 224)
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                         {"type": "text", "text": "Again?"}]}]  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0)
    before_hits, before_queries = counters.mm_cache_hits, counters.mm_cache_queries
    first = llm.chat(chat, params, use_tqdm=False)[0]
    second = llm.chat(chat, params, use_tqdm=False)[0]
    assert counters.mm_cache_queries - before_queries == 1  # the second read no placeholder
    assert second.num_cached_tokens >= len(first.prompt_token_ids) // 16 * 16 - 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids

    # The same image in a new text: no prefix hit past the text before it, but an
    # encoder-cache hit.
    chat2 = [{"role": "user", "content": [{"type": "text", "text": "Look: " * 4},
                                          {"type": "image_pil", "image_pil": image}]}]  # fmt: skip
    llm.chat(chat2, params, use_tqdm=False)
    assert counters.mm_cache_hits - before_hits == 1

    # Another image of the same size: same placeholder tokens, different KV.
    other = [{"role": "user", "content": [{"type": "image_pil", "image_pil": _image(8, 224, 224)},
                                          {"type": "text", "text": "Again?"}]}]  # fmt: skip
    third = llm.chat(other, params, use_tqdm=False)[0]
    assert third.num_cached_tokens < 16


def test_greedy_tokens_do_not_depend_on_chunks_or_the_batch(checkpoint, llm):
    """Both cases in one batch, on an engine whose 32-token steps split the prompts (and a
    64-placeholder image) into chunks, give the tokens each gets alone on ``llm``."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    chats = _case_chats()
    alone = [llm.chat(c, params, use_tqdm=False)[0].outputs[0].token_ids for c in chats]
    small = LLM(model=checkpoint, dtype="float32", device="cpu", max_model_len=1024,
                max_num_batched_tokens=32)  # fmt: skip
    together = small.chat(chats, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == alone


def test_images_kept_whole_give_the_same_tokens_and_one_over_the_budget_is_refused(
    checkpoint, llm
):
    """``disable_chunked_mm_input``: chunks end before an image (64 placeholders here) and
    take it in one step; the tokens do not change. An image with more placeholders than a
    step's budget could never be scheduled: refused."""
    from tokenmill.engine.input_processor import InvalidRequestError

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    chats = _case_chats()
    alone = [llm.chat(c, params, use_tqdm=False)[0].outputs[0].token_ids for c in chats]
    whole = LLM(model=checkpoint, dtype="float32", device="cpu", max_model_len=1024,
                max_num_batched_tokens=64, disable_chunked_mm_input=True)  # fmt: skip
    together = whole.chat(chats, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == alone
    del whole
    small = LLM(model=checkpoint, dtype="float32", device="cpu", max_model_len=1024,
                max_num_batched_tokens=32, disable_chunked_mm_input=True)  # fmt: skip
    big = [{"role": "user", "content": [{"type": "image_pil", "image_pil": _image(5, 224, 224)},
                                        {"type": "text", "text": "Hi"}]}]  # fmt: skip
    with pytest.raises(InvalidRequestError, match="takes 64 tokens, more than the 32"):
        small.chat(big, params, use_tqdm=False)
    text_only = [{"role": "user", "content": "Hi"}]
    assert small.chat(text_only, params, use_tqdm=False)[0].outputs[0].token_ids


def _case_chats() -> list[list[dict]]:
    chats = []
    for specs, parts in CASES.values():
        it = iter([_image(*s) for s in specs])
        chats.append([{"role": "user", "content": [
            {"type": "image_pil", "image_pil": next(it)} if p == "image"
            else {"type": "text", "text": p}
            for p in parts
        ]}])  # fmt: skip
    return chats


def test_generate_with_multi_modal_data_gives_the_chat_tokens(llm):
    image = _image(3, 112, 224)
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                         {"type": "text", "text": "Hi"}]}]  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    by_chat = llm.chat(chat, params, use_tqdm=False)[0]
    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
            "<|im_start|>assistant\n")  # fmt: skip
    by_prompt = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, params,
                             use_tqdm=False)[0]  # fmt: skip
    assert by_prompt.prompt_token_ids == by_chat.prompt_token_ids
    assert by_prompt.outputs[0].token_ids == by_chat.outputs[0].token_ids
    # a uint8 [H, W, 3] numpy array is the same image (as vLLM takes them)
    by_array = llm.generate({"prompt": text, "multi_modal_data": {"image": np.asarray(image)}},
                            params, use_tqdm=False)[0]  # fmt: skip
    assert by_array.outputs[0].token_ids == by_chat.outputs[0].token_ids


def test_fanned_out_children_carry_the_image_data_once(llm):
    """``n = 3``: the first child crosses to the core with the image's data, the other two
    with its identifier only, and all three decode it (greedy: the single request's tokens);
    the core and the worker hold one copy."""
    image = _image(4, 112, 112)
    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
            "<|im_start|>assistant\n")  # fmt: skip
    prompt = {"prompt": text, "multi_modal_data": {"image": image}}
    engine = llm._generation_engine()
    processed = engine.input_processor.process("fan", prompt, SamplingParams(n=3, max_tokens=4))
    [first, *rest] = [r.mm_features for r in processed.engine_requests]
    assert first[0].data and len(rest) == 2
    assert all(f[0].identifier == first[0].identifier and not f[0].data for f in rest)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    fanned = llm.generate(prompt, SamplingParams(n=3, max_tokens=6, temperature=0,
                                                 ignore_eos=True), use_tqdm=False)[0]  # fmt: skip
    assert [o.token_ids for o in fanned.outputs] == [alone] * 3


def test_an_image_the_encoder_fails_on_fails_its_request_only(llm, monkeypatch):
    """The vision tower raises on one image of a batch: its request ends with the reason,
    the other request of the same step gives its tokens, and the engine serves on."""
    mm = llm._generation_engine().engine_core.executor.worker.model_runner.mm
    encode = mm.model.encode_images

    def fail_on_one(items):
        if any(list(np.asarray(d["image_grid_thw"])) == [1, 4, 6] for d in items):
            raise RuntimeError("tower failed")
        return encode(items)

    monkeypatch.setattr(mm.model, "encode_images", fail_on_one)
    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
            "<|im_start|>assistant\n")  # fmt: skip
    good = {"prompt": text, "multi_modal_data": {"image": _image(7, 112, 112)}}
    bad = {"prompt": text, "multi_modal_data": {"image": _image(8, 56, 84)}}  # grid 1x4x6
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    alone = llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids
    failed, served = (o.outputs[0] for o in llm.generate([bad, good], params, use_tqdm=False))
    assert failed.finish_reason == "abort" and "tower failed" in failed.stop_reason
    assert served.token_ids == alone
    assert llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids == alone


def test_bad_multi_modal_data_is_an_invalid_request(llm):
    from tokenmill.engine.input_processor import InvalidRequestError

    text = "<|vision_start|><|image_pad|><|vision_end|>Hi"
    params = SamplingParams(max_tokens=2)
    for data, words in [
        ({"video": [1]}, "'image' key"),
        ({"image": "not an image"}, "PIL"),
        ({"image": np.zeros((8, 8, 3), dtype=np.float32)}, "uint8"),
        ({"image": np.zeros((8, 8, 2), dtype=np.uint8)}, "1, 3 or 4 channels"),
        ({"image": []}, "placeholder"),
    ]:
        with pytest.raises(InvalidRequestError, match=words) as info:
            llm.generate({"prompt": text, "multi_modal_data": data}, params, use_tqdm=False)
        assert info.value.param == "multi_modal_data"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_image_requests_give_their_tokens_and_free_every_block(
    checkpoint, llm, async_scheduling
):
    """On a KV cache of 16 blocks, four image prompts preempt each other (recompute: the
    images' encoder outputs are read again from the cache, or encoded again once evicted);
    each gets the tokens it gets alone, and every block is free afterwards; with one step
    in flight (async scheduling, the CUDA default) as well."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    chats = [
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": _image(20 + i, 224, 168)},
                                      {"type": "text", "text": f"Tell me more, {i}."}]}]
        for i in range(4)
    ]  # fmt: skip
    alone = [llm.chat(c, params, use_tqdm=False)[0].outputs[0].token_ids for c in chats]
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers, K and V, block size, KV heads, head dim, fp32
    tiny = LLM(model=checkpoint, dtype="float32", device="cpu", max_model_len=256,
               kv_cache_memory=16 * block_bytes, max_num_batched_tokens=128,
               async_scheduling=async_scheduling)  # fmt: skip
    engine = tiny.llm_engine
    scheduler = engine.engine_core.scheduler
    assert scheduler.kv_cache_manager.num_blocks == 16
    outs = tiny.chat(chats, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert engine.counters.num_preemptions > 0
    scheduler.kv_cache_manager.check_integrity()
    assert scheduler.kv_cache_manager.num_free_blocks == 16


def test_mm_processor_kwargs_bound_the_image_tokens(checkpoint):
    """``max_pixels`` of 56x56 makes a 224x224 image 4 placeholders instead of 64."""
    small = LLM(model=checkpoint, dtype="float32", device="cpu", max_model_len=256,
                mm_processor_kwargs={"max_pixels": 56 * 56})  # fmt: skip
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": _image(9, 224, 224)},
                                         {"type": "text", "text": "Hi"}]}]  # fmt: skip
    out = small.chat(chat, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    image_id = small.llm_engine.config.model_config.hf_config.image_token_id
    assert out.prompt_token_ids.count(image_id) == 4

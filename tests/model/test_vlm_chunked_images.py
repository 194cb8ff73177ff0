"""Images whose placeholders are not all plain image tokens (Mistral 3's row breaks), that
are tiled (InternVL) or whose features enter inside the model (Qwen3-VL's DeepStack):
prompts cut into 32-token chunks beside other requests, and served again with prefix-cache
hits that end inside an image, give the greedy tokens of whole, uncached prompts."""

from __future__ import annotations

import pytest

from tests.model.vlm_checkpoints import (
    random_image,
    write_internvl,
    write_mistral3,
    write_qwen3_vl,
)
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

WRITERS = {"mistral3": write_mistral3, "qwen3_vl": write_qwen3_vl, "internvl": write_internvl}


@pytest.mark.parametrize("arch", list(WRITERS))
def test_chunks_and_prefix_hits_inside_images_keep_greedy_tokens(arch, tmp_path):
    path = WRITERS[arch](str(tmp_path / arch))
    images = [random_image(i, 100 + 17 * i, 60 + 29 * i) for i in range(3)]
    chats = []
    for i in range(6):
        content = [{"type": "text", "text": f"Request {i}: " + "x" * (i * 7)},
                   {"type": "image_pil", "image_pil": images[i % 3]},
                   {"type": "text", "text": "describe"}]  # fmt: skip
        if i % 2:
            content.append({"type": "image_pil", "image_pil": images[(i + 1) % 3]})
        chats.append([{"role": "user", "content": content}])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    whole = LLM(model=path, dtype="float32", device="cpu", max_model_len=1024,
                enable_prefix_caching=False)  # fmt: skip
    expected = [whole.chat(c, params, use_tqdm=False)[0].outputs[0].token_ids for c in chats]
    del whole
    chunked = LLM(model=path, dtype="float32", device="cpu", max_model_len=1024,
                  max_num_batched_tokens=32, max_num_seqs=4)  # fmt: skip
    for _ in range(2):  # the second round hits the prefix cache
        outs = chunked.chat(chats, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.num_cached_tokens > 0 for o in outs)


@pytest.mark.parametrize("arch", list(WRITERS))
def test_processed_images_as_the_server_sends_them(arch, tmp_path):
    """The OpenAI server processes images first and hands the engine the expanded prompt
    with its features (``mm_features``): the ranges of Mistral 3's images hold row-break
    tokens, which that check must take; the tokens equal the offline path's."""
    path = WRITERS[arch](str(tmp_path / arch))
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=1024)
    image = random_image(4, 90, 130)
    chat = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                         {"type": "image_pil", "image_pil": image}]}]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    offline = llm.chat(chat, params, use_tqdm=False)[0]
    templated = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"}]}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    raw = llm.get_tokenizer()(templated, add_special_tokens=False)["input_ids"]
    ids, features = llm.llm_engine.input_processor.process_multimodal(raw, {"image": image})
    assert ids == offline.prompt_token_ids
    served = llm.generate({"prompt_token_ids": ids, "mm_features": features}, params,
                          use_tqdm=False)[0]  # fmt: skip
    assert served.outputs[0].token_ids == offline.outputs[0].token_ids

"""Gemma 3 vision-language models against transformers on the same random weights
(float32, CPU): the prompt side (token ids and image ranges equal Gemma3Processor's, pan-and-
scan included), the logits of every prompt position and of 16 greedy tokens for prompts
with one and two images (longer than the sliding window, with image runs longer than it),
and the encoder cache on a repeated image."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.vlm_checkpoints import random_image, write_gemma3_mm
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

VOCAB = 272
# Engine settings of every LLM here: logits of every prompt position and generated token.
ENGINE = dict(dtype="float32", device="cpu", max_model_len=512, max_num_batched_tokens=256,
              max_logprobs=VOCAB, logprobs_mode="raw_logits")  # fmt: skip
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}
# fp32 on CPU: max abs difference of logits (and of log-probs) from transformers'
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_gemma3_mm(str(tmp_path_factory.mktemp("gemma3_mm")))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def hf_processor(checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(model=checkpoint, **ENGINE)


def _chat(parts: list, images: list) -> list[dict]:
    it = iter(images)
    content = [
        {"type": "image_pil", "image_pil": next(it)} if p == "image"
        else {"type": "text", "text": p}
        for p in parts
    ]  # fmt: skip
    return [{"role": "user", "content": content}]


CASES = {
    "one image": ([(0, 50, 70)], ["image", "What is in the picture?"]),
    "two images": ([(1, 64, 64), (2, 90, 40)], ["First:", "image", "second:", "image", "compare."]),
}


def test_the_prompt_is_gemma3_processors(checkpoint, hf_processor):
    """Token ids, image ranges (transformers' token_type_ids) and pixels equal
    Gemma3Processor's: a chat prompt, adjacent images and images between newlines (whose
    newline tokens merge with the image sequence's), with and without pan-and-scan."""
    prompts = [
        ("<bos><start_of_turn>user\n<start_of_image>What?<end_of_turn>\n<start_of_turn>model\n", 1),
        ("a\n<start_of_image><start_of_image>\n\nb<start_of_image>", 3),
        ("x\n\n<start_of_image>\n\n\ny", 1),
    ]
    _check_prompts(checkpoint, hf_processor, prompts)


def test_text_that_meets_an_image_sequence_is_tokenized_with_it(tmp_path):
    """A tokenizer that writes text before a newline or a word after a space as one token
    (Gemma's writes " Here" as one) tokenizes the prompt's text that meets an image's
    sequence together with it, as Gemma3Processor's one tokenization of the text does:
    "this " + "Here is the original image" (pan-and-scan) is "this" + " Here"."""
    from transformers import AutoProcessor

    merges = [(" ", "H"), (" ", "\n"), ("a", "\n"), (".", " ")]
    path = write_gemma3_mm(str(tmp_path), merges=merges)
    prompts = [
        ("Describe this <start_of_image>", 1),
        ("a <start_of_image> b.<start_of_image>\n\nc", 2),
        ("see a\n<start_of_image>. Here", 1),
        ("<start_of_image>a\n", 1),
    ]
    _check_prompts(path, AutoProcessor.from_pretrained(path), prompts)


def _check_prompts(checkpoint: str, hf_processor, prompts: list[tuple[str, int]]) -> None:
    """Assert the ids, image ranges and pixels of each ``(text, number of images)`` equal
    ``hf_processor``'s, with and without pan-and-scan."""
    from tokenmill.engine_args import EngineArgs
    from tokenmill.multimodal.processor import MultiModalProcessor

    config = EngineArgs(model=checkpoint, device="cpu").create_engine_config().model_config
    tok = hf_processor.tokenizer
    for kwargs in ({}, PAN_AND_SCAN):
        mm = MultiModalProcessor(checkpoint, config.hf_config, {"image": 4}, kwargs, tok)
        for text, n in prompts:
            images = [random_image(i, 40 + 30 * i, 100 - 20 * i) for i in range(n)]
            ref = hf_processor(text=text, images=images, return_tensors="np", **kwargs)
            ids, features = mm.process(tok.encode(text, add_special_tokens=False), images)
            assert ids == ref["input_ids"][0].tolist(), (text, kwargs)
            in_image = np.zeros(len(ids), dtype=np.int64)
            for f in features:
                assert f.length == 16
                in_image[f.offset : f.end] = 1
            assert in_image.tolist() == ref["token_type_ids"][0].tolist(), (text, kwargs)
            pixels = np.stack([f.data["pixel_values"].unpack() for f in features])
            np.testing.assert_array_equal(pixels, ref["pixel_values"])
        if kwargs:  # pan-and-scan cropped the oblong images: more features than images
            assert len(features) > n


def _compare(out, hf_model, hf_processor, images: list, kwargs: dict | None = None) -> float:
    """Assert ``out``'s prompt log-probs and generated tokens' logits equal transformers'
    (one forward pass over the prompt and the generated tokens); the greedy tokens equal
    ``generate``'s. Returns the largest difference."""
    prompt = out.prompt_token_ids
    generated = out.outputs[0].token_ids
    ref = hf_processor(text=out.prompt, images=images, return_tensors="pt", **(kwargs or {}))
    assert prompt == ref["input_ids"][0].tolist()
    ids = torch.tensor([prompt + list(generated)])
    token_type_ids = torch.nn.functional.pad(ref["token_type_ids"], (0, len(generated)))
    with torch.no_grad():
        logits = hf_model(input_ids=ids, pixel_values=ref["pixel_values"],
                          token_type_ids=token_type_ids).logits[0]  # fmt: skip
        greedy = hf_model.generate(**ref, max_new_tokens=len(generated), do_sample=False)
    assert list(generated) == greedy[0, len(prompt) :].tolist()
    ref_logprobs = torch.log_softmax(logits, -1)
    worst = 0.0
    for pos in range(1, len(prompt)):
        ours = torch.tensor([out.prompt_logprobs[pos][t].logprob for t in range(VOCAB)])
        worst = max(worst, float((ours - ref_logprobs[pos - 1]).abs().max()))
    for step, lp in enumerate(out.outputs[0].logprobs):
        ours = torch.tensor([lp[t].logprob for t in range(VOCAB)])  # raw logits
        worst = max(worst, float((ours - logits[len(prompt) + step - 1]).abs().max()))
    assert worst < TOLERANCE
    return worst


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_match_transformers(case, llm, hf_model, hf_processor):
    specs, parts = CASES[case]
    images = [random_image(*s) for s in specs]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=-1,
                            prompt_logprobs=-1)  # fmt: skip
    out = llm.chat(_chat(parts, images), params, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 12 + 16  # past the window, its images longer than it
    _compare(out, hf_model, hf_processor, images)


def test_greedy_tokens_do_not_depend_on_chunks_or_the_batch(checkpoint, llm):
    """Both cases in one batch, on an engine whose 32-token steps split the prompts into
    chunks (an image's run is never split: its tokens see each other), give the tokens
    each gets alone on ``llm``."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    chats = [_chat(parts, [random_image(*s) for s in specs]) for specs, parts in CASES.values()]
    alone = [llm.chat(c, params, use_tqdm=False)[0].outputs[0].token_ids for c in chats]
    small = LLM(model=checkpoint, **{**ENGINE, "max_num_batched_tokens": 32})
    together = small.chat(chats, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == alone


def test_pan_and_scan_matches_transformers(checkpoint, hf_model, hf_processor):
    """An oblong image cut into crops (--mm-processor-kwargs do_pan_and_scan): each crop
    is one more image of 16 tokens, as in transformers."""
    pas = LLM(model=checkpoint, mm_processor_kwargs=PAN_AND_SCAN, **ENGINE)
    images = [random_image(5, 40, 80)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=-1,
                            prompt_logprobs=-1)  # fmt: skip
    out = pas.chat(_chat(["image", "Describe it."], images), params, use_tqdm=False)[0]
    image_id = hf_model.config.image_token_id
    assert out.prompt_token_ids.count(image_id) == 3 * 16  # the image and two crops
    _compare(out, hf_model, hf_processor, images, PAN_AND_SCAN)


def test_a_repeated_image_is_encoded_once(llm):
    """The same image twice in a prompt is encoded once; in a later prompt it is an
    encoder-cache hit and is not encoded again."""
    mm = llm._generation_engine().engine_core.executor.worker.model_runner.mm
    counters = llm.llm_engine.counters
    image = random_image(7, 64, 64)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    encoded = mm.num_encoded
    llm.chat(_chat(["image", "and", "image", "same?"], [image, image]), params, use_tqdm=False)
    assert mm.num_encoded - encoded == 1
    hits = counters.mm_cache_hits
    llm.chat(_chat(["Look again:", "image"], [image]), params, use_tqdm=False)
    assert counters.mm_cache_hits - hits == 1
    assert mm.num_encoded - encoded == 1


def test_generate_with_start_of_image_gives_the_chat_tokens(llm):
    """``LLM.generate`` takes ``<start_of_image>`` once per image, as the chat template
    writes it; a prompt holding the soft tokens itself is refused."""
    from tokenmill.engine.input_processor import InvalidRequestError

    image = random_image(3, 64, 48)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    by_chat = llm.chat(_chat(["image", "Hi"], [image]), params, use_tqdm=False)[0]
    text = "<bos><start_of_turn>user\n<start_of_image>Hi<end_of_turn>\n<start_of_turn>model\n"
    by_prompt = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, params,
                             use_tqdm=False)[0]  # fmt: skip
    assert by_prompt.prompt_token_ids == by_chat.prompt_token_ids
    assert by_prompt.outputs[0].token_ids == by_chat.outputs[0].token_ids
    for prompt in ("<image_soft_token><start_of_image>Hi", "<image_soft_token>Hi"):
        data = {"image": image} if "<start_of_image>" in prompt else None
        with pytest.raises(InvalidRequestError, match="image"):
            llm.generate({"prompt": prompt, "multi_modal_data": data}, params, use_tqdm=False)


def test_checkpoint_layouts_load_alike(checkpoint, llm, tmp_path):
    """The tensors named as transformers 4.52+ keeps them in memory
    (``model.language_model.*``, ``model.vision_tower.vision_model.*``,
    ``model.multi_modal_projector.*`` and a tied ``lm_head.weight``) give the tokens of the
    saved layout (``language_model.model.*``, ``vision_tower.*``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{checkpoint}/model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        for old, new in [("language_model.model.", "model.language_model."),
                         ("vision_tower.", "model.vision_tower.vision_model."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")]:  # fmt: skip
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        renamed[name] = tensor
    renamed["lm_head.weight"] = tensors["language_model.model.embed_tokens.weight"].clone()
    shutil.copytree(checkpoint, tmp_path, dirs_exist_ok=True)
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    other = LLM(model=str(tmp_path), **ENGINE)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    chat = _chat(["image", "Hi"], [random_image(6, 64, 64)])
    assert (other.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids
            == llm.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids)  # fmt: skip


def test_dummy_weights_serve_images(checkpoint):
    """``--load-format dummy`` builds the tower and the projector too."""
    dummy = LLM(model=checkpoint, load_format="dummy", dtype="float32", device="cpu",
                max_model_len=256)  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = dummy.chat(_chat(["image", "Hi"], [random_image(4, 64, 64)]), params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_step_budget_below_one_image_is_refused_at_start_up(checkpoint):
    from tokenmill.config import ConfigError

    with pytest.raises(ConfigError, match="below the 16 tokens of one image"):
        LLM(model=checkpoint, **{**ENGINE, "max_num_batched_tokens": 15})


def test_bidirectional_models_are_the_ones_the_scheduler_keeps_images_whole_for():
    from tokenmill.model.registry import get_model_class, supported_architectures
    from tokenmill.multimodal.config import BIDIRECTIONAL_IMAGE_ARCHITECTURES

    declared = {
        arch for arch in supported_architectures()
        if getattr(get_model_class(arch), "bidirectional_image_attention", False)
    }  # fmt: skip
    assert declared == set(BIDIRECTIONAL_IMAGE_ARCHITECTURES)


@pytest.mark.parametrize("kwargs", [
    {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 0},
    {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 0},
    {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 2.5},
    {"do_pan_and_scan": "yes"},
    # Passes a check on images below the ratio, divides by zero on the first one above it.
    {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 0,
     "pan_and_scan_min_ratio_to_activate": 5.0},
])  # fmt: skip
def test_bad_pan_and_scan_settings_are_refused_at_start_up(checkpoint, kwargs):
    """Pan-and-scan settings Gemma3ImageProcessor fails on (a division by zero, its strict
    type check) are a ConfigError naming the flag, not the processor's own exception at
    start-up or a 500 on the first oblong image."""
    from tokenmill.config import ConfigError
    from tokenmill.engine_args import EngineArgs

    with pytest.raises(ConfigError, match="--mm-processor-kwargs"):
        EngineArgs(model=checkpoint, device="cpu", mm_processor_kwargs=kwargs
                   ).create_engine_config()  # fmt: skip


def test_pan_and_scan_ratio_may_be_an_integer(checkpoint):
    """``pan_and_scan_min_ratio_to_activate`` written as a JSON integer (``2``) is read as
    that number (transformers' strict check refuses an int for the float field)."""
    from tokenmill.engine_args import EngineArgs
    from tokenmill.multimodal.processor import MultiModalProcessor

    kwargs = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16,
              "pan_and_scan_min_ratio_to_activate": 2}  # fmt: skip
    config = EngineArgs(model=checkpoint, device="cpu", mm_processor_kwargs=kwargs
                        ).create_engine_config().model_config  # fmt: skip
    mm = MultiModalProcessor(checkpoint, config.hf_config, {"image": 2}, kwargs)
    _, features = mm.process([mm.placeholder_token_id], [random_image(0, 30, 90)])
    assert len(features) == 1 + 3  # ratio 3, above 2: the image and three crops
    _, features = mm.process([mm.placeholder_token_id], [random_image(0, 50, 90)])
    assert len(features) == 1  # ratio 1.8, below 2


def test_an_image_the_processor_fails_on_is_an_invalid_request(checkpoint, monkeypatch):
    """Any exception of the image processor on one image (not only ValueError) refuses
    that image as invalid input: a 400 on the server, not a 500."""
    from tokenmill.engine_args import EngineArgs
    from tokenmill.multimodal.media import MediaError
    from tokenmill.multimodal.processor import MultiModalProcessor

    config = EngineArgs(model=checkpoint, device="cpu").create_engine_config().model_config
    mm = MultiModalProcessor(checkpoint, config.hf_config, {"image": 1})

    def fail(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(type(mm.image_processor), "__call__", fail)
    with pytest.raises(MediaError, match="refused the image: .*division by zero"):
        mm.process([mm.placeholder_token_id], [random_image(0, 30, 90)])


def test_a_beam_search_prompt_with_image_tokens_and_no_image_is_refused(checkpoint):
    """Beam search takes no images; a prompt holding ``<image_soft_token>`` itself is
    refused as ``generate`` refuses it (the beams ran on the placeholder's embedding)."""
    from tokenmill.engine.input_processor import InvalidRequestError
    from tokenmill.sampling_params import BeamSearchParams

    llm = LLM(model=checkpoint, dtype="float32", device="cpu", max_model_len=256)
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    with pytest.raises(InvalidRequestError, match="image placeholder token"):
        llm.beam_search(["<image_soft_token>Hi"], params)
    assert len(llm.beam_search(["Hi"], params)[0].sequences) == 2

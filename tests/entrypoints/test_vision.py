"""Images through the OpenAI API: a Qwen2.5-VL server answers the openai SDK's base64
images as ``LLM.chat`` does, counts the repeated image in its encoder- and prefix-cache
metrics, and answers unusable images (and images with beam search) with a 400 naming the
field."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from tests.entrypoints.conftest import server_fixture
from tests.model.vlm_checkpoints import write_qwen2_5_vl

pytestmark = pytest.mark.slow


def png_data_url(seed: int, height: int = 112, width: int = 112, mode: str = "RGB") -> str:
    from PIL import Image

    if mode == "RGB":
        pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
        image = Image.fromarray(pixels)
    else:
        image = Image.new(mode, (width, height))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(*urls: str, text: str = "What is this?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory) -> str:
    return write_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl_server")))


@pytest.fixture(scope="module")
def vl_server(vl_model):
    yield from server_fixture(
        [vl_model, "--dtype", "float32", "--max-model-len", "1024",
         "--limit-mm-per-prompt", '{"image": 2}']
    )  # fmt: skip


def test_openai_sdk_base64_image_gets_llm_chat_text(vl_server, vl_model, tmp_path):
    """The SDK's base64 image and LLM.chat agree; LLM.chat reads the same image from a file
    URL under allowed_local_media_path alike."""
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    url = png_data_url(0)
    messages = image_message(url, text="Describe it.")
    reply = vl_server.openai().chat.completions.create(
        model=vl_model.rstrip("/").split("/")[-1], messages=messages, max_tokens=12,
        temperature=0,
    )  # fmt: skip
    llm = LLM(model=vl_model, dtype="float32", device="cpu", max_model_len=1024,
              allowed_local_media_path=str(tmp_path))  # fmt: skip
    greedy = SamplingParams(max_tokens=12, temperature=0)
    out = llm.chat(messages, greedy, use_tqdm=False)[0]
    assert reply.choices[0].message.content == out.outputs[0].text
    assert reply.usage.prompt_tokens == len(out.prompt_token_ids)
    (tmp_path / "image.png").write_bytes(base64.b64decode(url.split(",", 1)[1]))
    from_file = image_message((tmp_path / "image.png").as_uri(), text="Describe it.")
    assert llm.chat(from_file, greedy, use_tqdm=False)[0].outputs[0].text == out.outputs[0].text


def test_a_repeated_image_shows_in_the_encoder_and_prefix_cache_metrics(vl_server):
    client = vl_server.openai()
    model = client.models.list().data[0].id
    url = png_data_url(1)

    def ask(before_image: str) -> None:
        messages = [{"role": "user", "content": [
            {"type": "text", "text": before_image},
            {"type": "image_url", "image_url": {"url": url}},
        ]}]  # fmt: skip
        client.chat.completions.create(model=model, max_tokens=2, messages=messages)

    before = vl_server.metrics()
    ask("First question:")
    ask("Second question:")  # another prefix: the image's KV is not cached, its encoding is
    middle = vl_server.metrics()
    ask("First question:")  # the same prompt: the prefix cache serves the image's blocks
    after = vl_server.metrics()

    def grew(name: str, a: dict, b: dict) -> float:
        return b[name] - a.get(name, 0.0)

    assert grew("tokenmill:mm_cache_queries_total", before, middle) == 2
    assert grew("tokenmill:mm_cache_hits_total", before, middle) == 1
    assert grew("tokenmill:prefix_cache_hits_total", middle, after) >= 16  # the image's blocks
    assert grew("tokenmill:mm_cache_queries_total", middle, after) == 0


@pytest.mark.parametrize(
    "urls, field, words",
    [
        (["data:image/png;base64,aGVsbG8="], "messages.0.content.0.image_url", "decoded"),
        (["data:image/png;base64,%%%"], "messages.0.content.0.image_url", "base64"),
        (["https://example.com/cat.png"], "messages.0.content.0.image_url",
         "--allowed-media-domains"),
        (["file:///etc/passwd"], "messages.0.content.0.image_url",
         "--allowed-local-media-path"),
        (["ftp://example.com/cat.png"], "messages.0.content.0.image_url", "scheme"),
        ([png_data_url(0, 8000, 6000, mode="1")], "messages.0.content.0.image_url", "pixels"),
        ([png_data_url(2)] * 3, "messages", "at most 2 image"),
        # counted before any is loaded: the refused host is not the error
        (["https://example.com/cat.png"] * 3, "messages", "at most 2 image"),
    ],
)  # fmt: skip
def test_unusable_images_are_a_400_naming_the_field(vl_server, urls, field, words):
    model = vl_server.get("/v1/models").json()["data"][0]["id"]
    r = vl_server.post(
        "/v1/chat/completions", {"model": model, "messages": image_message(*urls), "max_tokens": 2}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and words in error["message"], error
    assert vl_server.get("/health").status_code == 200


def test_request_mm_processor_kwargs_are_refused(vl_server):
    model = vl_server.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": image_message(png_data_url(4)), "max_tokens": 2,
            "mm_processor_kwargs": {"max_pixels": 3136}}  # fmt: skip
    r = vl_server.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "mm_processor_kwargs"


def test_a_text_only_model_refuses_images(default_server):
    r = default_server.post(
        "/v1/chat/completions",
        {"model": "SmolLM2-135M-Instruct", "messages": image_message(png_data_url(3)),
         "max_tokens": 2},
    )  # fmt: skip
    assert r.status_code == 400
    error = r.json()["error"]
    assert "does not take images" in error["message"]
    assert error["param"] == "messages.0.content.0.image_url"


def test_beam_search_with_images_is_a_400(vl_server):
    model = vl_server.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": image_message(png_data_url(5)), "max_tokens": 2,
            "n": 2, "use_beam_search": True}  # fmt: skip
    r = vl_server.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "multi_modal_data"
    assert vl_server.get("/health").status_code == 200


def test_truncate_prompt_tokens_with_images_is_a_400(vl_server):
    """Truncating a prompt with images would cut the placeholders that the images'
    features point at (the engine died on the first step of such a request)."""
    body = {"messages": image_message(png_data_url(6)), "max_tokens": 2,
            "truncate_prompt_tokens": 10}  # fmt: skip
    r = vl_server.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "truncate_prompt_tokens"
    del body["truncate_prompt_tokens"]
    assert vl_server.post("/v1/chat/completions", body).status_code == 200


def test_tokenize_counts_an_images_placeholders(vl_server):
    """/tokenize of a conversation with an image gives the prompt the engine gets: the
    image's placeholder tokens expanded, as the usage of a chat request counts them."""
    messages = image_message(png_data_url(3))
    r = vl_server.post("/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    chat = vl_server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]


def test_image_placeholders_without_an_image_are_a_400(vl_server, vl_model):
    """A completion prompt holding the image token but no image is refused, as chat refuses
    a count of placeholders other than the images'."""
    import json

    token = json.load(open(f"{vl_model}/config.json"))["image_token_id"]
    r = vl_server.post("/v1/completions", {"prompt": [1, token, 2], "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert "image placeholder" in r.json()["error"]["message"]


def test_anthropic_image_blocks_get_the_chat_text(vl_server, vl_model):
    """/v1/messages: a base64 image block before the text is the chat request's image part
    before the text (the same greedy answer)."""
    import httpx

    url = png_data_url(5)
    model = vl_model.rstrip("/").split("/")[-1]
    chat = vl_server.openai().chat.completions.create(
        model=model, messages=image_message(url, text="Name it."), max_tokens=8, temperature=0)
    media, data = url.removeprefix("data:").split(";base64,")
    body = {"model": model, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user",
            "content": [{"type": "image", "source": {"type": "base64", "media_type": media,
                                                     "data": data}},
                        {"type": "text", "text": "Name it."}]}]}  # fmt: skip
    reply = httpx.post(vl_server.url + "/v1/messages", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["content"][0]["text"] == chat.choices[0].message.content


def test_responses_input_image_gets_the_chat_text(vl_server, vl_model):
    """/v1/responses: an ``input_image`` part before the text is the chat request's image
    part before the text (the same greedy answer)."""
    url = png_data_url(6)
    model = vl_model.rstrip("/").split("/")[-1]
    chat = vl_server.openai().chat.completions.create(
        model=model, messages=image_message(url, text="Name it."), max_tokens=8, temperature=0)
    body = {"model": model, "max_output_tokens": 8, "temperature": 0, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": url},
                                     {"type": "input_text", "text": "Name it."}]}]}  # fmt: skip
    reply = vl_server.post("/v1/responses", body)
    assert reply.status_code == 200, reply.text
    [message] = [o for o in reply.json()["output"] if o["type"] == "message"]
    assert message["content"][0]["text"] == chat.choices[0].message.content

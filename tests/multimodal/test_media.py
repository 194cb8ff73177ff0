"""Image loading and limits: data URLs in PNG / JPEG / WebP, the byte, pixel and count
bounds, URL allow-listing, and the processor's placeholder expansion."""

from __future__ import annotations

import base64
import io
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from tokenmill.hf_config import HFConfig
from tokenmill.multimodal import media
from tokenmill.multimodal.config import (
    MultiModalConfigError,
    build_multimodal_config,
    parse_limit_mm_per_prompt,
    parse_mm_processor_kwargs,
)
from tokenmill.multimodal.media import MediaError, load_image_url, split_chat_images


def encoded(fmt: str, size: tuple[int, int] = (32, 24), mode: str = "RGB") -> bytes:
    from PIL import Image

    image = Image.new(mode, size, color=0 if mode == "1" else (10, 200, 30))
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def encoded_image(image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_data_urls_of_each_format_decode_to_rgb(fmt):
    image = load_image_url(data_url(encoded(fmt), f"image/{fmt.lower()}"))
    assert image.mode == "RGB" and image.size == (32, 24)


def test_phone_jpegs_and_any_spelling_of_a_data_url_are_read():
    """A JPEG holding two pictures (MPO: phone cameras write them) was refused as an
    unsupported format; so were data URLs spelled in capitals (RFC 2397's scheme, media
    type and parameter are case-insensitive)."""
    from PIL import Image

    buf = io.BytesIO()
    first, second = Image.new("RGB", (32, 24), (200, 0, 0)), Image.new("RGB", (32, 24))
    first.save(buf, format="MPO", save_all=True, append_images=[second])
    image = load_image_url(data_url(buf.getvalue(), "image/jpeg"))
    assert image.size == (32, 24) and image.getpixel((5, 5))[0] > 150
    payload = base64.b64encode(encoded("PNG")).decode()
    assert load_image_url("DATA:IMAGE/PNG;BASE64," + payload).size == (32, 24)


@pytest.mark.parametrize(
    "url, words",
    [
        ("data:image/png;base64,aGVsbG8=", "cannot be decoded"),
        ("data:image/png;base64,***", "not valid base64"),
        ("data:text/plain;base64,aGVsbG8=", "not an image"),
        ("data:image/png,rawbytes", "data:image/png;base64"),
        (data_url(encoded("GIF"), "image/gif"), "not supported"),
        (data_url(encoded("PNG")[:60]), "cannot be decoded"),
        ("ftp://host/x.png", "scheme"),
        ("", "non-empty"),
    ],
)
def test_unusable_images_raise_a_clear_media_error(url, words):
    with pytest.raises(MediaError, match=words):
        load_image_url(url)


def test_byte_and_pixel_bounds(monkeypatch):
    with pytest.raises(MediaError, match="pixels"):
        load_image_url(data_url(encoded("PNG", (8000, 6000), mode="1")))
    # A ~100-byte PNG whose header claims 100,000 x 100,000 pixels (past PIL's own bomb
    # limit, which is checked when the file is opened).
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body))

    bomb = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000,
                                                           8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    with pytest.raises(MediaError, match="pixels allowed"):
        load_image_url("data:image/png;base64," + base64.b64encode(bomb).decode())
    monkeypatch.setattr(media, "MAX_IMAGE_BYTES", 100)
    with pytest.raises(MediaError, match="bytes"):
        load_image_url(data_url(encoded("PNG", (64, 64))))


def test_images_are_upright_and_transparent_pixels_white():
    """The model sees an image as viewers show it (vLLM's rules): turned as its EXIF
    orientation says, and with transparent pixels composited onto white; they were seen
    sideways, and transparent pixels as the color stored under them (mostly black)."""
    from PIL import Image

    from tokenmill.multimodal.media import check_image

    # 40 wide, 80 tall: left half red, right half blue; tagged "rotate 90 degrees clockwise
    # to view" (phone cameras' portrait photos), the left half comes out on top.
    pixels = np.zeros((80, 40, 3), dtype=np.uint8)
    pixels[:, :20] = (255, 0, 0)
    pixels[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", exif=exif.tobytes(), quality=95)
    image = load_image_url(data_url(buf.getvalue(), "image/jpeg"))
    assert image.size == (80, 40)
    top, bottom = image.getpixel((40, 5)), image.getpixel((40, 35))
    assert top[0] > 200 > top[2] and bottom[2] > 200 > bottom[0]

    clear = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    half = Image.new("RGBA", (8, 8), (255, 0, 0, 128))
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([0, 0, 0] * 256)
    for im, fmt, rgb in [(clear, "PNG", (255, 255, 255)), (half, "WEBP", (255, 127, 127)),
                         (clear.convert("LA"), "PNG", (255, 255, 255))]:  # fmt: skip
        got = load_image_url(data_url(encoded_image(im, fmt), f"image/{fmt.lower()}"))
        assert all(abs(a - b) <= 2 for a, b in zip(got.getpixel((3, 3)), rgb, strict=True))
    buf = io.BytesIO()
    palette.save(buf, format="PNG", transparency=0)
    assert load_image_url(data_url(buf.getvalue())).getpixel((3, 3)) == (255, 255, 255)
    assert check_image(clear).getpixel((0, 0)) == (255, 255, 255)  # in-memory images alike
    with pytest.raises(MediaError, match="mode La"):
        check_image(Image.new("La", (8, 8)))


def test_thin_images_are_refused_before_a_processor_resizes_them():
    """An aspect ratio above 200 is refused for every model: LLaVA's processor scales the
    shorter side up to its crop size, so a small 1 x 1,000,000 PNG became a
    56 x 56,000,000 array (over 1 GB per 20,000 pixels of length)."""
    from PIL import Image

    from tokenmill.multimodal.media import check_image

    assert load_image_url(data_url(encoded("PNG", (1, 200), mode="1"))).size == (1, 200)
    for size in [(1, 201), (1_000_000, 1)]:
        with pytest.raises(MediaError, match="aspect ratio"):
            load_image_url(data_url(encoded("PNG", size, mode="1")))
        with pytest.raises(MediaError, match="aspect ratio"):
            check_image(Image.new("1", size))


class _PNGHandler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/garbage":  # not an HTTP response
            self.wfile.write(b"garbage\r\n\r\n")
            return
        if self.path == "/drip":  # a byte every 0.2 s, until the client hangs up
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b"\x89")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                return
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1/elsewhere.png")
            self.end_headers()
            return
        body = encoded("PNG")
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PNGHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_urls_are_fetched_only_from_allowed_hosts_without_redirects(image_host):
    with pytest.raises(MediaError, match="--allowed-media-domains"):
        load_image_url(image_host + "/a.png")
    with pytest.raises(MediaError, match="not in --allowed-media-domains"):
        load_image_url(image_host + "/a.png", ("example.com",))
    assert load_image_url(image_host + "/a.png", ("127.0.0.1",)).size == (32, 24)
    with pytest.raises(MediaError, match="could not be fetched"):
        load_image_url(image_host + "/moved", ("127.0.0.1",))


def test_a_broken_or_slow_image_server_is_a_media_error_within_the_time_bound(
    image_host, monkeypatch
):
    """A reply that is not HTTP was an internal error (a 500); a server sending a byte at
    a time held the request for as long as it kept sending (each read waited for 64 KiB)."""
    with pytest.raises(MediaError, match="could not be fetched"):
        load_image_url(image_host + "/garbage", ("127.0.0.1",))
    monkeypatch.setattr(media, "FETCH_TIMEOUT_S", 1.0)
    start = time.monotonic()
    with pytest.raises(MediaError, match="took more than 1 s"):
        load_image_url(image_host + "/drip", ("127.0.0.1",))
    assert time.monotonic() - start < 5


def test_chat_image_parts_become_template_image_parts():
    from PIL import Image

    pil = Image.new("RGB", (4, 4))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": data_url(encoded("PNG"))}},
            {"type": "image_pil", "image_pil": pil},
        ]},
    ]  # fmt: skip
    conv, images = split_chat_images(messages)
    assert conv[0] == messages[0]
    assert conv[1]["content"] == [{"type": "text", "text": "a"}, {"type": "image"},
                                  {"type": "image"}]  # fmt: skip
    assert [im.size for im in images] == [(32, 24), (4, 4)]


def test_limit_mm_per_prompt_parsing():
    assert parse_limit_mm_per_prompt('{"image": 3}') == {"image": 3}
    assert parse_limit_mm_per_prompt({"image": {"count": 2}}) == {"image": 2}
    assert parse_limit_mm_per_prompt(None) == {"image": 999}
    assert parse_limit_mm_per_prompt('{"image": 1, "video": 0}') == {"image": 1}
    for bad in ('{"video": 1}', '{"image": -1}', "[1]", "{"):
        with pytest.raises(MultiModalConfigError):
            parse_limit_mm_per_prompt(bad)


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory) -> str:
    from tests.model.vlm_checkpoints import write_qwen2_5_vl

    return write_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl")))


def test_processor_expands_placeholders_and_counts_images(qwen_path):
    from PIL import Image

    from tokenmill.hf_config import load_hf_config
    from tokenmill.multimodal.processor import MultiModalProcessor

    path = qwen_path
    config, _ = load_hf_config(path)
    proc = MultiModalProcessor(path, config, {"image": 1})
    tok = config.image_token_id
    rng = np.random.RandomState(0)
    image = Image.fromarray(rng.randint(0, 256, (56, 112, 3), dtype=np.uint8))
    ids, features = proc.process([1, tok, 2], [image])
    assert ids == [1] + [tok] * 8 + [2]  # a 4x8 patch grid, 2x2 patches per placeholder
    assert (features[0].offset, features[0].length) == (1, 8)
    assert features[0].data["pixel_values"].unpack().shape == (32, 1176)
    with pytest.raises(MediaError, match="at most 1 image"):
        proc.process([tok, tok], [image, image])
    with pytest.raises(MediaError, match="placeholder"):
        proc.process([1, 2], [image])
    # What the model's own processor refuses (Qwen2-VL: an aspect ratio above 200) is a
    # MediaError too (a 400), not an internal error.
    sliver = Image.fromarray(np.zeros((10, 2100, 3), dtype=np.uint8))
    with pytest.raises(MediaError, match="aspect ratio"):
        proc.process([1, tok, 2], [sliver])


def test_images_are_decoded_one_at_a_time_and_no_further_than_the_context(qwen_path):
    """A prompt's images are loaded and processed one by one, each released before the
    next is loaded, and no image is loaded once the prompt reaches the context length: all
    of them were decoded first, so a request of a hundred 36-megapixel PNGs (a few KB each)
    held ~25 GB at once."""
    import gc
    import weakref

    from PIL import Image

    from tokenmill.hf_config import load_hf_config
    from tokenmill.multimodal.processor import MultiModalProcessor

    config, _ = load_hf_config(qwen_path)
    proc = MultiModalProcessor(qwen_path, config, {"image": 50})
    tok = config.image_token_id
    alive: list[weakref.ref] = []
    held_at_load: list[int] = []

    def load(seed: int):
        gc.collect()
        held_at_load.append(sum(ref() is not None for ref in alive))
        image = Image.fromarray(np.full((56, 56, 3), seed, dtype=np.uint8))
        alive.append(weakref.ref(image))
        return image

    ids, features = proc.process([1] + [tok] * 5 + [2], list(range(5)), load=load)
    assert held_at_load == [0] * 5 and [f.length for f in features] == [4] * 5
    assert ids == [1] + [tok] * 20 + [2]
    for num_images, loads in [(10, 2), (40, 0)]:  # 1 + 4 + 4 + 8 + 1 tokens; 42 tokens
        held_at_load.clear()
        with pytest.raises(MediaError, match="maximum context length of 16 tokens"):
            proc.process([1] + [tok] * num_images + [2], list(range(num_images)), max_len=16,
                         load=load)  # fmt: skip
        assert len(held_at_load) == loads


def test_mm_processor_kwargs_reach_the_image_processor_and_bad_ones_are_refused(qwen_path):
    from PIL import Image

    from tokenmill.hf_config import load_hf_config
    from tokenmill.multimodal.processor import MultiModalProcessor

    assert parse_mm_processor_kwargs(None) == {}
    assert parse_mm_processor_kwargs('{"max_pixels": 3136}') == {"max_pixels": 3136}
    for bad in ("[1]", "{"):
        with pytest.raises(MultiModalConfigError, match="--mm-processor-kwargs"):
            parse_mm_processor_kwargs(bad)
    # The arguments the server passes itself: transformers' TypeError for them printed the
    # processor's whole configuration, many lines, instead of naming the key.
    for bad in ('{"images": 1}', '{"return_tensors": "pt"}'):
        with pytest.raises(MultiModalConfigError, match="set by the server") as e:
            parse_mm_processor_kwargs(bad)
        assert "\n" not in str(e.value)

    config, _ = load_hf_config(qwen_path)
    mm = build_multimodal_config(config, qwen_path, True, None, None, '{"max_pixels": 3136}')
    assert mm is not None and mm.processor_kwargs == {"max_pixels": 3136}
    proc = MultiModalProcessor(qwen_path, config, {"image": 1}, mm.processor_kwargs)
    image = Image.fromarray(np.zeros((112, 112, 3), dtype=np.uint8))
    ids, features = proc.process([config.image_token_id], [image])
    assert features[0].length == 4  # 56x56 pixels at most: a 4x4 patch grid, not 8x8
    with pytest.raises(MultiModalConfigError, match="refuses"):
        build_multimodal_config(config, qwen_path, True, None, None, {"no_such_option": 1})

    text_only = HFConfig({"architectures": ["LlamaForCausalLM"]})
    assert build_multimodal_config(text_only, qwen_path, False, None, None, None) is None
    mm = build_multimodal_config(config, qwen_path, True, None, None, None, "")
    assert mm.allowed_local_media_path is None  # vLLM's default "": file URLs refused
    mm = build_multimodal_config(config, qwen_path, True, None, None, None, qwen_path + "/.")
    assert mm.allowed_local_media_path == os.path.realpath(qwen_path)
    with pytest.raises(MultiModalConfigError, match="--allowed-local-media-path .*: not a folder"):
        build_multimodal_config(config, qwen_path, True, None, None, None, qwen_path + "/none")
    for limit, kwargs in [('{"image": 1}', None), (None, {"max_pixels": 3136})]:
        with pytest.raises(MultiModalConfigError, match="does not take images"):
            build_multimodal_config(text_only, qwen_path, False, limit, None, kwargs)


def test_processor_kwargs_that_the_vision_tower_cannot_take_are_refused(tmp_path, qwen_path):
    """Processor arguments that change the crop (LLaVA) or the patches (Qwen2-VL) passed
    the start-up check (one square image), and the first other image killed the engine
    (its encoder refused the pixels). They are refused at start-up, and an image processed
    into a shape the tower does not take is a MediaError."""
    from PIL import Image

    from tests.model.vlm_checkpoints import write_llava
    from tokenmill.hf_config import load_hf_config
    from tokenmill.multimodal.processor import MultiModalProcessor

    llava_path = write_llava(str(tmp_path / "llava"))
    for path, kwargs in [(llava_path, {"do_center_crop": False}), (qwen_path, {"patch_size": 16})]:
        config, _ = load_hf_config(path)
        with pytest.raises(MultiModalConfigError, match="the vision tower takes"):
            build_multimodal_config(config, path, True, None, None, kwargs)
        proc = MultiModalProcessor(path, config, {"image": 1}, kwargs)
        with pytest.raises(MediaError, match="the vision tower takes"):
            proc.process([proc.image_token_id], [Image.new("RGB", (112, 56))])
    config, _ = load_hf_config(llava_path)  # the default crop: any shape becomes 56x56
    proc = MultiModalProcessor(llava_path, config, {"image": 1})
    ids, [feature] = proc.process([proc.image_token_id], [Image.new("RGB", (112, 56))])
    assert feature.data["pixel_values"].unpack().shape == (3, 56, 56)


def test_file_urls_are_read_only_under_the_allowed_folder(tmp_path, monkeypatch):
    """file: URLs (vLLM's --allowed-local-media-path): refused without a folder; read from
    under it; a path or a symbolic link leading out of it, a missing file, a file URL with a
    host and an oversized file are refused with the reason."""
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a b.png").write_bytes(encoded("PNG"))
    outside = tmp_path / "secret.png"
    outside.write_bytes(encoded("PNG"))
    (root / "link.png").symlink_to(outside)
    local = str(root.resolve())
    url = (root / "sub" / "a b.png").as_uri()  # file:///.../a%20b.png
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        load_image_url(url)
    assert load_image_url(url, (), local).size == (32, 24)
    assert load_image_url("file://localhost" + url[len("file://"):], (), local).size == (32, 24)
    for bad, words in [
        (outside.as_uri(), "not under --allowed-local-media-path"),
        (f"file://{root}/../secret.png", "not under --allowed-local-media-path"),
        ((root / "link.png").as_uri(), "not under --allowed-local-media-path"),
        ((root / "none.png").as_uri(), "cannot be read"),
        ((root / "sub").as_uri(), "not a regular file"),
        (f"file://example.com{root}/sub/x.png", "names a host"),
    ]:
        with pytest.raises(MediaError, match=words):
            load_image_url(bad, (), local)
    import os

    os.mkfifo(root / "fifo")  # would block an open() for reading until a writer comes
    with pytest.raises(MediaError, match="not a regular file"):
        load_image_url((root / "fifo").as_uri(), (), local)
    with pytest.raises(MediaError, match="not valid"):
        load_image_url(f"file://{root}/a%00.png", (), local)
    monkeypatch.setattr(media, "MAX_IMAGE_BYTES", 100)
    (root / "big.png").write_bytes(encoded("PNG", (64, 64)))
    with pytest.raises(MediaError, match="bytes"):
        load_image_url((root / "big.png").as_uri(), (), local)


def test_a_vision_encoder_tokenmill_does_not_run_is_refused_naming_those_it_does():
    from types import SimpleNamespace

    from tokenmill.model.registry import multimodal_architectures
    from tokenmill.multimodal.config import build_multimodal_config

    config = SimpleNamespace(architectures=["InternVLForConditionalGeneration"],
                             get=lambda key, default=None: {"vision_config": {}}.get(key, default))
    with pytest.raises(MultiModalConfigError) as e:
        build_multimodal_config(config, "m", False, None, None, None,
                                image_architectures=multimodal_architectures())  # fmt: skip
    assert "InternVLForConditionalGeneration has a vision encoder" in str(e.value)
    assert all(arch in str(e.value) for arch in multimodal_architectures())
    assert "Qwen3VLMoeForConditionalGeneration" in multimodal_architectures()

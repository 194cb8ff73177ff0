"""Loading the images of a request: ``data:`` URLs, http(s) URLs on allowed hosts, ``file:``
URLs under an allowed folder, and PIL images, each bounded in bytes, pixels and (for http(s)
URLs) fetch time.

Formats: PNG, JPEG and WebP (decoded by Pillow). Anything else, a corrupt file or an image
past a bound is a ``MediaError`` whose message says which.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import io
import os
import stat
import urllib.parse
from typing import Any

import numpy as np

# Bounds on one image: its encoded size, its decoded pixels (width * height) and the time
# to fetch it from a URL.
MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 40_000_000
# Longer side / shorter side, as Qwen2-VL's processor bounds it: processors that resize the
# shorter side to a fixed length (CLIP's, LLaVA's) would otherwise blow a thin image up
# (1 x 1,000,000 pixels to 336 x 336,000,000: hundreds of GB).
MAX_ASPECT_RATIO = 200
FETCH_TIMEOUT_S = 10.0
# Pillow's names; MPO is a JPEG holding more than one picture (phone cameras write them:
# the photo and a depth map or a preview), read as its first picture.
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "WEBP")


class MediaError(ValueError):
    """An image that cannot be served: undecodable, too large, or from a refused URL."""


def check_image(image: Any) -> Any:
    """An in-memory image (``PIL.Image.Image``, or a uint8 numpy array of shape ``[H, W]``
    or ``[H, W, C]`` with 1, 3 or 4 channels, as vLLM takes them) as RGB, checked against
    the pixel bound.

    Raises:
        MediaError: neither, more than ``MAX_IMAGE_PIXELS`` pixels, or an aspect ratio above
            ``MAX_ASPECT_RATIO``.
    """
    from PIL import Image

    if isinstance(image, np.ndarray):
        return to_rgb(_from_array(image))
    if not isinstance(image, Image.Image):
        raise MediaError(
            "an image must be a PIL.Image.Image or a uint8 numpy array, got "
            f"{type(image).__name__}"
        )
    _check_pixels(image.size)
    return to_rgb(image)


def _from_array(array: np.ndarray) -> Any:
    """A ``[H, W]`` / ``[H, W, 1|3|4]`` uint8 array as a PIL image (grayscale, RGB, RGBA)."""
    from PIL import Image

    shape = array.shape
    if array.dtype != np.uint8 or not (
        array.ndim == 2 or (array.ndim == 3 and shape[2] in (1, 3, 4))
    ):
        raise MediaError(
            "an image array must be uint8 of shape [height, width] or [height, width, "
            f"channels] with 1, 3 or 4 channels, got {array.dtype} {list(shape)}"
        )
    _check_pixels((shape[1], shape[0]))
    if array.ndim == 3 and shape[2] == 1:
        array = array[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(array))


def to_rgb(image: Any) -> Any:
    """``image`` in mode RGB. One with transparency (an alpha band, or a transparent
    palette or color entry) is composited onto white first, as vLLM does: converting it
    directly would show what lies under its transparent pixels (mostly black).

    Raises:
        MediaError: a mode Pillow cannot convert to RGB.
    """
    from PIL import Image

    if image.mode == "RGB":
        return image
    try:
        if image.mode in ("RGBA", "RGBa", "LA", "PA") or "transparency" in image.info:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except ValueError as e:
        raise MediaError(f"an image of mode {image.mode} cannot be read as RGB: {e}") from None


def _check_pixels(size: tuple[int, int]) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise MediaError(f"the image has no pixels ({width}x{height})")
    if width * height > MAX_IMAGE_PIXELS:
        raise MediaError(
            f"the image is {width}x{height} pixels, more than the {MAX_IMAGE_PIXELS:,} "
            "allowed"
        )
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise MediaError(
            f"the image is {width}x{height} pixels: its aspect ratio is above the "
            f"{MAX_ASPECT_RATIO} allowed"
        )


def decode_image(data: bytes) -> Any:
    """Encoded PNG / JPEG / WebP bytes -> an RGB ``PIL.Image.Image``, turned as its EXIF
    orientation says (as viewers show it) and composited onto white where transparent.

    Raises:
        MediaError: more than ``MAX_IMAGE_BYTES``, another format, or not decodable.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise MediaError(
            f"the image is {len(data):,} bytes, more than the {MAX_IMAGE_BYTES:,} allowed"
        )
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        # PIL's own limit (above ours) is checked on opening, from the header.
        raise MediaError(
            f"the image has more than the {MAX_IMAGE_PIXELS:,} pixels allowed"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise MediaError("the image cannot be decoded (PNG, JPEG or WebP expected)") from None
    if image.format not in IMAGE_FORMATS:
        raise MediaError(f"image format {image.format} is not supported (PNG, JPEG or WebP)")
    _check_pixels(image.size)  # from the header, before the pixels are decoded
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError):
        raise MediaError("the image cannot be decoded (truncated or corrupt data)") from None
    try:
        # Upright as viewers show it (phone photos store the camera's rotation in EXIF).
        image = ImageOps.exif_transpose(image)
    except Exception:  # a corrupt EXIF block: the pixels as stored
        pass
    return to_rgb(image)


def decode_data_url(url: str) -> Any:
    """``data:image/png;base64,...`` -> an RGB image.

    Raises:
        MediaError: not a base64 ``data:image/...`` URL, or see ``decode_image``.
    """
    header, sep, payload = url.partition(",")
    header = header.lower()  # the scheme, media type and ";base64" are case-insensitive
    if not sep or not header.startswith("data:") or not header.endswith(";base64"):
        raise MediaError("a data URL must look like data:image/png;base64,<data>")
    mime = header[len("data:") : -len(";base64")]
    if mime and not mime.startswith("image/"):
        raise MediaError(f"a data URL of type {mime!r} is not an image")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise MediaError(f"the image is more than the {MAX_IMAGE_BYTES:,} bytes allowed")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URL's payload is not valid base64") from None
    return decode_image(data)


def fetch_image(url: str, allowed_domains: tuple[str, ...]) -> Any:
    """Download an http(s) image URL whose host is in ``allowed_domains``.

    At most ``MAX_IMAGE_BYTES`` are read, and the whole download (connection, headers and
    body) ends within ``FETCH_TIMEOUT_S`` seconds however slowly the server sends;
    redirects are not followed (a redirect could leave the allowed hosts).

    Raises:
        MediaError: URLs not allowed (no ``--allowed-media-domains``), a host outside them,
            a failed, malformed or slow download, or see ``decode_image``.
    """
    import yarl

    if not allowed_domains:
        raise MediaError(
            "image URLs are not fetched by this server: send the image as a base64 data URL, "
            "or start the server with --allowed-media-domains"
        )
    try:
        # The host is checked on the very URL object that is fetched.
        parsed = yarl.URL(url)
    except (TypeError, ValueError) as e:
        raise MediaError(f"the image URL is not valid: {e}") from None
    host = (parsed.host or "").lower()
    if host not in allowed_domains:
        raise MediaError(f"the host {host!r} is not in --allowed-media-domains")
    # asyncio.run on a thread of its own: the caller may be running an event loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        data = pool.submit(asyncio.run, _download(parsed)).result()
    return decode_image(data)


async def _download(url: Any) -> bytes:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout, trust_env=True) as session:
            async with session.get(url, allow_redirects=False) as response:
                if not 200 <= response.status < 300:
                    raise MediaError(
                        f"the image could not be fetched: HTTP {response.status} "
                        f"{response.reason or ''}".rstrip()
                    )
                chunks, size = [], 0
                async for chunk in response.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > MAX_IMAGE_BYTES:
                        raise MediaError(
                            f"the image is more than the {MAX_IMAGE_BYTES:,} bytes allowed"
                        )
                    chunks.append(chunk)
    except MediaError:
        raise
    except asyncio.TimeoutError:
        raise MediaError(f"fetching the image took more than {FETCH_TIMEOUT_S:g} s") from None
    except (aiohttp.ClientError, OSError, ValueError) as e:
        raise MediaError(f"the image could not be fetched: {e or type(e).__name__}") from None
    return b"".join(chunks)


def read_local_image(url: str, local_root: str | None) -> Any:
    """A ``file:`` URL's image, read only from under ``local_root`` (a resolved directory).

    Symbolic links are resolved before the check, so a link cannot lead out of the folder.

    Raises:
        MediaError: local files not allowed (no ``--allowed-local-media-path``), a file
            outside the folder, missing or unreadable, or see ``decode_image``.
    """
    if local_root is None:
        raise MediaError(
            "local image files are not read by this server: send the image as a base64 data "
            "URL, or start the server with --allowed-local-media-path"
        )
    parsed = urllib.parse.urlsplit(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"a file URL names a host ({parsed.netloc!r}); file:///path expected")
    try:
        path = os.path.realpath(urllib.parse.unquote(parsed.path))
    except ValueError as e:  # a NUL byte in the path
        raise MediaError(f"the file URL's path is not valid: {e}") from None
    if os.path.commonpath([path, local_root]) != local_root:
        raise MediaError("the file is not under --allowed-local-media-path")
    try:
        # Non-blocking, then checked: a FIFO would otherwise hold the reading thread.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise MediaError(f"the image file cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MediaError("the image path is not a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_IMAGE_BYTES + 1)
        except OSError as e:
            raise MediaError(f"the image file cannot be read: {e.strerror or e}") from None
    return decode_image(data)


def load_image_url(
    url: str, allowed_domains: tuple[str, ...] = (), local_root: str | None = None
) -> Any:
    """An ``image_url`` content part's URL -> an RGB image (``data:``, http(s) or ``file:``).

    Args:
        allowed_domains: hosts http(s) URLs may name (``fetch_image``).
        local_root: the folder ``file:`` URLs may read from (``read_local_image``).

    Raises:
        MediaError: another scheme, or see ``decode_data_url`` / ``fetch_image`` /
            ``read_local_image``.
    """
    if not isinstance(url, str) or not url:
        raise MediaError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return decode_data_url(url)
    if scheme in ("http", "https"):
        return fetch_image(url, allowed_domains)
    if scheme == "file":
        return read_local_image(url, local_root)
    raise MediaError(
        f"image URLs of scheme {scheme!r} are not supported (data:, http(s):, file:)"
    )


def split_chat_images(
    messages: list[dict[str, Any]],
    allowed_domains: tuple[str, ...] = (),
    local_root: str | None = None,
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Replace the image parts of chat messages (``image_url`` with a URL, or vLLM's
    ``image_pil`` with a PIL image) by the template's ``{"type": "image"}`` parts.

    Returns:
        ``(messages for the chat template, the images in order)``.

    Raises:
        MediaError: an image part without an image, or see ``load_image_url``.
    """
    out, images = [], []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(load_image_url(url, allowed_domains, local_root))
            elif kind == "image_pil":
                images.append(check_image(part.get("image_pil")))
            else:
                parts.append(part)
                continue
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images

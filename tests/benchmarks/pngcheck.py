"""Checks that a file is a PNG image written by matplotlib."""

from __future__ import annotations

import struct
import zlib

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, payload) of every chunk; asserts the signature and each chunk's CRC."""
    assert data[:8] == PNG_SIGNATURE, "not a PNG file"
    chunks, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        payload = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + payload) == crc, f"bad CRC in chunk {kind!r}"
        chunks.append((kind, payload))
        pos += 12 + length
    return chunks


def assert_matplotlib_png(path: str) -> tuple[int, int]:
    """Assert ``path`` is a complete PNG whose Software text names matplotlib.

    Returns:
        (width, height) in pixels.
    """
    with open(path, "rb") as f:
        chunks = png_chunks(f.read())
    kinds = [kind for kind, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    texts = dict(payload.split(b"\x00", 1) for kind, payload in chunks if kind == b"tEXt")
    assert b"matplotlib" in texts.get(b"Software", b"").lower(), texts
    width, height = struct.unpack(">II", chunks[0][1][:8])
    return width, height

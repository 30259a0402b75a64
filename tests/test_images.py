"""edgechat/images.py: each format's size from its header, written here byte by byte as each
format lays it out, and a one-line ValueError for anything else."""

from __future__ import annotations

import struct

import pytest
from tiny_mmproj import GRADIENT, png

from edgechat.images import image_size


def jpeg(width: int, height: int, sof: int = 0xC0) -> bytes:
    """SOI, an APP0 segment, a DHT-like table to skip, fill bytes, then the frame header."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0"
    table = b"\xff\xc4" + struct.pack(">H", 5) + b"\0\0\0"
    frame = b"\xff\xff" + bytes([0xFF, sof]) + struct.pack(">HBHHB", 11, 8, height, width, 3) + b"\x01\x22\0"
    return b"\xff\xd8" + app0 + table + frame + b"\xff\xda\0\x08"


def webp(kind: bytes, body: bytes) -> bytes:
    return b"RIFF" + struct.pack("<I", 4 + 8 + len(body)) + b"WEBP" + kind + struct.pack("<I", len(body)) + body


def bmp(width: int, height: int, core: bool = False) -> bytes:
    header = struct.pack("<IHHHH", 12, width, height, 1, 24) if core else struct.pack("<IiiHH", 40, width, height, 1, 24) + bytes(24)
    return b"BM" + struct.pack("<IHHI", 14 + len(header), 0, 0, 14 + len(header)) + header


@pytest.mark.parametrize("data, expected", [
    (GRADIENT, ("image/png", 40, 40)),
    (png(3, 7000, lambda x, y: (0, 0, 0))[:40], ("image/png", 3, 7000)),  # the header alone is read
    (jpeg(640, 480), ("image/jpeg", 640, 480)),
    (jpeg(17, 9000, sof=0xC2), ("image/jpeg", 17, 9000)),  # progressive
    (b"GIF89a" + struct.pack("<HH", 320, 200) + bytes(3), ("image/gif", 320, 200)),
    (b"GIF87a" + struct.pack("<HH", 1, 2), ("image/gif", 1, 2)),
    (webp(b"VP8 ", b"\0\0\0\x9d\x01\x2a" + struct.pack("<HH", 0x4000 | 800, 600)), ("image/webp", 800, 600)),
    (webp(b"VP8L", b"\x2f" + struct.pack("<I", (1023 << 14) | 511)), ("image/webp", 512, 1024)),
    (webp(b"VP8X", bytes(4) + (4999).to_bytes(3, "little") + (2999).to_bytes(3, "little")), ("image/webp", 5000, 3000)),
    (bmp(64, -32), ("image/bmp", 64, 32)),  # top-down
    (bmp(7, 5, core=True), ("image/bmp", 7, 5)),
])
def test_sizes_come_from_the_headers(data, expected):
    assert image_size(data) == expected


@pytest.mark.parametrize("data, words", [
    (b"", "empty"),
    (b"hello, world", "not an image"),
    (GRADIENT[:20], "cut short"),
    (b"\x89PNG\r\n\x1a\n" + bytes(4) + b"IDAT" + bytes(8), "IHDR"),
    (jpeg(640, 480)[:30], "cut short"),
    (b"\xff\xd8\xff\xda\0\x08", "no frame header"),
    (b"\xff\xd8\0\0", "corrupt"),
    (jpeg(0, 480), "0x480"),
    (b"GIF89a\x01", "cut short"),
    (webp(b"VP8 ", bytes(10)), "start code"),
    (webp(b"ALPH", bytes(10)), "unknown chunk"),
    (webp(b"VP8X", bytes(4)), "cut short"),
])
def test_anything_else_is_a_one_line_value_error(data, words):
    with pytest.raises(ValueError) as info:
        image_size(data)
    assert words in str(info.value) and "\n" not in str(info.value)

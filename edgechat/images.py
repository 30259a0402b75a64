"""What a picture file is and how big, from its header alone: PNG, JPEG, GIF, WebP and BMP.

The server checks an image's pixel count before the model's projector decodes it (a small file
can hold a huge picture), and without Pillow: only the few bytes that say the size are read.
"""

from __future__ import annotations

import struct

__all__ = ["DECODED", "image_size", "media_type", "undecoded"]

_PNG = b"\x89PNG\r\n\x1a\n"
#: JPEG markers that start a frame (SOF0-SOF15 less DHT, JPG and DAC): they carry the size
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
#: JPEG markers with no length after them
_STANDALONE = frozenset([0x01, *range(0xD0, 0xD9)])
#: what llama.cpp's image loader (stb_image, in libmtmd) decodes: a WebP's size is read here,
#: but the model could not see it
DECODED = frozenset({"image/png", "image/jpeg", "image/gif", "image/bmp"})


def media_type(head: bytes) -> str | None:
    """The picture format of a file from its first 12 bytes; None for anything else."""
    if head.startswith(_PNG):
        return "image/png"
    if head.startswith(b"\xff\xd8"):
        return "image/jpeg"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    if head[:2] == b"BM" and head[6:10] == b"\0\0\0\0":  # reserved, zero: "BM" alone starts text files too
        return "image/bmp"
    return None


def undecoded(kind: str) -> str | None:
    """Why a picture of media type `kind` cannot go to the model (one line), None when it can."""
    if kind in DECODED:
        return None
    return f"llama.cpp cannot decode {kind.split('/')[-1].upper()} pictures: convert it to PNG or JPEG"


def image_size(data: bytes) -> tuple[str, int, int]:
    """(media type, width, height) of an image's bytes; a one-line ValueError for anything
    that is not one of the formats here, or whose header is cut short or says no size."""
    try:
        media_type, width, height = _read(data)
    except (struct.error, IndexError):
        raise ValueError("the image is cut short: its header ends early") from None
    if width <= 0 or height <= 0:
        raise ValueError(f"the {media_type.split('/')[1].upper()} header says the image is {width}x{height}")
    return media_type, width, height


def _read(data: bytes) -> tuple[str, int, int]:
    kind = media_type(data[:12])
    if kind == "image/png":
        width, height = struct.unpack(">II", data[16:24])
        if data[12:16] != b"IHDR":
            raise ValueError("the PNG is corrupt: it has no IHDR header where one belongs")
        return kind, width, height
    if kind == "image/jpeg":
        return (kind, *_jpeg(data))
    if kind == "image/gif":
        width, height = struct.unpack("<HH", data[6:10])
        return kind, width, height
    if kind == "image/webp":
        return (kind, *_webp(data))
    if kind == "image/bmp":
        header = struct.unpack("<I", data[14:18])[0]
        if header == 12:  # the old OS/2 header: 16-bit sizes
            width, height = struct.unpack("<HH", data[18:22])
        else:
            width, height = struct.unpack("<ii", data[18:26])
        return kind, width, abs(height)  # a negative height is a top-down bitmap
    if not data:
        raise ValueError("the image is empty")
    raise ValueError("not an image this server reads: send a PNG, JPEG, GIF or BMP")


def _jpeg(data: bytes) -> tuple[int, int]:
    at = 2
    while True:
        if data[at] != 0xFF:
            raise ValueError("the JPEG is corrupt: a segment does not start with a marker")
        while data[at] == 0xFF:  # fill bytes before a marker
            at += 1
        marker = data[at]
        at += 1
        if marker in _STANDALONE:
            continue
        if marker == 0xDA:  # start of scan: the picture's data, and no frame header before it
            raise ValueError("the JPEG is corrupt: it has no frame header before its data")
        (length,) = struct.unpack(">H", data[at:at + 2])
        if marker in _SOF:
            height, width = struct.unpack(">HH", data[at + 3:at + 7])
            return width, height
        if length < 2:
            raise ValueError("the JPEG is corrupt: a segment's length is too small")
        at += length


def _webp(data: bytes) -> tuple[int, int]:
    kind, body = data[12:16], data[20:]
    if kind == b"VP8 ":  # lossy: a 3-byte frame tag, the start code, then 14-bit sizes
        if body[3:6] != b"\x9d\x01\x2a":
            raise ValueError("the WebP is corrupt: its VP8 frame has no start code")
        width, height = struct.unpack("<HH", body[6:10])
        return width & 0x3FFF, height & 0x3FFF
    if kind == b"VP8L":  # lossless: a signature byte, then width-1 and height-1 in 14 bits each
        if body[0] != 0x2F:
            raise ValueError("the WebP is corrupt: its VP8L frame has no signature")
        (bits,) = struct.unpack("<I", body[1:5])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8X":  # extended: flags, then the canvas's width-1 and height-1 in 24 bits each
        if len(body) < 10:
            raise IndexError
        return int.from_bytes(body[4:7], "little") + 1, int.from_bytes(body[7:10], "little") + 1
    raise ValueError(f"the WebP is corrupt: unknown chunk {kind!r}")

"""An encoded image's pixel size read from its header, without decoding it: the decompression-bomb guard.

A PNG of under 1 MiB can hold 30,000 x 30,000 pixels, which decode to 2.7 GB of RGB (measured here: 3.3 GB
peak RSS, 4 s): web-scraped captions data holds such files, and one can take a loader's process, or under
the embedded runtime the trainer itself, out of memory. Reading the size from the header costs a few
microseconds (pillow's ``Image.open`` costs 20-140 us per image), so every image is checked before decoding.
"""

from __future__ import annotations

import struct

__all__ = ["image_size"]

# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic): the frame's size follows them
_JPEG_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def image_size(raw: bytes) -> tuple[int, int] | None:
    """``(width, height)`` of a PNG, JPEG, GIF or WebP file from its header; None for another format or a
    header too short or malformed to tell (the decoder then reports what is wrong)."""
    try:
        if raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR":
            return struct.unpack(">II", raw[16:24])
        if raw[:2] == b"\xff\xd8":
            return _jpeg_size(raw)
        if raw[:6] in (b"GIF87a", b"GIF89a"):
            return struct.unpack("<HH", raw[6:10])
        if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
            return _webp_size(raw)
    except (struct.error, IndexError):
        return None
    return None


def _jpeg_size(raw: bytes) -> tuple[int, int] | None:
    """The size in the first start-of-frame segment, walking the segments before it by their lengths."""
    i, n = 2, len(raw)
    while i + 4 <= n:
        if raw[i] != 0xFF:
            return None
        marker = raw[i + 1]
        if marker == 0xFF:                   # fill byte
            i += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:     # markers without a length
            i += 2
            continue
        if marker in _JPEG_SOF:
            height, width = struct.unpack(">HH", raw[i + 5:i + 9])
            return width, height
        if marker in (0xD9, 0xDA):           # end of image, start of scan: no frame header before them
            return None
        i += 2 + struct.unpack(">H", raw[i + 2:i + 4])[0]
    return None


def _webp_size(raw: bytes) -> tuple[int, int] | None:
    """The canvas size of an extended (``VP8X``), lossy (``VP8 ``) or lossless (``VP8L``) WebP file."""
    chunk = raw[12:16]
    if chunk == b"VP8X":
        w, h = int.from_bytes(raw[24:27], "little"), int.from_bytes(raw[27:30], "little")
        return w + 1, h + 1
    if chunk == b"VP8 ":
        w, h = struct.unpack("<HH", raw[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L":
        bits = int.from_bytes(raw[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None

"""``ImageText``: the image-caption sample transform: decode, NaViT-style resize to whole patches, tokenize.

Images keep their aspect ratio (no square crop), are scaled down to fit ``max_side`` and snapped to a
multiple of ``patch`` per side, so the Planner can cost each sample by its patch count (paper section 3).
"""

from __future__ import annotations

import io
import math
import os
from typing import Any, Mapping

import numpy as np
import torch

from ..errors import ConfigError, OverlordError
from .image_header import image_size
from .tokenize import Tokenize, row_field, row_text


class ImageDecodeError(OverlordError, ValueError):
    """Image bytes that neither torchvision nor pillow can decode (corrupt, truncated or unknown format)."""


def _last_line(err: BaseException) -> str:
    lines = [s.strip() for s in str(err).strip().splitlines() if s.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"


def _as_uint8_tensor(data: Any) -> torch.Tensor:
    """Encoded bytes as a 1-D uint8 tensor (a copy, so read-only ``bytes`` need no warning suppression)."""
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8:
            raise TypeError(f"an encoded image tensor must be uint8, got {data.dtype}")
        return data.reshape(-1).cpu()
    if isinstance(data, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8).copy())
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"image must be bytes (encoded JPEG/PNG/...), got {type(data).__name__}")
    buf = bytearray(data)
    if not buf:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8)


def _pillow_rgb(raw: bytes) -> torch.Tensor:
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(raw)) as img:
        img = ImageOps.exif_transpose(img).convert("RGB")
        return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).contiguous()


def _webp_with_exif(encoded: torch.Tensor) -> bool:
    """Whether ``encoded`` is a WebP file (``RIFF....WEBP``) with an EXIF chunk (``VP8X`` flag bit 3)."""
    head = encoded[:21].numpy().tobytes()
    return len(head) == 21 and head[:4] == b"RIFF" and head[8:16] == b"WEBPVP8X" and bool(head[20] & 0x08)


def _struct_bytes(image: Mapping[str, Any], field: str) -> bytes:
    """The encoded bytes of a Hugging Face ``datasets`` image struct (``{"bytes", "path"}``, how its Parquet
    files store an ``Image`` column): its bytes, else the file its path names."""
    if image.get("bytes") is not None:
        return image["bytes"]
    path = image.get("path")
    if path is None:
        raise TypeError(f"ImageText: field {field!r} is a struct with fields {sorted(image)}, expected encoded image "
                        f"bytes or a Hugging Face image struct with non-null 'bytes' or 'path'")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ImageDecodeError(f"ImageText: field {field!r} holds no bytes, and its path {path!r} cannot be read "
                               f"({type(e).__name__}: {e}); embed the images in the Parquet files (datasets: "
                               f"embed_external_files) or make the path readable from every loader process") from e


MAX_PIXELS = 89_478_485     # pillow's own decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``): 268 MB of RGB


def decode_rgb(data: Any, max_pixels: int | None = MAX_PIXELS) -> torch.Tensor:
    """Decode encoded image bytes to a ``3xHxW`` uint8 RGB tensor: torchvision first, pillow for other formats.
    An image whose header says it has more than ``max_pixels`` pixels (None: no limit) is an
    :class:`ImageDecodeError` before anything is decoded (:mod:`.image_header`)."""
    from torchvision.io import ImageReadMode, decode_image

    encoded = _as_uint8_tensor(data)
    if encoded.numel() == 0:
        raise ImageDecodeError("image could not be decoded by torchvision or pillow: the image bytes are empty")
    size = image_size(memoryview(encoded.numpy())) if max_pixels is not None else None
    if size is not None and size[0] * size[1] > max_pixels:
        raise ImageDecodeError(f"image of {size[0]} x {size[1]} = {size[0] * size[1]:,} pixels (its header says) is "
                               f"over max_pixels={max_pixels:,}, so it is not decoded (a decompression bomb takes "
                               f"{3 * size[0] * size[1] / 2**30:.1f} GiB as RGB); raise ImageText(max_pixels=...) "
                               f"if such images are wanted")
    if _webp_with_exif(encoded):       # torchvision's WebP decoder ignores the EXIF orientation; pillow applies it
        return _pillow_rgb(encoded.numpy().tobytes())
    try:
        img = decode_image(encoded, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except Exception as tv_err:  # unknown format or corrupt data: give pillow its chance
        try:
            return _pillow_rgb(encoded.numpy().tobytes())
        except Exception as pil_err:
            raise ImageDecodeError(
                f"image could not be decoded by torchvision or pillow ({encoded.numel()} bytes, starting "
                f"{encoded[:8].numpy().tobytes()!r}): torchvision said {_last_line(tv_err)}; "
                f"pillow said {_last_line(pil_err)}") from pil_err
    if img.dim() == 4:                 # an animated GIF: every frame; its first is the image (as pillow shows it)
        img = img[0]
    if img.dtype != torch.uint8:  # 16-bit PNG
        from torchvision.transforms.v2.functional import to_dtype

        img = to_dtype(img, torch.uint8, scale=True)
    return img


def navit_size(height: int, width: int, patch: int, max_side: int, min_side: int | None = None) -> tuple[int, int]:
    """Target ``(H, W)``: aspect kept, longer side <= ``max_side``, shorter side >= ``min_side`` if that fits
    (``max_side`` wins), each side rounded to a multiple of ``patch`` and at least one patch."""
    scale = min(1.0, max_side / max(height, width))
    if min_side is not None and min(height, width) * scale < min_side:
        scale = min(min_side / min(height, width), max_side / max(height, width))
    cap = max_side // patch

    def snap(side: int) -> int:
        return min(cap, max(1, math.floor(side * scale / patch + 0.5))) * patch

    return snap(height), snap(width)


class ImageText:
    """``row -> {"pixels", "grid", "patches", "image_patches", "input_ids", "tokens", "truncated", "orig_size"}``.

    One image per row: ``pixels`` is ``3xHxW`` uint8 with H, W multiples of ``patch``; ``grid`` is
    ``(H // patch, W // patch)``; ``image_patches`` lists per-image patch counts for the Planner's costs.
    The image field holds the encoded bytes, or a Hugging Face ``datasets`` image struct
    ``{"bytes", "path"}`` (its bytes, else the file at its path). An image of more than ``max_pixels``
    pixels (pillow's limit by default; None: none) fails its row before it is decoded, as a corrupt one does
    (skipped and counted under ``on_error="skip"``): a small file can decode to gigabytes.
    Text is tokenized exactly as :class:`Tokenize` does. ``preload``: what the rpc runtime's fork server
    imports for it, so a loader actor started mid-run (a reshard, a recovery) decodes at once.
    """

    preload = ("torchvision.io", "torchvision.transforms.v2.functional")

    def __init__(self, model: str | os.PathLike, image_field: str = "image", text_field: str = "text",
                 patch: int = 14, max_side: int = 448, min_side: int | None = None, add_bos: bool = True,
                 add_eos: bool = True, max_tokens: int | None = None, max_pixels: int | None = MAX_PIXELS):
        if patch < 1 or max_side < patch:
            raise ConfigError(f"ImageText: need 1 <= patch <= max_side, got patch={patch}, max_side={max_side}")
        if min_side is not None and not 1 <= min_side <= max_side:
            raise ConfigError(f"ImageText: need 1 <= min_side <= max_side, got min_side={min_side}")
        self.tokenizer = Tokenize(model, field=text_field, add_bos=add_bos, add_eos=add_eos, max_tokens=max_tokens)
        self.model = self.tokenizer.model
        self.image_field, self.text_field = image_field, text_field
        if max_pixels is not None and (isinstance(max_pixels, bool) or not isinstance(max_pixels, int)
                                       or max_pixels < 1):
            raise ConfigError(f"ImageText: max_pixels must be a positive int or None (no limit), got {max_pixels!r}")
        self.patch, self.max_side, self.min_side = int(patch), int(max_side), min_side
        self.max_pixels = max_pixels
        self.columns = (image_field, text_field)

    def resize(self, img: torch.Tensor) -> torch.Tensor:
        """Resize a decoded ``3xhxw`` uint8 image to its NaViT size (whole patches, aspect kept)."""
        from torchvision.transforms.v2.functional import resize

        size = navit_size(img.shape[-2], img.shape[-1], self.patch, self.max_side, self.min_side)
        if tuple(img.shape[-2:]) == size:
            return img
        return resize(img, list(size), antialias=True)

    def __call__(self, row: Mapping[str, Any]) -> dict:
        text = row_text(row, self.text_field, "ImageText")
        data = row_field(row, self.image_field, "ImageText")
        if isinstance(data, Mapping):
            data = _struct_bytes(data, self.image_field)
        if data is None:
            raise TypeError(f"ImageText: field {self.image_field!r} is null (None), expected encoded image bytes")
        try:
            img = decode_rgb(data, self.max_pixels)
        except ImageDecodeError as e:
            raise ImageDecodeError(f"ImageText: field {self.image_field!r}: {e}") from e.__cause__
        pixels = self.resize(img)
        h, w = pixels.shape[-2] // self.patch, pixels.shape[-1] // self.patch
        return {"pixels": pixels, "grid": (h, w), "patches": h * w, "image_patches": [h * w],
                "orig_size": (img.shape[-2], img.shape[-1]), **self.tokenizer.encode(text)}

    def __repr__(self) -> str:
        t = self.tokenizer
        return (f"ImageText({t.model!r}, image_field={self.image_field!r}, text_field={self.text_field!r}, "
                f"patch={self.patch}, max_side={self.max_side}, min_side={self.min_side}, "
                f"add_bos={t.add_bos}, add_eos={t.add_eos}, max_tokens={t.max_tokens}"
                + ("" if self.max_pixels == MAX_PIXELS else f", max_pixels={self.max_pixels}") + ")")

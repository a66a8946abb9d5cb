"""Sample transforms (Tokenize, ImageText), microbatch transforms (packing) and parallelism
transforms (per-sequence zig-zag context-parallel split)."""

from .cp_split import (causal_work, merge_packed, packed_indices, pad_for_cp, split_packed, zigzag_indices,
                       zigzag_merge, zigzag_split)
from .image_text import ImageDecodeError, ImageText, decode_rgb, navit_size
from .packing import PER_TOKEN_FIELDS, attention_mask_from_segments, pack, unpack
from .tokenize import MissingFieldError, Tokenize

__all__ = ["Tokenize", "ImageText", "MissingFieldError", "ImageDecodeError", "decode_rgb", "navit_size",
           "pack", "unpack", "attention_mask_from_segments", "PER_TOKEN_FIELDS",
           "pad_for_cp", "zigzag_indices", "packed_indices", "zigzag_split", "zigzag_merge", "split_packed",
           "merge_packed", "causal_work"]

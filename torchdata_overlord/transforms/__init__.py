"""Sample, microbatch and parallelism transforms."""
from .packing import PER_TOKEN_FIELDS, attention_mask_from_segments, pack, unpack  # noqa: E402
from .cp_split import (causal_work, merge_packed, pad_for_cp, split_packed, zigzag_indices,  # noqa: E402
                       zigzag_merge, zigzag_split)
from .tokenize import MissingFieldError, Tokenize  # noqa: E402
from .image_text import ImageDecodeError, ImageText, decode_rgb, navit_size  # noqa: E402

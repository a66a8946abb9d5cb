"""Real, offline test data for tests, demos and benchmarks: seeded text, a tiny trained tokenizer, image bytes.

Nothing is downloaded: text comes from a fixed vocabulary and a seeded RNG, the sentencepiece model is
trained on that text in well under a second, and images are encoded by pillow from generated pixels.
"""

from __future__ import annotations

import io
import os
import random

import numpy as np

_WORDS = (
    "the of and to in a is was for on that with as by at from his her it an were are which this be or has "
    "had not but their one all new first after also who two more other its time year people way day man "
    "thing woman life child world school state family student group country problem hand part place case "
    "week company system program question work government number night point home water room mother area "
    "money story fact month lot right study book eye job word business issue side kind head house service "
    "friend father power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war history party "
    "result change morning reason research girl guy moment air teacher force education river data model "
    "train loader batch token image sample plan source balance mixture step quickly slowly carefully "
    "bright dark small large green blue red old young early late good great little long high different"
).split()


def make_text_corpus(n: int, seed: int = 0, min_words: int = 5, max_words: int = 40) -> list[str]:
    """``n`` pseudo-English sentences of min..max words (capitalised, a few commas, full stop), seeded."""
    if n < 0 or min_words < 1 or max_words < min_words:
        raise ValueError(f"need n >= 0 and 1 <= min_words <= max_words, got n={n}, {min_words}..{max_words}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))]
        for i in range(1, len(words) - 1):
            if rng.random() < 0.08:
                words[i] += ","
        out.append(" ".join(words).capitalize() + ".")
    return out


def train_sentencepiece(texts, model_prefix: str | os.PathLike, vocab_size: int = 256,
                        model_type: str = "bpe") -> str:
    """Train a small sentencepiece model on ``texts`` and return the ``.model`` path (pad 0, bos 1, eos 2, unk 3)."""
    import sentencepiece as spm

    texts = list(texts)
    if not texts:
        raise ValueError("train_sentencepiece needs at least one text")
    prefix = os.fspath(model_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=prefix, vocab_size=vocab_size, model_type=model_type,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3, character_coverage=1.0, hard_vocab_limit=False,
        num_threads=1, minloglevel=2,
    )
    return prefix + ".model"


def make_pixels(width: int, height: int, seed: int = 0) -> np.ndarray:
    """An HxWx3 uint8 picture: a seeded colour gradient with a few flat rectangles (smooth, not noise, not blank)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    fy, fx = y / max(height - 1, 1), x / max(width - 1, 1)
    chans = []
    for _ in range(3):
        a, b, c = rng.uniform(0, 1, 3)
        chans.append(255 * (a * fx + b * fy + c * np.sin(6.28 * (fx + fy) * rng.uniform(0.5, 2))) / (a + b + c))
    img = np.clip(np.stack(chans, -1), 0, 255)
    for _ in range(3):
        y0, x0 = rng.integers(0, height), rng.integers(0, width)
        img[y0:y0 + max(1, height // 4), x0:x0 + max(1, width // 4)] = rng.integers(0, 256, 3)
    return img.astype(np.uint8)


def make_image_bytes(width: int, height: int, fmt: str = "JPEG", seed: int = 0, mode: str = "RGB",
                     quality: int = 90) -> bytes:
    """Encode :func:`make_pixels` with pillow as ``fmt`` (JPEG, PNG, WEBP, BMP...), converted to pillow ``mode``."""
    from PIL import Image

    img = Image.fromarray(make_pixels(width, height, seed), "RGB")
    if mode != "RGB":
        img = img.convert(mode)
    buf = io.BytesIO()
    kwargs = {"quality": quality} if fmt.upper() in ("JPEG", "JPG", "WEBP") else {}
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def make_caption_rows(n: int, seed: int = 0, min_side: int = 16, max_side: int = 640, fmt: str = "JPEG",
                      image_field: str = "image", text_field: str = "text") -> list[dict]:
    """``n`` rows of ``{image: bytes, text: caption}`` with seeded random sizes, as an image-text Parquet holds."""
    rng = random.Random(seed)
    captions = make_text_corpus(n, seed=seed, min_words=3, max_words=30)
    return [{image_field: make_image_bytes(rng.randint(min_side, max_side), rng.randint(min_side, max_side), fmt,
                                           seed=seed * 1_000_003 + i),
             text_field: captions[i]} for i in range(n)]

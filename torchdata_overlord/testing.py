"""Real, offline test data for tests, demos and benchmarks: seeded text, a tiny trained tokenizer, image bytes;
and the resume contract (:func:`check_resume_contract`) to run on any stateful node, source or loader.

Nothing is downloaded: text comes from a fixed vocabulary and a seeded RNG, the sentencepiece model is
trained on that text in well under a second, and images are encoded by pillow from generated pixels.
"""

from __future__ import annotations

import copy
import io
import os
import random
from typing import Any, Callable

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


# ------------------------------------------------------------------------------------------------
# the resume contract: one check for every stateful node, source, role and loader
# ------------------------------------------------------------------------------------------------

def assert_identical(a, b, path: str = "$") -> None:
    """Recursive bit-exact equality of nested dicts/lists/tuples/tensors/arrays/scalars.

    Tensors and arrays must match in dtype, shape and every element (NaN equals NaN); lists and
    tuples are interchangeable (a checkpoint round trip may turn one into the other); other values
    must have the same type and compare equal. The AssertionError names the first differing path,
    e.g. ``$[3]['microbatches'][0]['input_ids']``.
    """
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), \
            f"{path}: {type(a).__name__} vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        same = torch.equal(a, b) or (a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all()))
        assert same, f"{path}: tensors differ at {(a != b).nonzero()[:5].tolist()}"
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), \
            f"{path}: {type(a).__name__} vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), f"{path}: arrays differ"
    elif isinstance(a, dict) or isinstance(b, dict):
        assert isinstance(a, dict) and isinstance(b, dict), f"{path}: {type(a).__name__} vs {type(b).__name__}"
        assert a.keys() == b.keys(), (f"{path}: keys differ: only left {sorted(map(str, a.keys() - b.keys()))}, "
                                      f"only right {sorted(map(str, b.keys() - a.keys()))}")
        for k in a:
            assert_identical(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        assert isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)), \
            f"{path}: {type(a).__name__} vs {type(b).__name__}"
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b), f"{path}: {type(a).__name__} {a!r:.80} vs {type(b).__name__} {b!r:.80}"
        assert a == b or (isinstance(a, float) and a != a and b != b), f"{path}: {a!r:.200} vs {b!r:.200}"


def _close(obj) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        close()


class ResumeCase:
    """How to drive one stateful class through :func:`check_resume_contract`.

    ``make()`` builds a FRESH object at its initial position; ``read(obj, k)`` returns its next
    ``k`` items as a list; ``save(obj)`` returns its state; ``load(obj, state)`` restores it
    (reading continues from there); ``close(obj)`` releases it. ``n`` items are compared in all;
    ``boundaries`` are item counts at which an epoch (or another phase) starts: the contract
    resumes just before and at each, and at ``n_random`` seeded random points. Use :meth:`for_node` / :meth:`for_stateful` for the two
    usual protocols.
    """

    def __init__(self, make: Callable[[], Any], read: Callable[[Any, int], list], save: Callable[[Any], Any],
                 load: Callable[[Any, Any], None], n: int, boundaries=(), close: Callable[[Any], None] = _close,
                 n_random: int = 3):
        if not isinstance(n, int) or n < 2:
            raise ValueError(f"ResumeCase: n must be an int >= 2 items, got {n!r}")
        bad = [b for b in boundaries if not 0 < b < n]
        if bad:
            raise ValueError(f"ResumeCase: boundaries {bad} are not inside the {n} items read; raise n")
        self.make, self.read, self.save, self.load, self.close = make, read, save, load, close
        self.n, self.boundaries, self.n_random = n, tuple(boundaries), n_random

    @classmethod
    def for_node(cls, make: Callable[[], Any], n: int, boundaries=(), **options) -> "ResumeCase":
        """A ``torchdata.nodes.BaseNode``: ``next()`` items, ``state_dict()``, ``reset(state)``;
        ``options``: ``n_random``."""
        return cls(make, lambda node, k: [next(node) for _ in range(k)], lambda node: node.state_dict(),
                   lambda node, state: node.reset(state), n, boundaries, **options)

    @classmethod
    def for_stateful(cls, make: Callable[[], Any], n: int, boundaries=(), **options) -> "ResumeCase":
        """An iterable with ``state_dict()`` / ``load_state_dict(state)`` (a source, a loader): one
        iterator per object, restarted by ``iter()`` after each load as a training loop would;
        ``options``: ``n_random``."""
        iters: dict[int, Any] = {}

        def read(obj, k):
            it = iters.get(id(obj))
            if it is None:
                it = iters[id(obj)] = iter(obj)
            return [next(it) for _ in range(k)]

        def load(obj, state):
            obj.load_state_dict(state)
            iters.pop(id(obj), None)

        def close(obj):
            iters.pop(id(obj), None)
            _close(obj)

        return cls(make, read, lambda obj: obj.state_dict(), load, n, boundaries, close, **options)


def torch_round_trip(state):
    """``state`` through ``torch.save`` and ``torch.load(weights_only=True)`` in memory, as a checkpoint."""
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def resume_midpoints(case: ResumeCase, seed: int = 0, n_random: int = 3) -> list[int]:
    """0, just before and at each boundary, and ``n_random`` seeded random points in 1..n-1."""
    rng = random.Random(seed)
    points = {0, *(b - 1 for b in case.boundaries), *case.boundaries}
    points.update(rng.randrange(1, case.n) for _ in range(n_random))
    return sorted(points)


def _scramble(state) -> None:
    """Empty every dict and list inside ``state`` and zero its tensors: what a caller reusing its
    checkpoint buffers does; an object that kept references into a loaded state then breaks."""
    import torch

    if isinstance(state, dict):
        for v in state.values():
            _scramble(v)
        state.clear()
    elif isinstance(state, (list, tuple)):
        for v in state:
            _scramble(v)
        if isinstance(state, list):
            state.clear()
    elif isinstance(state, torch.Tensor):
        state.zero_()
    elif isinstance(state, np.ndarray) and state.flags.writeable:
        state.fill(0)


def check_resume_contract(case: ResumeCase, seed: int = 0, n_random: int | None = None) -> list[int]:
    """Check the save/load contract (after torchdata's ``run_test_save_load_state``); returns the midpoints.

    Loading the initial state replays all n items, in a fresh object and in one that has read them
    (without modifying the state it was given). For every midpoint m of :func:`resume_midpoints`:
    saving is side-effect free (a state taken twice is equal, saving after every item leaves the
    stream unchanged, and a state taken is a snapshot, not a view); the state saved after m items,
    through ``torch.save``/``torch.load(weights_only=True)``, restores a FRESH object that reports
    that state and whose next items equal the uninterrupted run's items m..n, even when the caller
    empties the state object right after loading it (load copies its input). Raises AssertionError
    naming the check, the midpoint and the first differing path.
    """
    n = case.n
    n_random = case.n_random if n_random is None else n_random

    def run(fn):
        obj = case.make()
        try:
            return fn(obj)
        finally:
            case.close(obj)

    initial = torch_round_trip(run(case.save))

    def reference_then_rewind(obj):
        first = case.read(obj, n)
        assert len(first) == n, f"the uninterrupted run gave {len(first)} items, not {n}"
        given = copy.deepcopy(initial)
        case.load(obj, given)
        again = case.read(obj, n)
        assert_identical(given, initial, "(the initial state given to load() was modified)$")
        return first, again
    reference, again = run(reference_then_rewind)
    assert_identical(again, reference, "(initial state loaded after reading: replay)$")

    def fresh_replay(obj):
        case.load(obj, copy.deepcopy(initial))
        return case.read(obj, n)
    assert_identical(run(fresh_replay), reference, "(initial state loaded in a fresh object: replay)$")

    points = resume_midpoints(case, seed, n_random)
    for m in points:
        def interrupted(obj):
            head = []
            for _ in range(m):                        # a state taken between items must change nothing
                case.save(obj)
                head += case.read(obj, 1)
            state = case.save(obj)
            assert_identical(case.save(obj), state, f"(midpoint {m}: state taken twice)$")
            saved = torch_round_trip(state)
            assert_identical(saved, state, f"(midpoint {m}: state after torch.save/torch.load)$")
            head += case.read(obj, n - m)
            assert_identical(state, saved, f"(midpoint {m}: the saved state changed as the object read on)$")
            return head, saved
        stream, saved = run(interrupted)
        assert_identical(stream, reference, f"(midpoint {m}: stream with a state taken after every item)$")

        def restored(obj):
            given = copy.deepcopy(saved)
            case.load(obj, given)
            assert_identical(case.save(obj), saved, f"(midpoint {m}: state reported right after loading)$")
            _scramble(given)
            try:
                return case.read(obj, n - m)
            except Exception as e:
                raise AssertionError(f"(midpoint {m}: reading failed after the caller emptied the state it had "
                                     f"loaded: load must copy its input) {e!r}") from e
        assert_identical(run(restored), reference[m:], f"(midpoint {m}: tail resumed in a fresh object)$")
    return points

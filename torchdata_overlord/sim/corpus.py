"""The demo corpus: a realistic local multi-source corpus in real Parquet files, built once and cached.

Four sources, generated deterministically from ``seed`` with numpy and pillow, nothing downloaded:

=========  ===================  ===========================================================
source     columns              content
=========  ===================  ===========================================================
``web``    id, text             web pages: Zipfian pseudo-English prose in paragraphs, lognormal
                                lengths around a few hundred tokens
``code``   id, content          Python-like files: indented blocks of identifiers, operators,
                                calls, comments; longer than web (lognormal around ~1k tokens)
``long``   id, text             long-context documents: Pareto (alpha 1.1) lengths, ~2k..32k
                                tokens at scale "demo" (~1k..8k at "test")
``caps``   id, image, text,     captioned images: real JPEG bytes of skewed sizes (64..640 px per
           width, height        side, varied aspect) and coyo-like captions (~98% <= 64 tokens)
=========  ===================  ===========================================================

Each source is several files (``<source>/part-NNNNN.parquet``) of several row groups each, so
streaming by row group is exercised, plus columns the transforms do not read (``id``, ``width``,
``height``), so projection is too. One sentencepiece BPE model (pad 0, bos 1, eos 2, unk 3, and a
user-defined ``<image>`` piece for image placeholders) is trained on a sample of all four sources.

Caching: ``root/manifest.json`` records the configuration (scale, seed, :data:`CORPUS_VERSION`, the
scale's parameters) and every file with its size. A call whose configuration matches a complete
corpus returns at once without writing anything. Otherwise (other configuration, ``force=True``,
missing or corrupt manifest, missing or truncated file) the corpus is built in a fresh sibling
temporary directory and renamed into place, so ``root`` never shows a half-written corpus; an
inter-process lock (``.<root>.lock`` beside it) makes concurrent builders of one root wait for one
build. An existing ``root`` holding anything this builder did not write is never deleted.

Lengths in tokens are approximate by construction (documents are generated in words and code
lines, calibrated to this tokenizer); the manifest records measured token statistics on a sample.
"""

from __future__ import annotations

import contextlib
import glob as globmod
import io
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError

__all__ = ["Corpus", "build_demo_corpus", "default_corpus_root", "CORPUS_VERSION", "SCALES", "SOURCES"]

#: Bump whenever generation changes what a (scale, seed) builds: cached corpora then rebuild.
CORPUS_VERSION = 1

#: Source names, in build order; each source's RNG is ``default_rng([seed, index])``.
SOURCES = ("web", "code", "long", "caps")
_TEXT_FIELDS = {"web": "text", "code": "content", "long": "text", "caps": "text"}
_MANIFEST = "manifest.json"
_SPM_PREFIX = "tokenizer"
IMAGE_TOKEN = "<image>"

# Calibration: spm tokens per generated word (prose, incl. punctuation) and per code line, measured
# on the demo-scale model; lengths below are given in tokens and converted with these.
_TOKENS_PER_WORD = 1.85
_TOKENS_PER_CODE_LINE = 10.5

#: Per-scale parameters. Lengths are in (approximate) tokens. Recorded in the manifest's config, so
#: editing them invalidates cached corpora.
SCALES: dict[str, dict[str, Any]] = {
    "demo": {
        "web": {"rows": 8000, "files": 4, "row_group_rows": 500,
                "tokens": {"dist": "lognormal", "median": 300, "sigma": 0.75, "min": 24, "max": 6000}},
        "code": {"rows": 3000, "files": 4, "row_group_rows": 250,
                 "tokens": {"dist": "lognormal", "median": 900, "sigma": 0.8, "min": 64, "max": 16000}},
        "long": {"rows": 400, "files": 4, "row_group_rows": 25,
                 "tokens": {"dist": "pareto", "min": 2048, "alpha": 1.1, "max": 32768}},
        "caps": {"rows": 3000, "files": 4, "row_group_rows": 250,
                 "tokens": {"dist": "caption", "median": 16, "sigma": 0.5, "tail_p": 0.015, "tail_min": 48,
                            "min": 3, "max": 256},
                 "image": {"median_side": 200, "sigma": 0.5, "aspect_sigma": 0.35, "min_side": 64,
                           "max_side": 640, "quality": [70, 95]}},
        "spm": {"vocab_size": 2000, "sample_chars": 1_500_000},
    },
    "test": {
        "web": {"rows": 96, "files": 4, "row_group_rows": 8,
                "tokens": {"dist": "lognormal", "median": 200, "sigma": 0.75, "min": 24, "max": 4000}},
        "code": {"rows": 48, "files": 4, "row_group_rows": 4,
                 "tokens": {"dist": "lognormal", "median": 600, "sigma": 0.8, "min": 64, "max": 8000}},
        "long": {"rows": 32, "files": 4, "row_group_rows": 3,
                 "tokens": {"dist": "pareto", "min": 1024, "alpha": 1.1, "max": 8192}},
        "caps": {"rows": 48, "files": 4, "row_group_rows": 4,
                 "tokens": {"dist": "caption", "median": 16, "sigma": 0.5, "tail_p": 0.015, "tail_min": 48,
                            "min": 3, "max": 256},
                 "image": {"median_side": 160, "sigma": 0.5, "aspect_sigma": 0.35, "min_side": 64,
                           "max_side": 640, "quality": [70, 95]}},
        "spm": {"vocab_size": 800, "sample_chars": 400_000},
    },
}


# ------------------------------------------------------------------------------------------------
# the result
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Corpus:
    """A built demo corpus. ``sources[name]`` is a glob of that source's Parquet files (special
    characters in ``root`` escaped), ready for :class:`~torchdata_overlord.sources.ParquetSource`."""

    root: Path
    sources: dict[str, str]
    spm_model: str
    image_token_id: int
    text_fields: dict[str, str]
    manifest: dict = field(repr=False)

    def files(self, name: str) -> list[str]:
        """Absolute paths of source ``name``'s Parquet files, sorted."""
        self._check(name)
        return [str(self.root / f["path"]) for f in self.manifest["sources"][name]["files"]]

    def transform(self, name: str, **kwargs):
        """The sample transform for source ``name`` built on this corpus's tokenizer: ``Tokenize`` on
        its text column, or ``ImageText`` for ``caps``; ``kwargs`` go to the transform."""
        from ..transforms import ImageText, Tokenize

        self._check(name)
        if name == "caps":
            return ImageText(self.spm_model, image_field="image", text_field="text", **kwargs)
        return Tokenize(self.spm_model, field=self.text_fields[name], **kwargs)

    def source(self, name: str, transform=None, **kwargs):
        """A ``ParquetSource`` over source ``name`` (default transform: :meth:`transform`)."""
        from ..sources import ParquetSource

        self._check(name)
        return ParquetSource(name, self.sources[name], self.transform(name) if transform is None else transform,
                             **kwargs)

    def _check(self, name: str) -> None:
        if name not in self.sources:
            raise ConfigError(f"demo corpus has no source {name!r}; sources: {sorted(self.sources)}")


def default_corpus_root() -> Path:
    """Where demos, tutorials and benchmarks cache the corpus: ``$TORCHDATA_OVERLORD_CACHE/demo-corpus``,
    else ``$XDG_CACHE_HOME/torchdata_overlord/demo-corpus``, else ``~/.cache/torchdata_overlord/demo-corpus``."""
    env = os.environ.get("TORCHDATA_OVERLORD_CACHE")
    if env:
        return Path(env).expanduser() / "demo-corpus"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchdata_overlord" / "demo-corpus"


# ------------------------------------------------------------------------------------------------
# entry point: cache check, lock, build in a temp dir, atomic install
# ------------------------------------------------------------------------------------------------

def build_demo_corpus(root: str | os.PathLike, scale: str = "demo", seed: int = 0, force: bool = False) -> Corpus:
    """Build (or reuse) the demo corpus under ``root`` and describe it.

    ``scale``: ``"demo"`` (~14k rows, ~40 MB, seconds on 2 cores) or ``"test"`` (~220 rows, well
    under a second or two). Same ``(scale, seed)`` gives the same data; a cached corpus with that
    configuration is returned without rewriting anything unless ``force``.
    """
    if scale not in SCALES:
        raise ConfigError(f"build_demo_corpus: unknown scale {scale!r}; choose one of {sorted(SCALES)}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"build_demo_corpus: seed must be an int >= 0, got {seed!r}")
    root = Path(root).expanduser().absolute()
    config = _config(scale, int(seed))
    if not force:
        hit = _load(root, config)
        if hit is not None:
            return hit
    if root.exists() and not root.is_dir():
        raise ConfigError(f"build_demo_corpus: {root} exists and is not a directory; pass a directory path")
    root.parent.mkdir(parents=True, exist_ok=True)
    with _lock(root) as locked:
        if not force:  # another process may have built it while we waited for the lock
            hit = _load(root, config)
            if hit is not None:
                return hit
        _check_replaceable(root)
        if locked:
            _remove_stale(root)
        tmp = root.parent / f".{root.name}.build-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()  # not mkdtemp: the installed root gets the usual (umask) permissions, not 0700
        try:
            _build(tmp, config)
            _install(tmp, root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    corpus = _load(root, config)
    if corpus is None:  # pragma: no cover - only if someone rewrote root between install and load
        raise RuntimeError(f"build_demo_corpus: {root} changed while it was being installed")
    return corpus


def _config(scale: str, seed: int) -> dict:
    # JSON round trip: what is compared with a manifest must be what a manifest holds
    return json.loads(json.dumps({"version": CORPUS_VERSION, "scale": scale, "seed": seed,
                                  "params": SCALES[scale]}))


def _load(root: Path, config: dict) -> Corpus | None:
    """The corpus in ``root`` if its manifest parses, matches ``config`` and every file it lists is
    present with its recorded size; else None. Reads only the manifest and file sizes."""
    try:
        manifest = json.loads((root / _MANIFEST).read_text())
        if manifest.get("config") != config:
            return None
        listed = [(f["path"], f["bytes"]) for s in SOURCES for f in manifest["sources"][s]["files"]]
        listed.append((manifest["spm"]["model"], manifest["spm"]["bytes"]))
        for rel, size in listed:
            if (root / rel).stat().st_size != size:
                return None
        return Corpus(
            root=root,
            sources={s: os.path.join(globmod.escape(str(root / s)), "*.parquet") for s in SOURCES},
            spm_model=str(root / manifest["spm"]["model"]),
            image_token_id=int(manifest["spm"]["image_token_id"]),
            text_fields=dict(_TEXT_FIELDS),
            manifest=manifest,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@contextlib.contextmanager
def _lock(root: Path):
    """An exclusive inter-process lock on ``.<name>.lock`` beside ``root``; yields False where
    ``fcntl`` is unavailable (then concurrent builders of one root are not serialised)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield False
        return
    with open(root.parent / f".{root.name}.lock", "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


_OURS = frozenset([_MANIFEST, f"{_SPM_PREFIX}.model", f"{_SPM_PREFIX}.vocab", *SOURCES])


def _check_replaceable(root: Path) -> None:
    """Refuse to replace a directory holding anything this builder does not write."""
    if not root.is_dir():
        return
    foreign = sorted(set(os.listdir(root)) - _OURS)
    if foreign:
        raise ConfigError(f"build_demo_corpus: {root} holds files the corpus builder did not write "
                          f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); refusing to "
                          f"replace it. Pass an empty or new directory as root.")


def _remove_stale(root: Path) -> None:
    """Build/old directories left beside ``root`` by a killed builder (safe: we hold the lock)."""
    prefixes = (f".{root.name}.build-", f".{root.name}.old-")
    for entry in os.listdir(root.parent):
        if entry.startswith(prefixes):
            shutil.rmtree(root.parent / entry, ignore_errors=True)


def _install(tmp: Path, root: Path) -> None:
    """Rename the finished build ``tmp`` to ``root``; an existing ``root`` is moved aside first and
    deleted after, so ``root`` is at every moment either absent, the old corpus or the new one."""
    if not root.exists():
        os.rename(tmp, root)
        return
    old = root.parent / f".{root.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(root, old)
    try:
        os.rename(tmp, root)
    except BaseException:
        os.rename(old, root)
        raise
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# the build
# ------------------------------------------------------------------------------------------------

def _build(out: Path, config: dict) -> dict:
    """Write every source, the tokenizer and (last) the manifest into ``out``; return the manifest."""
    t0 = time.perf_counter()
    params, seed = config["params"], config["seed"]
    rngs = {s: np.random.default_rng([seed, i]) for i, s in enumerate(SOURCES)}
    timings: dict[str, float] = {}

    texts: dict[str, list[str]] = {}
    for name, gen in (("web", _gen_web), ("code", _gen_code), ("long", _gen_long)):
        t = time.perf_counter()
        texts[name] = gen(rngs[name], params[name])
        timings[f"generate_{name}"] = time.perf_counter() - t
    t = time.perf_counter()
    captions, widths, heights, qualities = _gen_caps_meta(rngs["caps"], params["caps"])
    texts["caps"] = captions
    timings["generate_caps_text"] = time.perf_counter() - t

    t = time.perf_counter()
    images = _gen_images(rngs["caps"], widths, heights, qualities)
    timings["generate_caps_images"] = time.perf_counter() - t
    sources: dict[str, dict] = {}
    t = time.perf_counter()
    for name in SOURCES:
        columns = {"id": [f"{name}-{i:06d}" for i in range(len(texts[name]))]}
        if name == "caps":
            columns.update(image=images, text=captions, width=widths.astype(np.int32),
                           height=heights.astype(np.int32))
        else:
            columns[_TEXT_FIELDS[name]] = texts[name]
        sources[name] = _write_source(out, name, columns, params[name])
    timings["write_parquet"] = time.perf_counter() - t
    t = time.perf_counter()
    model_path = _train_spm(out / _SPM_PREFIX, _spm_sample(texts, params["spm"]["sample_chars"]),
                            params["spm"]["vocab_size"])
    timings["train_spm"] = time.perf_counter() - t

    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model_path)
    image_id = sp.piece_to_id(IMAGE_TOKEN)
    if image_id == sp.unk_id():  # pragma: no cover - sentencepiece always keeps user-defined symbols
        raise RuntimeError(f"tokenizer lost the {IMAGE_TOKEN!r} piece")
    t = time.perf_counter()
    for name in SOURCES:
        max_docs = len(texts[name]) if name == "caps" else 128  # captions are short: measure them all
        sources[name]["tokens_sample"] = _token_stats(sp, texts[name], rngs[name], max_docs)
    timings["token_stats"] = time.perf_counter() - t

    model = Path(model_path)
    manifest = {
        "config": config,
        "sources": sources,
        "spm": {"model": model.name, "bytes": model.stat().st_size, "vocab_size": sp.get_piece_size(),
                "image_token": IMAGE_TOKEN, "image_token_id": image_id, "pad_id": sp.pad_id(),
                "bos_id": sp.bos_id(), "eos_id": sp.eos_id(), "unk_id": sp.unk_id()},
        "totals": {"rows": sum(s["rows"] for s in sources.values()),
                   "files": sum(len(s["files"]) for s in sources.values()),
                   "bytes": sum(s["bytes"] for s in sources.values()) + model.stat().st_size},
        "build": {"id": uuid.uuid4().hex, "seconds": round(time.perf_counter() - t0, 3),
                  "timings": {k: round(v, 3) for k, v in timings.items()}},
    }
    tmp = out / (_MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / _MANIFEST)
    return manifest


def _write_source(out: Path, name: str, columns: dict[str, Any], p: dict) -> dict:
    """Split ``columns`` row-contiguously into ``p["files"]`` Parquet files of ``row_group_rows`` groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = len(columns["id"])
    types = {"id": pa.string(), "text": pa.string(), "content": pa.string(), "image": pa.binary(),
             "width": pa.int32(), "height": pa.int32()}
    table = pa.table({k: pa.array(v, type=types[k]) for k, v in columns.items()})
    bounds = np.linspace(0, rows, p["files"] + 1).round().astype(int)
    d = out / name
    d.mkdir()
    files = []
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        path = d / f"part-{k:05d}.parquet"
        pq.write_table(table.slice(a, b - a), path, row_group_size=p["row_group_rows"],
                       compression={c: ("none" if c == "image" else "zstd") for c in columns},
                       use_dictionary=False, write_statistics=[c for c in ("id", "width", "height") if c in columns])
        meta = pq.read_metadata(path)
        files.append({"path": f"{name}/{path.name}", "rows": int(b - a), "row_groups": meta.num_row_groups,
                      "bytes": path.stat().st_size})
    return {"glob": f"{name}/*.parquet", "columns": list(columns), "text_field": _TEXT_FIELDS[name],
            "rows": rows, "row_groups": sum(f["row_groups"] for f in files),
            "bytes": sum(f["bytes"] for f in files), "files": files}


# ------------------------------------------------------------------------------------------------
# lengths
# ------------------------------------------------------------------------------------------------

def _lengths(rng: np.random.Generator, n: int, d: dict) -> np.ndarray:
    """``n`` target lengths in tokens from the distribution spec ``d`` (int64, within [min, max])."""
    if d["dist"] == "lognormal":
        x = rng.lognormal(np.log(d["median"]), d["sigma"], n)
    elif d["dist"] == "pareto":  # classic Pareto with scale ``min``: P(X > x) = (min / x) ** alpha
        x = d["min"] * (1.0 + rng.pareto(d["alpha"], n))
    elif d["dist"] == "caption":  # lognormal body and a Pareto tail of long (alt-text-like) captions
        x = rng.lognormal(np.log(d["median"]), d["sigma"], n)
        tail = rng.random(n) < d["tail_p"]
        x[tail] = d["tail_min"] * (1.0 + rng.pareto(1.5, int(tail.sum())))
    else:  # pragma: no cover - SCALES is ours
        raise ValueError(d["dist"])
    return np.clip(np.round(x), d["min"], d["max"]).astype(np.int64)


# ------------------------------------------------------------------------------------------------
# prose: a fixed Zipfian vocabulary, words drawn vectorised, punctuation as word forms
# ------------------------------------------------------------------------------------------------

_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl cr dr fl gr pl pr sh st th tr".split()
_VOWELS = "a e i o u ai ea ee ie io oa ou".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "rk", "ng", "ck"]
_SUFFIX = ["", ",", ".", "?", "!", ".\n\n"]  # word forms: plain/capitalised x these suffixes

_vocab_cache: dict[str, Any] = {}


def _vocab() -> tuple[np.ndarray, np.ndarray]:
    """``(forms, cdf)``: ``forms[c * len(_SUFFIX) + s, w]`` is word ``w`` (capitalised if ``c``) with
    suffix ``_SUFFIX[s]``; ``cdf`` is the Zipf(1.05) cumulative distribution over words by rank. The
    vocabulary is fixed (its own seed), so every corpus speaks the same language."""
    if "forms" not in _vocab_cache:
        from ..testing import _WORDS

        rng = np.random.default_rng(20250417)
        common = list(dict.fromkeys(_WORDS))
        seen = set(common)
        synth: list[str] = []
        while len(synth) < 6000:
            n = int(rng.choice([1, 2, 2, 3, 3, 4], p=[0.1, 0.25, 0.2, 0.2, 0.15, 0.1]))
            w = "".join(_ONSETS[rng.integers(len(_ONSETS))] + _VOWELS[rng.integers(len(_VOWELS))]
                        for _ in range(n)) + _CODAS[rng.integers(len(_CODAS))]
            if w not in seen:
                seen.add(w)
                synth.append(w)
        numbers = [str(x) for x in rng.integers(0, 2100, 150)] + [f"{x:.1f}" for x in rng.uniform(0, 100, 50)]
        numbers = list(dict.fromkeys(numbers))
        # ranks: common words first, numbers spread through the synthetic tail
        words = common + synth[:300] + numbers + synth[300:]
        forms = np.empty((2 * len(_SUFFIX), len(words)), dtype=object)
        for c, variant in enumerate((words, [w.capitalize() for w in words])):
            for s, suf in enumerate(_SUFFIX):
                forms[c * len(_SUFFIX) + s] = [w + suf for w in variant]
        weights = 1.0 / (np.arange(len(words)) + 2.7) ** 1.05
        cdf = np.cumsum(weights)
        _vocab_cache["forms"], _vocab_cache["cdf"] = forms, cdf / cdf[-1]
        _vocab_cache["words"] = words
    return _vocab_cache["forms"], _vocab_cache["cdf"]


def _word_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    _, cdf = _vocab()
    return np.minimum(np.searchsorted(cdf, rng.random(n)), len(cdf) - 1)


def _prose(rng: np.random.Generator, n_words: np.ndarray, paragraphs: bool, sentence_words: float = 14.0,
           final_stop: bool = True) -> list[str]:
    """One text per entry of ``n_words``: sentences of ~``sentence_words`` words with commas,
    capitalised starts, '.', '?' or '!' ends and (if ``paragraphs``) blank lines between paragraphs."""
    forms, _ = _vocab()
    n_words = np.maximum(np.asarray(n_words, np.int64), 1)
    total = int(n_words.sum())
    ends = np.cumsum(n_words)
    starts = ends - n_words
    ids = _word_ids(rng, total)
    u = rng.random((3, total))
    stop = u[0] < 1.0 / sentence_words
    stop[ends - 1] = final_stop
    suffix = np.zeros(total, np.int64)
    suffix[(u[1] < 0.07) & ~stop] = 1                                              # ","
    suffix[stop] = np.select([u[1][stop] < 0.06, u[1][stop] < 0.10], [3, 4], 2)    # "?", "!", "."
    if paragraphs:
        suffix[stop & (u[2] < 0.2) & (suffix == 2)] = 5                           # ".\n\n"
        suffix[ends - 1] = np.where(suffix[ends - 1] == 5, 2, suffix[ends - 1])
    cap = np.zeros(total, bool)
    cap[1:] = stop[:-1]
    cap[starts] = True
    toks = forms[cap * len(_SUFFIX) + suffix, ids].tolist()
    out = [" ".join(toks[a:b]) for a, b in zip(starts.tolist(), ends.tolist())]
    return [t.replace("\n ", "\n") for t in out] if paragraphs else out


def _gen_web(rng: np.random.Generator, p: dict) -> list[str]:
    tokens = _lengths(rng, p["rows"], p["tokens"])
    return _prose(rng, np.maximum(1, tokens / _TOKENS_PER_WORD).astype(np.int64), paragraphs=True)


def _gen_long(rng: np.random.Generator, p: dict) -> list[str]:
    tokens = _lengths(rng, p["rows"], p["tokens"])
    return _prose(rng, np.maximum(1, tokens / _TOKENS_PER_WORD).astype(np.int64), paragraphs=True,
                  sentence_words=18.0)


def _gen_caps_meta(rng: np.random.Generator, p: dict):
    """Captions (short prose, often without a final stop) and each image's size and JPEG quality."""
    n = p["rows"]
    tokens = _lengths(rng, n, p["tokens"])
    captions = _prose(rng, np.maximum(1, tokens / _TOKENS_PER_WORD).astype(np.int64), paragraphs=False,
                      sentence_words=20.0, final_stop=False)
    q = p["image"]
    side = rng.lognormal(np.log(q["median_side"]), q["sigma"], n)
    aspect = np.exp(rng.normal(0.0, q["aspect_sigma"], n))            # width / height
    widths = np.clip(np.round(side * np.sqrt(aspect)), q["min_side"], q["max_side"]).astype(np.int64)
    heights = np.clip(np.round(side / np.sqrt(aspect)), q["min_side"], q["max_side"]).astype(np.int64)
    qualities = rng.integers(q["quality"][0], q["quality"][1] + 1, n)
    return captions, widths, heights, qualities


# ------------------------------------------------------------------------------------------------
# code: Python-like lines from templates over a fixed Zipfian identifier vocabulary
# ------------------------------------------------------------------------------------------------

_SHORT = "i j k n x y z df out cfg ctx self args kwargs batch idx key value result item".split()
_OPS = ["==", "!=", "<", ">", "<=", ">=", "is", "in"]
_AOPS = ["+", "-", "*", "//", "%", "<<", "+", "-"]
_MODULES = "os sys re json math time torch numpy typing functools itertools collections pathlib".split()
# (template, opens a block, relative weight); slots: {a} {b} {c} identifiers, {f} {g} functions,
# {C} classes, {o} comparison, {p} arithmetic, {n} number, {s} string, {w} comment words
_LINES = [
    ("{a} = {f}({b}, {c})", 0, 14), ("{a} = {b}.{f}({c})", 0, 9), ("{a}.{f}({b}, {c}={n})", 0, 6),
    ("{a} = {b} {p} {n}", 0, 7), ("{a}[{b}] = {c}", 0, 5), ("{a} += {f}({b})", 0, 4),
    ("return {a}", -1, 4), ("return {f}({a}, {b})", -1, 3), ("if {a} {o} {b}:", 1, 7),
    ("elif {a} {o} {n}:", 1, 2), ("for {a} in {f}({b}):", 1, 5), ("while {a} {o} {n}:", 1, 1),
    ("with {f}({s}) as {a}:", 1, 2), ("try:", 1, 1), ("except {C} as {a}:", 1, 1),
    ("raise {C}({s})", -1, 1), ("# {w}", 0, 6), ("assert {a} {o} {b}, {s}", 0, 2),
    ("{a} = [{f}({b}) for {c} in {g}]", 0, 3), ("{a} = {{{s}: {b}, {s}: {n}}}", 0, 2),
    ("yield {a}", 0, 1), ("", 0, 5),
]
_CONTINUATIONS = frozenset(k for k, (t, _, _) in enumerate(_LINES) if t.startswith(("elif", "except")))


def _identifiers() -> tuple[list[str], list[str], list[str]]:
    """Fixed (variables, functions, classes) names made of vocabulary words, in Zipf rank order."""
    if "idents" not in _vocab_cache:
        _vocab()
        words = _vocab_cache["words"]
        alpha = [w for w in words if w.isalpha()]
        rng = np.random.default_rng(1234567)

        def names(n, parts, join):
            out = []
            for _ in range(n):
                k = int(rng.choice(parts))
                picked = [alpha[min(int(rng.zipf(1.3)) - 1, len(alpha) - 1)] for _ in range(k)]
                out.append(join(picked))
            return list(dict.fromkeys(out))

        variables = _SHORT + names(1500, [1, 1, 2, 2, 3], "_".join)
        functions = names(800, [1, 2, 2, 3], "_".join) + ["len", "range", "print", "sorted", "isinstance"]
        classes = names(200, [1, 2, 2, 3], lambda ws: "".join(w.capitalize() for w in ws)) + [
            "ValueError", "KeyError", "RuntimeError", "TypeError"]
        _vocab_cache["idents"] = (variables, functions, classes)
    return _vocab_cache["idents"]


def _zipf_pick(rng: np.random.Generator, pool: list[str], size) -> np.ndarray:
    idx = np.minimum(rng.zipf(1.25, size) - 1, len(pool) - 1)
    return np.asarray(pool, dtype=object)[idx]


def _gen_code(rng: np.random.Generator, p: dict) -> list[str]:
    """Files of ``import`` headers, then ``def``/``class`` blocks of templated, indented lines."""
    variables, functions, classes = _identifiers()
    tokens = _lengths(rng, p["rows"], p["tokens"])
    n_lines = np.maximum(4, np.round(tokens / _TOKENS_PER_CODE_LINE)).astype(np.int64)
    total = int(n_lines.sum())
    weights = np.array([w for _, _, w in _LINES], np.float64)
    kinds = rng.choice(len(_LINES), total, p=weights / weights.sum())
    slot = {k: _zipf_pick(rng, variables, total).tolist() for k in "abc"}
    fn = _zipf_pick(rng, functions, (2, total)).tolist()
    cls = _zipf_pick(rng, classes, total).tolist()
    ops = np.asarray(_OPS, dtype=object)[rng.integers(0, len(_OPS), total)].tolist()
    aops = np.asarray(_AOPS, dtype=object)[rng.integers(0, len(_AOPS), total)].tolist()
    nums = [str(x) for x in np.minimum(rng.zipf(1.6, total) - 1, 4096).tolist()]
    strs = ['"' + s + '"' for s in _prose(rng, rng.integers(1, 4, total), paragraphs=False, final_stop=False)]
    comment_len = rng.integers(3, 12, total)
    comments = _prose(rng, comment_len, paragraphs=False, sentence_words=30.0, final_stop=False)
    u = rng.random((3, total)).tolist()
    templates = [t for t, _, _ in _LINES]
    opens = [o for _, o, _ in _LINES]
    kinds_l = kinds.tolist()
    docs = []
    line = 0
    for n in n_lines.tolist():
        out = [f"import {m}" for m in sorted(set(np.asarray(_MODULES)[rng.integers(0, len(_MODULES), 3)]))]
        depth, opened = 0, False
        for _ in range(n):
            i = line
            line += 1
            if depth == 0 or (u[0][i] < 0.04 and not opened):  # a new top-level def (sometimes a method)
                if u[1][i] < 0.15:
                    out.append("")
                    out.append(f"class {cls[i]}:")
                    out.append(f"    def {fn[0][i]}(self, {slot['a'][i]}, {slot['b'][i]}={nums[i]}):")
                    depth = 2
                else:
                    out.append("")
                    out.append(f"def {fn[0][i]}({slot['a'][i]}, {slot['b'][i]}):")
                    depth = 1
                opened = True
                continue
            k = kinds_l[i]
            if (opened and (not templates[k] or k in _CONTINUATIONS)) or (opens[k] > 0 and depth >= 6):
                k = 0  # an opener is followed by its body (no blank, elif, except); nesting stops at 6
            text = templates[k].format(a=slot["a"][i], b=slot["b"][i], c=slot["c"][i], f=fn[0][i], g=fn[1][i],
                                       C=cls[i], o=ops[i], p=aops[i], n=nums[i], s=strs[i], w=comments[i])
            # elif/except continue the enclosing if/try: one level out, block body back at ``depth``
            level = depth - 1 if k in _CONTINUATIONS and depth > 1 and not opened else depth
            out.append("    " * level + text if text else "")
            opened = opens[k] > 0
            if opened:
                depth = level + 1
            elif (opens[k] < 0 or u[2][i] < 0.12) and depth > 1:
                depth -= 1
            elif opens[k] < 0:
                depth = 0
        if opened:
            out.append("    " * depth + "pass")
        docs.append("\n".join(out) + "\n")
    return docs


# ------------------------------------------------------------------------------------------------
# images: pillow-drawn pictures (smooth colour field, shapes, texture), JPEG-encoded
# ------------------------------------------------------------------------------------------------

def _gen_images(rng: np.random.Generator, widths: np.ndarray, heights: np.ndarray,
                qualities: np.ndarray) -> list[bytes]:
    from PIL import Image, ImageDraw

    out = []
    for w, h, q in zip(widths.tolist(), heights.tolist(), qualities.tolist()):
        gh, gw = rng.integers(2, 7, 2)
        img = Image.fromarray(rng.integers(0, 256, (int(gh), int(gw), 3), dtype=np.uint8), "RGB")
        img = img.resize((w, h), Image.BICUBIC)
        draw = ImageDraw.Draw(img)
        shapes = rng.integers(0, [w, w, h, h, 256, 256, 256], (int(rng.integers(1, 6)), 7))
        for k, (x0, x1, y0, y1, r, g, b) in enumerate(shapes.tolist()):
            box = (min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1))
            (draw.ellipse if k % 2 else draw.rectangle)(box, fill=(r, g, b))
        noise = rng.integers(0, 256, (max(1, h // 4), max(1, w // 4)), dtype=np.uint8)
        grain = Image.fromarray(noise, "L").resize((w, h), Image.BILINEAR).convert("RGB")
        img = Image.blend(img, grain, 0.12)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=q)
        out.append(buf.getvalue())
    return out


# ------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------

def _spm_sample(texts: dict[str, list[str]], chars: int) -> list[str]:
    """Lines for tokenizer training: each source's documents in order until its share of ``chars``
    (web 35%, code 30%, long 20%, caps 15%), split into non-empty lines."""
    share = {"web": 0.35, "code": 0.30, "long": 0.20, "caps": 0.15}
    lines: list[str] = []
    for name in SOURCES:
        budget = int(chars * share[name])
        for doc in texts[name]:
            if budget <= 0:
                break
            doc = doc[:budget]
            budget -= len(doc)
            lines.extend(ln for ln in doc.split("\n") if ln.strip())
    return lines


def _train_spm(prefix: Path, lines: list[str], vocab_size: int) -> str:
    """Train the BPE model and write ``<prefix>.model`` and a readable ``<prefix>.vocab``. The model is
    written through ``model_writer``, so it does not record the (temporary) build path: same input,
    same bytes."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        pad_id=0, bos_id=1, eos_id=2, unk_id=3, user_defined_symbols=[IMAGE_TOKEN],
        character_coverage=1.0, hard_vocab_limit=False, max_sentence_length=1 << 16,
        num_threads=1, minloglevel=2,
    )
    model = Path(str(prefix) + ".model")
    model.write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    Path(str(prefix) + ".vocab").write_text(
        "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size())),
        encoding="utf-8")
    return str(model)


def _token_stats(sp, texts: list[str], rng: np.random.Generator, max_docs: int = 128) -> dict:
    """Token counts (bos/eos excluded) of up to ``max_docs`` documents drawn without replacement."""
    pick = np.sort(rng.choice(len(texts), min(max_docs, len(texts)), replace=False))
    n = np.array([len(ids) for ids in sp.encode([texts[i] for i in pick.tolist()])], np.float64)
    return {"docs": int(n.size), "mean": round(float(n.mean()), 1),
            **{f"p{q}": int(np.percentile(n, q)) for q in (50, 90, 98)}, "max": int(n.max()),
            "frac_le_64": round(float((n <= 64).mean()), 4)}

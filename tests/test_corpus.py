"""The demo corpus (scale "test"): real Parquet files read end to end, its tokenizer, caching and rebuilds.

Expected values come from the files themselves (pyarrow footers and columns), not from the builder's
manifest, except where the test is that the manifest tells the truth.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
import torch

from torchdata_overlord.errors import ConfigError
from torchdata_overlord.sim import corpus as corpus_mod
from torchdata_overlord.sim.corpus import SOURCES, Corpus, build_demo_corpus
from torchdata_overlord.sources import ParquetSource
from torchdata_overlord.transforms import ImageText, Tokenize

COLUMNS = {"web": {"id", "text"}, "code": {"id", "content"}, "long": {"id", "text"},
           "caps": {"id", "image", "text", "width", "height"}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    # brackets in the path: the globs must escape them
    return build_demo_corpus(tmp_path_factory.mktemp("corpus") / "demo[test]", scale="test", seed=0)


@pytest.fixture(scope="module")
def records(corpus):
    """Every source read end to end through ParquetSource with transforms built from the corpus model."""
    transforms = {"web": Tokenize(corpus.spm_model, field=corpus.text_fields["web"]),
                  "code": Tokenize(corpus.spm_model, field=corpus.text_fields["code"]),
                  "long": Tokenize(corpus.spm_model, field=corpus.text_fields["long"]),
                  "caps": ImageText(corpus.spm_model, patch=14)}
    out = {}
    for name in SOURCES:
        with ParquetSource(name, corpus.sources[name], transforms[name], epochs=1, seed=1) as src:
            out[name] = dict(src)
            assert src.reads == sum(pq.ParquetFile(f).num_row_groups for f in src.files)
    return out


def snapshot(root: Path) -> dict[str, int]:
    """Every path under ``root`` with its mtime (ns)."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def siblings(root: Path) -> list[str]:
    return sorted(os.listdir(root.parent))


# ------------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------------

def test_files_are_valid_parquet_with_declared_columns_and_row_groups(corpus):
    assert set(corpus.sources) == set(SOURCES)
    assert corpus.text_fields == {"web": "text", "code": "content", "long": "text", "caps": "text"}
    total_bytes = 0
    for name in SOURCES:
        files = sorted(Path(corpus.root, name).glob("*.parquet"))
        assert len(files) >= 2 and [str(f) for f in files] == corpus.files(name)
        m = corpus.manifest["sources"][name]
        rows = 0
        for f, listed in zip(files, m["files"]):
            pf = pq.ParquetFile(f)
            assert set(pf.schema_arrow.names) == COLUMNS[name]
            assert pf.metadata.num_row_groups > 1, f"{f} has a single row group"
            assert listed == {"path": f"{name}/{f.name}", "rows": pf.metadata.num_rows,
                              "row_groups": pf.metadata.num_row_groups, "bytes": f.stat().st_size}
            rows += pf.metadata.num_rows
            total_bytes += f.stat().st_size
        assert rows == m["rows"] == corpus.manifest["config"]["params"][name]["rows"]
    assert 100 <= corpus.manifest["totals"]["rows"] <= 1000  # "a few hundred rows" at scale "test"
    assert corpus.manifest["totals"]["bytes"] == total_bytes + Path(corpus.spm_model).stat().st_size
    assert json.loads((corpus.root / "manifest.json").read_text()) == corpus.manifest


def test_every_source_reads_end_to_end(corpus, records):
    for name in SOURCES:
        assert sorted(records[name]) == list(range(corpus.manifest["sources"][name]["rows"]))
        for rec in records[name].values():
            ids = rec["input_ids"]
            assert ids.dtype == torch.int64 and rec["tokens"] == ids.numel() > 2
            assert ids[0] == 1 and ids[-1] == 2 and not rec["truncated"]
            assert (ids[1:-1] > 3).all(), "unk, pad or a control id inside the text"


def test_every_image_decodes_at_its_recorded_size(corpus, records):
    # keys follow sorted-file order and files hold contiguous rows, so key k is the k-th row overall
    table = _concat(corpus.files("caps"), ["width", "height"])
    widths, heights = np.asarray(table["width"]), np.asarray(table["height"])
    for key, rec in records["caps"].items():
        assert rec["orig_size"] == (heights[key], widths[key])
        c, h, w = rec["pixels"].shape
        assert c == 3 and rec["pixels"].dtype == torch.uint8 and h % 14 == 0 and w % 14 == 0
        assert rec["patches"] == (h // 14) * (w // 14) > 0
        assert rec["pixels"].float().std() > 5, "a blank image"
    assert widths.min() >= 64 and heights.min() >= 64 and max(widths.max(), heights.max()) <= 640
    aspect = widths / heights
    assert aspect.min() < 0.8 and aspect.max() > 1.25
    assert len(set(zip(widths.tolist(), heights.tolist()))) > len(widths) // 2
    # skewed towards small images: the median side is well below the midpoint of 64..640
    assert np.median(np.sqrt(widths * heights)) < 300


def _concat(files, columns):
    import pyarrow as pa

    return pa.concat_tables([pq.read_table(f, columns=columns) for f in files])


def test_length_distributions(records):
    tokens = {name: np.array([r["tokens"] for r in records[name].values()]) for name in SOURCES}
    web, code, long_, caps = tokens["web"], tokens["code"], tokens["long"], tokens["caps"]
    assert 100 <= np.median(web) <= 1000
    assert code.mean() > web.mean()
    assert long_.mean() > 4 * web.mean()
    assert long_.max() / np.median(long_) > 3, "long documents are not heavy-tailed"
    assert np.median(caps) < 40 and (caps <= 64).mean() >= 0.85


def test_code_looks_like_code(corpus):
    """Indentation, calls and imports are in the column (the tokenizer may normalise whitespace away)."""
    content = _concat(corpus.files("code"), ["content"])["content"].to_pylist()
    lines = [ln for doc in content for ln in doc.split("\n")]
    indented = sum(ln.startswith("    ") for ln in lines) / len(lines)
    assert indented > 0.5
    assert any(ln.startswith("def ") for ln in lines) and any("(" in ln and ")" in ln for ln in lines)
    assert all(doc.startswith("import ") for doc in content)


def test_image_token_is_one_reserved_id(corpus):
    sp = spm.SentencePieceProcessor(model_file=corpus.spm_model)
    assert (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()) == (0, 1, 2, 3)
    assert corpus.image_token_id == sp.piece_to_id("<image>") not in (0, 1, 2, 3)
    assert sp.id_to_piece(corpus.image_token_id) == "<image>"
    ids = sp.encode("a caption <image> of a picture", out_type=int)
    assert ids.count(corpus.image_token_id) == 1 and sp.unk_id() not in ids
    assert corpus.manifest["spm"]["image_token_id"] == corpus.image_token_id


def test_convenience_source_and_transform(corpus):
    assert isinstance(corpus.transform("caps"), ImageText) and corpus.transform("code").field == "content"
    with corpus.source("web", epochs=1) as src:
        key, rec = next(src)
        assert rec["tokens"] > 0
    with pytest.raises(ConfigError, match="no source 'nope'"):
        corpus.source("nope")


# ------------------------------------------------------------------------------------------------
# caching, rebuilds, determinism
# ------------------------------------------------------------------------------------------------

def test_cache_hit_rewrites_nothing(corpus):
    before, around = snapshot(corpus.root), siblings(corpus.root)
    again = build_demo_corpus(corpus.root, scale="test", seed=0)
    assert snapshot(corpus.root) == before and siblings(corpus.root) == around
    assert again == corpus


def test_same_seed_builds_identical_bytes(corpus, tmp_path):
    other = build_demo_corpus(tmp_path / "again", scale="test", seed=0)
    assert other.manifest["build"]["id"] != corpus.manifest["build"]["id"]  # really built twice
    for name in SOURCES:
        for a, b in zip(corpus.files(name), other.files(name), strict=True):
            assert Path(a).read_bytes() == Path(b).read_bytes(), f"{a} differs"
    assert Path(corpus.spm_model).read_bytes() == Path(other.spm_model).read_bytes()


def test_other_seed_force_and_damage_rebuild(tmp_path):
    root = tmp_path / "c"
    first = build_demo_corpus(root, scale="test", seed=0)
    web0 = _concat(first.files("web"), ["text"])["text"].to_pylist()

    second = build_demo_corpus(root, scale="test", seed=1)
    assert second.manifest["config"]["seed"] == 1
    web1 = _concat(second.files("web"), ["text"])["text"].to_pylist()
    assert web1 != web0 and not set(web1) & set(web0)
    assert siblings(root) == [".c.lock", "c"], "temporary or old directories left behind"

    def rebuilt(c: Corpus) -> bool:
        return c.manifest["build"]["id"] != second.manifest["build"]["id"]

    assert not rebuilt(build_demo_corpus(root, scale="test", seed=1))
    (root / "manifest.json").write_text('{"config": ')           # corrupt manifest
    third = build_demo_corpus(root, scale="test", seed=1)
    assert rebuilt(third) and _concat(third.files("web"), ["text"])["text"].to_pylist() == web1

    Path(third.files("caps")[1]).unlink()                        # a missing file
    fourth = build_demo_corpus(root, scale="test", seed=1)
    assert fourth.manifest["build"]["id"] != third.manifest["build"]["id"]
    assert Path(fourth.files("caps")[1]).is_file()

    with open(fourth.files("long")[0], "r+b") as f:             # a truncated file
        f.truncate(100)
    fifth = build_demo_corpus(root, scale="test", seed=1)
    assert fifth.manifest["build"]["id"] != fourth.manifest["build"]["id"]
    pq.ParquetFile(fifth.files("long")[0])

    (root / "manifest.json").unlink()                            # no manifest at all
    sixth = build_demo_corpus(root, scale="test", seed=1)
    assert sixth.manifest["build"]["id"] != fifth.manifest["build"]["id"]

    forced = build_demo_corpus(root, scale="test", seed=1, force=True)
    assert forced.manifest["build"]["id"] != sixth.manifest["build"]["id"]
    assert siblings(root) == [".c.lock", "c"]


def test_failed_build_leaves_the_old_corpus_untouched(tmp_path, monkeypatch):
    root = tmp_path / "c"
    old = build_demo_corpus(root, scale="test", seed=0)
    before = snapshot(root)

    def boom(*a, **k):
        raise RuntimeError("tokenizer training failed")

    monkeypatch.setattr(corpus_mod, "_train_spm", boom)
    with pytest.raises(RuntimeError, match="tokenizer training failed"):
        build_demo_corpus(root, scale="test", seed=2)
    assert snapshot(root) == before and siblings(root) == [".c.lock", "c"]
    assert build_demo_corpus(root, scale="test", seed=0) == old          # still a cache hit
    with pytest.raises(RuntimeError):
        build_demo_corpus(tmp_path / "fresh", scale="test", seed=0)
    assert not (tmp_path / "fresh").exists(), "a half-written corpus became visible"


def test_concurrent_builders_of_one_root_build_once(tmp_path):
    root, results = tmp_path / "c", []
    threads = [threading.Thread(target=lambda: results.append(build_demo_corpus(root, scale="test", seed=4)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert siblings(root) == [".c.lock", "c"]


def test_refuses_to_replace_a_foreign_directory(tmp_path):
    root = tmp_path / "mine"
    root.mkdir()
    (root / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="notes.txt"):
        build_demo_corpus(root, scale="test")
    assert (root / "notes.txt").read_text() == "keep me" and os.listdir(root) == ["notes.txt"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        build_demo_corpus(tmp_path / "afile", scale="test")


@pytest.mark.parametrize("kwargs, match", [({"scale": "huge"}, "unknown scale"), ({"seed": -1}, "seed"),
                                           ({"seed": 1.5}, "seed")])
def test_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        build_demo_corpus(tmp_path / "c", **kwargs)
    assert not (tmp_path / "c").exists()

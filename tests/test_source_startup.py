"""Opening a source fast (issue 13): the file-metadata journal, rebuilding a source from its spec
without listing or reading footers, and streams that stay bit-identical either way.

Real Parquet / JSON Lines files in a temporary folder; footer reads are counted by a subclass that
overrides ``_open_file`` (and by the source's own ``metadata_reads``).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import torchdata_overlord as ol
from torchdata_overlord.errors import ConfigError
from torchdata_overlord.runtime.job_config import SourceSpec
from torchdata_overlord.sources import ParquetSource
from torchdata_overlord.sources.metadata_cache import FileTable, cache_dir

LAYOUT = [("a.parquet", 23, 5), ("b.parquet", 7, 7), ("c.parquet", 30, 4), ("d.parquet", 11, 3)]
N = sum(rows for _, rows, _ in LAYOUT)


def write(path: Path, gids, row_group_size: int) -> Path:
    gids = list(gids)
    pq.write_table(pa.table({"gid": gids, "text": [f"t{g}" for g in gids]}), path, row_group_size=row_group_size)
    return path


@pytest.fixture
def data(tmp_path) -> str:
    d = tmp_path / "data"
    d.mkdir()
    start = 0
    for name, rows, rg in LAYOUT:
        write(d / name, range(start, start + rows), rg)
        start += rows
    return str(d / "*.parquet")


class Counting(ParquetSource):
    """Records every file whose footer it reads, and the threads that read them."""

    opened: list = []
    threads: set = set()

    def _open_file(self, fs, path, shown):
        Counting.opened.append(Path(shown).name)
        Counting.threads.add(threading.current_thread().name.rsplit("_", 1)[0])
        return super()._open_file(fs, path, shown)


@pytest.fixture
def counting():
    Counting.opened, Counting.threads = [], set()
    return Counting


def take(src, n):
    return [next(src) for _ in range(n)]


def journals(directory) -> list[Path]:
    return sorted(Path(directory).glob("*.json"))


# ---- the journal ------------------------------------------------------------------------------

def test_a_second_opening_reads_no_footer_and_streams_the_same(data, tmp_path, counting):
    cache = tmp_path / "cache"
    first = counting("s", data, seed=3, metadata_cache=str(cache))
    assert sorted(counting.opened) == [n for n, _, _ in LAYOUT] and first.metadata_reads == len(LAYOUT)
    assert len(journals(cache)) == 1
    counting.opened = []
    second = counting("s", data, seed=3, metadata_cache=str(cache))
    assert counting.opened == [] and second.metadata_reads == 0
    plain = ParquetSource("s", data, seed=3, metadata_cache=False)
    assert second.files == first.files == plain.files and second.num_rows == plain.num_rows == N
    assert second.state_dict() == first.state_dict() == plain.state_dict()
    stream = take(plain, 3 * N)
    assert take(first, 3 * N) == stream and take(second, 3 * N) == stream


def test_metadata_cache_false_writes_nothing_and_reads_every_footer(data, tmp_path, counting, monkeypatch):
    monkeypatch.setenv("TORCHDATA_OVERLORD_CACHE", str(tmp_path / "env-cache"))
    for _ in range(2):
        counting("s", data, metadata_cache=False)
    assert len(counting.opened) == 2 * len(LAYOUT)
    assert not (tmp_path / "env-cache").exists()


def test_default_folder_is_the_env_cache_else_xdg(data, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHDATA_OVERLORD_CACHE", str(tmp_path / "env-cache"))
    ParquetSource("s", data)
    assert len(journals(tmp_path / "env-cache" / "metadata")) == 1
    monkeypatch.delenv("TORCHDATA_OVERLORD_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir(None) == str(tmp_path / "xdg" / "torchdata_overlord" / "metadata")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir(None) == str(Path("~/.cache/torchdata_overlord/metadata").expanduser())
    assert cache_dir(False) is None and cache_dir(tmp_path) == str(tmp_path)
    with pytest.raises(ConfigError, match="metadata_cache"):
        ParquetSource("s", data, metadata_cache=3)


def test_a_changed_file_alone_is_read_again_and_its_new_rows_are_used(data, tmp_path, counting):
    cache = str(tmp_path / "cache")
    before = counting("s", data, shuffle=False, metadata_cache=cache)
    d = tmp_path / "data"
    write(d / "b.parquet", list(range(23, 30)) + [1000, 1001, 1002], 4)     # 3 rows appended: a new size
    counting.opened = []
    after = counting("s", data, shuffle=False, metadata_cache=cache)
    assert counting.opened == ["b.parquet"] and after.metadata_reads == 1
    assert after.num_rows == before.num_rows + 3
    gids = [rec["gid"] for _, rec in take(after, after.num_rows)]
    assert gids == list(range(0, 30)) + [1000, 1001, 1002] + list(range(30, N))
    assert after.state_dict()["fingerprint"] == ParquetSource("s", data, shuffle=False, metadata_cache=False
                                                              ).state_dict()["fingerprint"]
    # same size, another mtime: read again too
    os.utime(d / "c.parquet", ns=(1_000_000_000, 1_000_000_000))
    counting.opened = []
    counting("s", data, shuffle=False, metadata_cache=cache)
    assert counting.opened == ["c.parquet"]
    counting.opened = []
    counting("s", data, shuffle=False, metadata_cache=cache)
    assert counting.opened == []


def test_another_file_set_has_its_own_journal(data, tmp_path, counting):
    cache = str(tmp_path / "cache")
    counting("s", data, metadata_cache=cache)
    counting.opened = []
    counting("s", data.replace("*", "[abc]"), metadata_cache=cache)   # d left out: another set
    assert sorted(counting.opened) == ["a.parquet", "b.parquet", "c.parquet"]
    assert len(journals(cache)) == 2
    (tmp_path / "j.jsonl").write_text('{"a": 1}\n')
    assert ol.FileSource("t", str(tmp_path / "j.jsonl"), metadata_cache=cache).num_rows == 1
    assert len(journals(cache)) == 3


def test_a_folder_that_gains_or_loses_files_starts_from_its_previous_journal(data, tmp_path, counting):
    cache = tmp_path / "cache"
    counting("s", data, metadata_cache=str(cache))
    write(tmp_path / "data" / "e.parquet", range(500, 510), 5)
    counting.opened = []
    grown = counting("s", data, metadata_cache=str(cache))
    assert counting.opened == ["e.parquet"] and grown.num_rows == N + 10
    assert len(journals(cache)) == 1                       # the new file set's journal replaced the old one
    (tmp_path / "data" / "a.parquet").unlink()
    counting.opened = []
    shrunk = counting("s", data, metadata_cache=str(cache))
    assert counting.opened == [] and shrunk.num_rows == N + 10 - 23 and len(journals(cache)) == 1
    assert take(shrunk, 2 * shrunk.num_rows) == take(ParquetSource("s", data, metadata_cache=False),
                                                      2 * shrunk.num_rows)


@pytest.mark.parametrize("damage", [b"\x00garbage", b'{"version": 1, "kind": "parquet", "prefix": "/x"',
                                    b'{"version": 1, "kind": "parquet", "prefix": "", "tails": ["a"], "size": [1], '
                                    b'"mtime": [1], "ngroups": [2], "groups": [1], "schema": [0], "schemas": [["x"]]}',
                                    b'[1, 2, 3]'])
def test_a_corrupt_journal_is_ignored_and_rewritten(data, tmp_path, counting, damage):
    cache = tmp_path / "cache"
    expected = take(counting("s", data, metadata_cache=str(cache)), N)
    (journal,) = journals(cache)
    journal.write_bytes(damage)
    counting.opened = []
    src = counting("s", data, metadata_cache=str(cache))
    assert len(counting.opened) == len(LAYOUT) and take(src, N) == expected
    assert json.loads(journal.read_bytes())["kind"] == "parquet"           # rewritten whole
    counting.opened = []
    counting("s", data, metadata_cache=str(cache))
    assert counting.opened == []


def test_a_journal_entry_of_a_since_corrupted_file_is_not_trusted(data, tmp_path, counting, caplog):
    cache = str(tmp_path / "cache")
    counting("s", data, shuffle=False, metadata_cache=cache)
    (tmp_path / "data" / "b.parquet").write_bytes(b"PAR1 not parquet any more")     # size and mtime change
    with pytest.raises(ConfigError, match=r"b\.parquet: not a readable Parquet file"):
        ParquetSource("s", data, metadata_cache=cache)
    counting.opened = []
    src = counting("s", data, shuffle=False, on_error="skip", metadata_cache=cache)
    assert counting.opened == ["b.parquet"] and src.metadata_reads == 1
    assert [s["file"].rsplit("/", 1)[1] for s in src.skipped] == ["b.parquet"] and src.skipped[0]["row"] is None
    assert src.skips.total == 1 and src.num_rows == N - 7
    assert [rec["gid"] for _, rec in take(src, N - 7)] == list(range(23)) + list(range(30, N))


def test_a_failed_first_opening_leaves_no_journal_that_breaks_a_later_one(tmp_path, counting):
    """The only file is half uploaded: opening fails naming it, and writes no (empty) journal, so the
    opening after the upload ends reads the file and works (it used to fail with an IndexError into
    the empty journal until the cache was deleted). An empty journal left by an older release is
    ignored the same way."""
    from torchdata_overlord.sources.metadata_cache import save_journal
    cache, d = str(tmp_path / "cache"), tmp_path / "data"
    d.mkdir()
    whole = write(d / "x.parquet", range(10), 4).read_bytes()
    (d / "x.parquet").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ConfigError, match=r"x\.parquet: not a readable Parquet file"):
        ParquetSource("s", str(d / "*.parquet"), metadata_cache=cache)
    with pytest.raises(ConfigError, match=r"has no rows: all its 1 file\(s\) were skipped \(on_error='skip'\): "
                                          r".*x\.parquet"):
        ParquetSource("s", str(d / "*.parquet"), on_error="skip", metadata_cache=cache)
    assert journals(cache) == []
    (d / "x.parquet").write_bytes(whole)
    src = counting("s", str(d / "*.parquet"), shuffle=False, metadata_cache=cache)
    assert counting.opened == ["x.parquet"] and [r["gid"] for _, r in take(src, 10)] == list(range(10))
    (journal,) = journals(cache)
    save_journal(str(journal), "parquet", FileTable([], [], [], [], []))
    counting.opened = []
    assert counting("s", str(d / "*.parquet"), metadata_cache=cache).num_rows == 10
    assert counting.opened == ["x.parquet"]
    counting.opened = []
    counting("s", str(d / "*.parquet"), metadata_cache=cache)
    assert counting.opened == []                                    # the journal was rewritten


def test_an_unwritable_cache_folder_means_no_journal_logged_once(data, tmp_path, counting, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    caplog.set_level(logging.DEBUG, logger="torchdata_overlord")
    for _ in range(2):
        src = counting("s", data, metadata_cache=str(blocker / "cache"))
        assert take(src, 3)
    assert len(counting.opened) == 2 * len(LAYOUT)
    assert sum("journal not written" in r.getMessage() for r in caplog.records) == 1
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        counting("s", data, metadata_cache=str(ro))
        if os.geteuid() != 0:                   # root writes anyway
            assert journals(ro) == []
    finally:
        ro.chmod(0o755)


# ---- rebuilding from a spec -------------------------------------------------------------------

def rebuild(src):
    """The source as another process builds it: its spec through pickle, then built."""
    return pickle.loads(pickle.dumps(SourceSpec.from_source(src))).build()


def test_a_source_rebuilt_from_its_spec_reads_no_footer_and_lists_nothing(data, tmp_path, counting):
    src = counting("s", data, seed=4, metadata_cache=False)
    spec = pickle.dumps(SourceSpec.from_source(src))
    head = take(src, 20)
    write(tmp_path / "data" / "e.parquet", range(500, 510), 5)            # a new file: not listed again
    counting.opened = []
    again = pickle.loads(spec).build()
    assert type(again) is Counting and counting.opened == [] and again.metadata_reads == 0
    assert again.files == src.files and again.num_rows == N and take(again, 20) == head
    mid = rebuild(src)                                                   # its state: after 20 samples
    assert counting.opened == [] and take(mid, 2 * N) == take(src, 2 * N)
    # the fingerprint is unchanged: another file set's state is refused, this one's accepted
    other = ParquetSource("s", data.replace("*", "[ab]"), seed=4, metadata_cache=False)
    with pytest.raises(ConfigError, match="file list differs"):
        again.load_state_dict(other.state_dict())
    with pytest.raises(ConfigError, match="file list differs"):
        rebuild(other).load_state_dict(src.state_dict())


def test_a_rebuilt_source_counts_the_files_skipped_at_open(data, tmp_path):
    (tmp_path / "data" / "b.parquet").write_bytes(b"garbage")
    src = ParquetSource("s", data, on_error="skip", metadata_cache=False)
    again = rebuild(src)
    assert again.skipped == src.skipped and again.skips.total == 1 and again.files == src.files


def test_spec_of_uri_and_filesystem_sources_rebuilds_them(data, tmp_path):
    sub = pafs.SubTreeFileSystem(str(tmp_path / "data"), pafs.LocalFileSystem())
    for src in (ParquetSource("s", "file://" + data, seed=2), ParquetSource("s", "*.parquet", seed=2, filesystem=sub)):
        again = rebuild(src)
        assert again.files == src.files and again.metadata_reads == 0
        assert take(again, N) == take(src, N)


def test_a_file_rewritten_after_the_source_opened_is_named_when_read(data, tmp_path):
    src = ParquetSource("s", data, shuffle=False, metadata_cache=False)
    write(tmp_path / "data" / "a.parquet", range(23), 6)                # valid Parquet, other row groups
    with pytest.raises(ol.SourceReadError, match=r"a\.parquet row group 0 .*row groups of \[6, 6, 6, 5\] rows now, "
                                                 r"\[5, 5, 5, 5, 3\] when the source was opened"):
        next(src)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_file_rewritten_in_place_with_the_same_row_groups_is_not_read_as_the_old_one(tmp_path, on_error):
    """The same row groups and bytes, other rows: its new rows came under the old file's sample keys, with
    no error. The listing's mtime tells (set here a second on: the rewrite comes later, and a filesystem's
    clock may not have ticked within a test)."""
    import os

    path = tmp_path / "a.parquet"
    plain = dict(row_group_size=5, compression="none", use_dictionary=False, write_statistics=False)
    pq.write_table(pa.table({"gid": list(range(20))}), path, **plain)
    src = ParquetSource("s", str(path), shuffle=False, metadata_cache=False, on_error=on_error)
    size, mtime = path.stat().st_size, path.stat().st_mtime_ns
    pq.write_table(pa.table({"gid": list(range(100, 120))}), path, **plain)
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))
    assert path.stat().st_size == size                                 # nothing but the mtime tells
    if on_error == "raise":
        with pytest.raises(ol.SourceReadError, match=r"a\.parquet row group 0 .*modified since the source was opened"):
            next(src)
    else:
        with pytest.raises(ol.SourceReadError, match="no row of this source is usable .*modified since the source"):
            next(src)                                                   # every row group skipped, and counted
        assert len(src.skipped) == 4 and all("modified since" in e["error"] for e in src.skipped)


def test_file_table_of_100k_files_pickles_small_and_round_trips():
    n = 100_000
    shown = [f"/data/corpus/part-{i:06d}.parquet" for i in range(n)]
    names = ["id", "text"]
    t = FileTable(shown, [1000 + i % 7 for i in range(n)], [1_700_000_000_000_000_000 + i for i in range(n)],
                  [(4,)] * (n - 1) + [(3, 2)], [names] * n, [["/data/x.parquet", "boom"]],
                  [pafs.LocalFileSystem()], np.zeros(n, np.int32))
    blob = pickle.dumps(t)
    assert len(blob) < 4 * 2**20
    assert pickle.dumps(t) == blob            # the second pickling reuses the column-wise form: the same bytes
    back = pickle.loads(blob)
    assert back.shown == shown and back.size == t.size and back.mtime == t.mtime and back.groups == t.groups
    assert back.names == t.names and back.names[0] is back.names[-1] and back.skipped == t.skipped
    assert list(back.fs_index) == [0] * n and back.filesystems[0].type_name == "local"



@pytest.mark.parametrize("seed", range(4))
def test_file_tables_of_random_shapes_round_trip_through_pickle_and_json(seed, tmp_path):
    """Files of 0..3 row groups (or all of one: the one-group fast path), two schemas: pickled and
    journaled tables give back every column."""
    from torchdata_overlord.sources.metadata_cache import load_journal, save_journal
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    one = seed % 2 == 0
    groups = [(int(rng.integers(1, 9)),) if one else tuple(int(x) for x in rng.integers(1, 9, rng.integers(0, 4)))
              for _ in range(n)]
    a, b = ["id", "text"], ["text"]
    names = [a if rng.random() < 0.5 else b for _ in range(n)]
    t = FileTable([f"/d/{i:03d}.parquet" for i in range(n)], rng.integers(0, 10**6, n).tolist(),
                  rng.integers(-1, 10**12, n).tolist(), groups, names, (), [pafs.LocalFileSystem()],
                  np.zeros(n, np.int32))
    path = str(tmp_path / "j.json")
    save_journal(path, "parquet", t)
    for back in (pickle.loads(pickle.dumps(t)), load_journal(path, "parquet")):
        assert (back.shown, back.size, back.mtime, back.groups) == (t.shown, t.size, t.mtime, groups)
        assert back.names == names and all(isinstance(g, tuple) for g in back.groups)


def test_a_folder_of_folders_lists_every_parquet_file_at_every_depth(tmp_path):
    """A folder source finds the files at its top and in nested subfolders (listed on threads), and
    nothing else; ``**`` (zero or more folders) globs the same; the order is the sorted paths'."""
    root = tmp_path / "corpus"
    rng = np.random.default_rng(0)
    made = []
    for k, rel in enumerate(["top.parquet", "a/x.parquet", "a/b/y.parquet", "a/b/c/z.parquet", "d/w.parquet",
                             "e/f/v.parquet"] + [f"g{i}/u.parquet" for i in range(7)]):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        made.append(str(write(p, range(k * 10, k * 10 + int(rng.integers(1, 5))), 2)))
    (root / "a" / "notes.txt").write_text("not parquet")
    (root / "empty").mkdir()
    src = ParquetSource("s", str(root), metadata_cache=False)
    assert src.files == sorted(made)
    assert ParquetSource("s", str(root / "**" / "*.parquet"), metadata_cache=False).files == sorted(made)
    assert ParquetSource("s", str(root / "a" / "**" / "?.parquet"), metadata_cache=False).files == \
        sorted(m for m in made if "/a/" in m)

# ---- the state format, and text files ---------------------------------------------------------

def test_the_state_format_and_an_old_state_loads(data, tmp_path):
    src = ParquetSource("s", data, seed=5, columns=["gid"])
    d = tmp_path / "data"
    old = {"epoch": 1, "unit": 2, "row": 1, "fingerprint": {
        "name": "s", "seed": 5, "shuffle": True, "columns": ["gid"],
        "files": [[str(d / n), (d / n).stat().st_size, rows] for n, rows, _ in LAYOUT]}}
    # the format gained "units" and "ahead" (per-unit progress of data-parallel parts); a state without them loads
    assert src.state_dict() == {**old, "epoch": 0, "unit": 0, "row": 0, "units": src.units, "ahead": []}
    src.load_state_dict(old)
    ref = ParquetSource("s", data, seed=5, columns=["gid"], metadata_cache=False)
    while (ref.epoch, ref._unit, ref._row) != (1, 2, 1):
        next(ref)
    assert take(src, N) == take(ref, N)


class CountingText(ol.FileSource):
    parsed: list = []

    def _open_file(self, fs, path, shown):
        CountingText.parsed.append(Path(shown).name)
        return super()._open_file(fs, path, shown)


def test_text_files_row_counts_are_journaled_too(tmp_path):
    d = tmp_path / "text"
    d.mkdir()
    for f in range(3):
        (d / f"p{f}.jsonl").write_text("".join(json.dumps({"id": f * 100 + i}) + "\n" for i in range(5 + f)))
    cache = str(tmp_path / "cache")
    CountingText.parsed = []
    first = CountingText("t", str(d / "*.jsonl"), shuffle=False, metadata_cache=cache)
    assert len(CountingText.parsed) == 3 and first.num_rows == 18
    CountingText.parsed = []
    second = CountingText("t", str(d / "*.jsonl"), shuffle=False, metadata_cache=cache)
    assert CountingText.parsed == [] and [r for _, r in take(second, 18)] == [r for _, r in take(first, 18)]
    with open(d / "p1.jsonl", "a") as f:
        f.write(json.dumps({"id": 199}) + "\n")
    CountingText.parsed = []
    third = CountingText("t", str(d / "*.jsonl"), shuffle=False, metadata_cache=cache)
    assert CountingText.parsed == ["p1.jsonl"] and third.num_rows == 19
    assert [r["id"] for _, r in take(third, 19)][5:12] == [100, 101, 102, 103, 104, 105, 199]
    again = rebuild(third)
    assert CountingText.parsed == ["p1.jsonl"] and again.format is None and again.num_rows == 19


# ---- footers on a non-local filesystem: read on a thread pool ---------------------------------

def test_footers_on_a_non_local_filesystem_are_read_in_parallel_with_the_same_results(data, tmp_path, counting):
    fsspec = pytest.importorskip("fsspec")
    d = tmp_path / "data"
    remote = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("file")))       # not "local"
    scheme = remote.type_name + "://"
    local = counting("s", data, seed=6, metadata_cache=False)
    assert counting.threads == {"MainThread"}                       # local files: one after another
    counting.opened, counting.threads = [], set()
    src = counting("s", data, seed=6, filesystem=remote, metadata_cache=False)
    assert sorted(counting.opened) == [n for n, _, _ in LAYOUT] and counting.threads == {"overlord-open"}
    assert src.files == [scheme + f for f in local.files] and take(src, 2 * N) == take(local, 2 * N)
    again = rebuild(src)
    assert again.metadata_reads == 0 and take(again, N) == take(src, N)
    # the same errors, in file order: a corrupt file and one without the projected column
    (d / "b.parquet").write_bytes(b"garbage")
    pq.write_table(pa.table({"other": [1, 2]}), d / "c.parquet")
    with pytest.raises(ConfigError, match=r"fsspec.*b\.parquet: not a readable Parquet file"):
        ParquetSource("s", data, columns=["gid"], filesystem=remote, metadata_cache=False)
    skip = ParquetSource("s", data, columns=["gid"], filesystem=remote, on_error="skip", metadata_cache=False)
    assert [(s["file"].rsplit("/", 1)[1], s["error"].split(":")[0]) for s in skip.skipped] == [
        ("b.parquet", "ConfigError"), ("c.parquet", "ConfigError")]
    assert "has no column(s) ['gid']" in skip.skipped[1]["error"]
    assert skip.num_rows == 23 + 11 and skip.files == [scheme + str(d / n) for n in ("a.parquet", "d.parquet")]


def test_a_state_of_many_files_carries_their_digest_and_refuses_another_file_set(tmp_path):
    """Beyond FILES_LISTED files a state says their count, rows and digest, not every file: it is taken
    for every buffered sample and travels with every step, so at 100,000 files a list made each one MBs."""
    from torchdata_overlord.errors import ConfigError
    from torchdata_overlord.sources.parquet import FILES_LISTED

    d = tmp_path / "many"
    d.mkdir()
    for i in range(FILES_LISTED + 6):
        pq.write_table(pa.table({"x": list(range(i, i + 3))}), d / f"f{i:03d}.parquet")
    src = ParquetSource("s", str(d / "*.parquet"), metadata_cache=False)
    for _ in range(5):
        next(src)
    state = src.state_dict()
    files = state["fingerprint"]["files"]
    assert files["count"] == FILES_LISTED + 6 and files["rows"] == src.num_rows and len(files["sha256"]) == 64
    again = ParquetSource("s", str(d / "*.parquet"), metadata_cache=False)
    again.load_state_dict(state)
    assert take(again, 7) == take(src, 7)
    (d / "f003.parquet").unlink()
    with pytest.raises(ConfigError, match="file set differs from the state's"):
        ParquetSource("s", str(d / "*.parquet"), metadata_cache=False).load_state_dict(state)


def test_a_state_with_the_previous_releases_file_digest_still_loads(tmp_path):
    """States of release 2026-11-23 hashed the file list's JSON; this release hashes arrays (100,000 files:
    0.2 s -> 0.04 s). A state with the old digest loads over the same files and is refused over others."""
    import hashlib

    from torchdata_overlord.sources.parquet import FILES_LISTED

    d = tmp_path / "many"
    d.mkdir()
    for i in range(FILES_LISTED + 2):
        pq.write_table(pa.table({"x": list(range(i, i + 2))}), d / f"f{i:03d}.parquet")
    src = ParquetSource("s", str(d / "*.parquet"), metadata_cache=False)
    take(src, 3)
    state = src.state_dict()
    listed = [[f, os.path.getsize(f), 2] for f in sorted(str(p) for p in d.glob("*.parquet"))]
    old = hashlib.sha256(json.dumps(listed, separators=(",", ":")).encode()).hexdigest()
    assert state["fingerprint"]["files"]["sha256"] != old            # the digest did change
    state["fingerprint"]["files"]["sha256"] = old
    again = ParquetSource("s", str(d / "*.parquet"), metadata_cache=False)
    again.load_state_dict(state)
    assert take(again, 5) == take(src, 5)
    pq.write_table(pa.table({"x": [7, 8, 9]}), d / "f000.parquet")      # another file set: 3 rows, not 2
    with pytest.raises(ConfigError, match="file set differs from the state's"):
        ParquetSource("s", str(d / "*.parquet"), metadata_cache=False).load_state_dict(state)


def test_a_state_of_many_files_resumes_over_a_copy_under_another_root(tmp_path, caplog):
    """Beyond FILES_LISTED files the digest also hashes each path relative to the file set's root: a state
    loads over the same files copied under another root and continues bit for bit. A changed file in the copy
    is refused; a state of the previous format (absolute paths only) still loads in place, and over the copy
    is refused saying why."""
    import shutil

    from torchdata_overlord.sources.parquet import FILES_LISTED

    d = tmp_path / "bucket" / "many"
    for i in range(FILES_LISTED + 6):
        (d / f"part{i % 3}").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"x": list(range(i, i + 3 + i % 2))}), d / f"part{i % 3}" / f"f{i:03d}.parquet",
                       row_group_size=2)
    glob = str(d / "**" / "*.parquet")
    src = ParquetSource("s", glob, metadata_cache=False)
    take(src, 50)
    state = src.state_dict()
    files = state["fingerprint"]["files"]
    assert files["root"] == str(d) and len(files["relative_sha256"]) == 64
    copy = tmp_path / "ssd" / "copy"
    shutil.copytree(d, copy)
    moved = ParquetSource("s", str(copy / "**" / "*.parquet"), metadata_cache=False)
    with caplog.at_level(logging.INFO, logger="torchdata_overlord"):
        moved.load_state_dict(state)
    assert f"{FILES_LISTED + 6} files moved from {d} to {copy}" in caplog.text
    assert take(moved, 300) == take(src, 300)
    previous = {**state, "fingerprint": {**state["fingerprint"], "files": {
        k: v for k, v in files.items() if k in ("count", "rows", "sha256")}}}        # a state of the last release
    again = ParquetSource("s", glob, metadata_cache=False)
    again.load_state_dict(previous)
    with pytest.raises(ConfigError, match=r"file set differs.*sha256 [0-9a-f]{12}; now .* sha256 [0-9a-f]{12}, "
                                          r"over \[path, bytes, rows\].*earlier release records its files by "
                                          r"absolute path only"):
        ParquetSource("s", str(copy / "**" / "*.parquet"), metadata_cache=False).load_state_dict(previous)
    pq.write_table(pa.table({"x": [7, 8, 9]}), copy / "part1" / "f004.parquet")       # 3 rows, not 4
    with pytest.raises(ConfigError, match=rf"file set differs from the state's \({FILES_LISTED + 6} files of \d+ "
                                          rf"rows under {d},.*now {FILES_LISTED + 6} files of \d+ rows under {copy}"):
        ParquetSource("s", str(copy / "**" / "*.parquet"), metadata_cache=False).load_state_dict(state)


def test_a_state_over_an_object_store_resumes_over_a_local_copy_and_another_prefix(data, tmp_path):
    """A source's files on a non-local filesystem (an object store's stand-in: its paths carry a scheme, as
    ``s3://bucket/prefix/...`` do) are the same file set as their copy on local disk or under another prefix."""
    import shutil

    fsspec = pytest.importorskip("fsspec")
    remote = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("file")))
    src = ParquetSource("s", data, seed=2, filesystem=remote, metadata_cache=False)
    assert src.files[0].startswith(remote.type_name + "://")
    take(src, 17)
    state = src.state_dict()
    shutil.copytree(tmp_path / "data", tmp_path / "prefix2")
    local = ParquetSource("s", str(tmp_path / "prefix2" / "*.parquet"), seed=2, metadata_cache=False)
    local.load_state_dict(state)
    other = ParquetSource("s", str(tmp_path / "prefix2" / "*.parquet"), seed=2, filesystem=remote, metadata_cache=False)
    other.load_state_dict(local.state_dict())
    expected = take(src, N)
    assert take(local, N) == expected and take(other, N) == expected


def test_profiling_shares_a_row_budget_over_many_sources(tmp_path):
    """A job's first start profiles every source: 128 rows each up to 32 sources, fewer beyond (at least
    ROWS_FLOOR), so 300 sources cost seconds, not half a minute."""
    from torchdata_overlord.scaling.profile import ROWS_FLOOR, ROWS_PER_JOB, profile_sources

    (tmp_path / "d").mkdir()
    path = tmp_path / "d" / "a.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(400)]}), path, row_group_size=200)
    few = profile_sources([ParquetSource(f"s{i}", str(path), metadata_cache=False) for i in range(2)])
    many = profile_sources([ParquetSource(f"s{i}", str(path), metadata_cache=False) for i in range(300)])
    assert {p.measured_rows for p in few.values()} == {128}
    assert {p.measured_rows for p in many.values()} == {max(ROWS_FLOOR, ROWS_PER_JOB // 300)}

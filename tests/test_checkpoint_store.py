"""CheckpointStore: atomic versioned checkpoints, corruption detection and fallback, gc, pickling.

Real files under ``tmp_path`` (plus pyarrow's in-memory ``mock://`` filesystem for the generic,
non-local write path); failures are injected by editing the files by hand.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchdata_overlord.errors import ConfigError, OverlordError
from torchdata_overlord.runtime.checkpoint_store import CheckpointStore, CorruptCheckpoint

STATE = {"step": 7, "rng": [1, 2, 3], "cursor": {"web": 120, "code": 4}, "ratio": 0.25,
         "done": False, "note": None, "name": "planner"}


def _tmp_file(store, key, mtime):
    """A leftover temporary, as a writer that crashed mid-write would leave it."""
    directory = os.path.dirname(store.path(key, 0))
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
    with open(path, "wb") as f:
        f.write(b"0123abc\n{\"half\":")
    os.utime(path, (mtime, mtime))
    return path


def test_round_trip_and_file_format(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    path = store.put("planner", 3, STATE)
    assert path.endswith("planner/step-000000000003.ckpt") and os.path.isfile(path)
    assert store.get("planner", 3) == STATE
    header, payload = open(path, "rb").read().split(b"\n", 1)
    assert len(header) == 64 and payload.startswith(b'{"cursor":{"code":4,"web":120}')
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".tmp-")]


def test_root_directory_created_and_relative_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = CheckpointStore("rel/ckpt")
    assert store.root == str(tmp_path / "rel" / "ckpt") and os.path.isdir(store.root)


def test_versions_ascending_and_latest_at_most(tmp_path):
    store = CheckpointStore(tmp_path)
    assert store.steps("k") == [] and store.latest("k") is None
    for step in (5, 1, 12, 3):
        store.put("k", step, {"s": step})
    assert store.steps("k") == [1, 3, 5, 12]
    assert store.latest("k") == (12, {"s": 12})
    assert store.latest("k", at_most=11) == (5, {"s": 5})
    assert store.latest("k", at_most=3) == (3, {"s": 3})
    assert store.latest("k", at_most=0) is None
    store.put("k", 5, {"s": "again"})                     # same step: replaced atomically
    assert store.get("k", 5) == {"s": "again"} and store.steps("k") == [1, 3, 5, 12]


def test_corrupt_newest_falls_back_and_is_counted(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    for step in range(3):
        store.put("constructor:0", step, {"s": step, "pad": "x" * 50})
    path = store.path("constructor:0", 2)
    size = os.path.getsize(path)
    store.corrupt("constructor:0", 2)
    assert os.path.getsize(path) == size
    with caplog.at_level(logging.WARNING, logger="torchdata_overlord"):
        assert store.latest("constructor:0") == (1, {"s": 1, "pad": "x" * 50})
    assert store.corrupt_skipped == 1
    assert any(path in r.getMessage() for r in caplog.records)
    with pytest.raises(CorruptCheckpoint, match="checksum") as exc:
        store.get("constructor:0", 2)
    assert path in str(exc.value)
    assert isinstance(exc.value, OverlordError) and isinstance(exc.value, RuntimeError)
    store.corrupt("constructor:0", 1)
    store.corrupt("constructor:0", 0)
    assert store.latest("constructor:0") is None and store.corrupt_skipped == 4


def test_truncated_files_detected(tmp_path):
    store = CheckpointStore(tmp_path)
    path = store.put("k", 1, STATE)
    data = open(path, "rb").read()
    for cut, what in ((len(data) - 5, "checksum"), (30, "truncated"), (65, "checksum"), (0, "empty")):
        with open(path, "wb") as f:
            f.write(data[:cut])
        with pytest.raises(CorruptCheckpoint, match=what) as exc:
            store.get("k", 1)
        assert path in str(exc.value)
    assert store.latest("k") is None


def test_missing_header_and_bad_json_detected(tmp_path):
    store = CheckpointStore(tmp_path)
    path = store.put("k", 1, STATE)
    with open(path, "wb") as f:
        f.write(b'{"no":"header"}')
    with pytest.raises(CorruptCheckpoint, match="missing header"):
        store.get("k", 1)
    with open(path, "wb") as f:
        f.write(b"not-a-digest\n{}")
    with pytest.raises(CorruptCheckpoint, match="missing header"):
        store.get("k", 1)
    payload = b"{not json"
    with open(path, "wb") as f:
        f.write(hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    with pytest.raises(CorruptCheckpoint, match="bad JSON"):
        store.get("k", 1)


def test_absent_version_raises_file_not_found_with_path(tmp_path):
    store = CheckpointStore(tmp_path)
    store.put("k", 1, 1)
    with pytest.raises(FileNotFoundError, match="step-000000000002.ckpt") as exc:
        store.get("k", 2)
    assert "steps present: [1]" in str(exc.value)
    with pytest.raises(FileNotFoundError):
        store.get("other", 0)


def test_leftover_temporary_ignored_then_removed_by_gc(tmp_path):
    store = CheckpointStore(tmp_path)
    store.put("loader/web", 1, {"pos": 1})
    stale = _tmp_file(store, "loader/web", mtime=1_000_000_000)    # crashed long ago
    store.put("loader/web", 2, {"pos": 2})
    fresh = _tmp_file(store, "loader/web", mtime=4_000_000_000)    # a write still in flight
    assert store.steps("loader/web") == [1, 2]
    assert store.latest("loader/web") == (2, {"pos": 2}) and store.corrupt_skipped == 0
    assert store.gc("loader/web") == []
    assert not os.path.exists(stale) and os.path.exists(fresh)
    assert store.steps("loader/web") == [1, 2]


def test_gc_keep_and_keep_from(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    for step in range(10):
        store.put("p", step, step)
    assert store.gc("p") == [0, 1, 2, 3, 4, 5, 6]
    assert store.steps("p") == [7, 8, 9]
    for step in range(10, 20):
        store.put("p", step, step)
    assert store.gc("p", keep=2, keep_from=12) == [7, 8, 9, 10, 11]
    assert store.steps("p") == list(range(12, 20))
    assert store.gc("p", keep=1, keep_from=0) == []
    assert store.gc("p", keep=1) == list(range(12, 19)) and store.steps("p") == [19]
    assert store.gc("absent") == []


def test_file_uri_root(tmp_path):
    root = tmp_path / "via-uri"
    store = CheckpointStore(f"file://{root}")
    assert os.path.isdir(root)
    store.put("k", 4, {"a": [1, 2]})
    assert os.path.isfile(root / "k" / "step-000000000004.ckpt")
    assert store.latest("k") == (4, {"a": [1, 2]})
    assert CheckpointStore(f"file://{root}").get("k", 4) == {"a": [1, 2]}


def test_generic_pyarrow_filesystem_path():
    """``mock://``: pyarrow's in-memory filesystem takes the open_output_stream + move branch."""
    store = CheckpointStore("mock:///ckpt", keep=1)
    for step in range(3):
        store.put("loader/web", step, {"pos": step})
    store.corrupt("loader/web", 2)
    assert store.latest("loader/web") == (1, {"pos": 1}) and store.corrupt_skipped == 1
    assert store.gc("loader/web") == [0, 1] and store.steps("loader/web") == [2]


def test_pickle_round_trip(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    store.put("k", 1, {"v": 1})
    store.corrupt_skipped = 5
    assert store.__getstate__() == {"root": str(tmp_path), "keep": 2}
    clone = pickle.loads(pickle.dumps(store))
    assert (clone.root, clone.keep, clone.corrupt_skipped) == (str(tmp_path), 2, 0)
    assert clone.get("k", 1) == {"v": 1}
    clone.put("k", 2, {"v": 2})
    assert store.latest("k") == (2, {"v": 2})
    assert repr(clone) == f"CheckpointStore(root={str(tmp_path)!r}, keep=2)"
    uri = pickle.loads(pickle.dumps(CheckpointStore(f"file://{tmp_path}")))
    assert uri.latest("k") == (2, {"v": 2})


def test_keys_with_slash_and_colon(tmp_path):
    store = CheckpointStore(tmp_path)
    keys = ["loader/web", "constructor:0", "a:b", "a_b", "loader/web/shard:3"]
    for i, key in enumerate(keys):
        store.put(key, i, {"key": key})
    for i, key in enumerate(keys):
        assert store.steps(key) == [i] and store.latest(key) == (i, {"key": key})
    assert store.path("constructor:0", 0) == store.path("constructor:0", 0)
    assert ":" not in os.path.relpath(store.path("constructor:0", 0), tmp_path)


@pytest.mark.parametrize("call, arg", [
    (lambda r: CheckpointStore(r, keep=0), "keep"),
    (lambda r: CheckpointStore(r, keep=True), "keep"),
    (lambda r: CheckpointStore(""), "root"),
    (lambda r: CheckpointStore(r).put("k", -1, {}), "step"),
    (lambda r: CheckpointStore(r).put("k", True, {}), "step"),
    (lambda r: CheckpointStore(r).put("k", 1.0, {}), "step"),
    (lambda r: CheckpointStore(r).put("", 1, {}), "key"),
    (lambda r: CheckpointStore(r).put("a/../b", 1, {}), "key"),
    (lambda r: CheckpointStore(r).put("/abs", 1, {}), "key"),
    (lambda r: CheckpointStore(r).put(3, 1, {}), "key"),
    (lambda r: CheckpointStore(r).put("k", 1, {"x": object()}), "obj"),
    (lambda r: CheckpointStore(r).get("k", -2), "step"),
    (lambda r: CheckpointStore(r).latest("k", at_most=-1), "at_most"),
    (lambda r: CheckpointStore(r).gc("k", keep=0), "keep"),
    (lambda r: CheckpointStore(r).gc("k", keep_from=-1), "keep_from"),
])
def test_bad_arguments_raise_config_error(tmp_path, call, arg):
    with pytest.raises(ConfigError, match=arg):
        call(str(tmp_path))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(versions=st.lists(st.tuples(st.integers(1, 5), _JSON, st.booleans()), min_size=1, max_size=8),
       queries=st.lists(st.integers(0, 45), min_size=1, max_size=6))
def test_latest_is_newest_uncorrupted_version_at_most(versions, queries):
    with tempfile.TemporaryDirectory() as root:
        store = CheckpointStore(root)
        step, written = -1, []
        for gap, obj, corrupted in versions:
            step += gap
            store.put("loader/web:0", step, obj)
            if corrupted:
                store.corrupt("loader/web:0", step)
            written.append((step, obj, corrupted))
        for s in queries:
            valid = [(st_, obj) for st_, obj, bad in written if not bad and st_ <= s]
            assert store.latest("loader/web:0", at_most=s) == (valid[-1] if valid else None)
        assert store.latest("loader/web:0", at_most=None) == next(
            ((st_, obj) for st_, obj, bad in reversed(written) if not bad), None)


def test_discard_drops_versions_from_a_step(tmp_path):
    store = CheckpointStore(str(tmp_path / "s"))
    for step in (1, 2, 5, 9):
        store.put("planner", step, {"v": step})
    assert store.discard("planner", 5) == [5, 9]
    assert store.steps("planner") == [1, 2] and store.latest("planner") == (2, {"v": 2})
    assert store.discard("planner", 10) == []

"""The Source protocol and its implementations beyond Parquet: FileSource (JSON Lines, CSV, Arrow IPC,
gzip) and NodeSource (any stateful torchdata node). Real files written by pyarrow and gzip in a temp dir."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.ipc as paipc
import pytest
import torch
from torchdata.nodes import BaseNode, IterableWrapper

import torchdata_overlord as ol
from torchdata_overlord.roles.source_loader import SourceLoader
from torchdata_overlord.runtime.job_config import SourceSpec
from torchdata_overlord.testing import assert_identical, make_text_corpus

ROOT = Path(__file__).resolve().parent.parent
FILES, ROWS = 3, 17                  # rows per file


def _rows(f: int) -> list[dict]:
    texts = make_text_corpus(ROWS, seed=f)
    return [{"id": f * 1000 + r, "text": t} for r, t in enumerate(texts)]


def write(tmp: Path, fmt: str) -> str:
    """FILES files of ROWS rows in format ``fmt``; returns the glob."""
    tmp.mkdir(parents=True, exist_ok=True)
    for f in range(FILES):
        rows = _rows(f)
        if fmt in ("jsonl", "jsonl.gz"):
            text = "".join(json.dumps(r) + "\n" for r in rows).encode()
            (tmp / f"part-{f}.{fmt}").write_bytes(gzip.compress(text) if fmt.endswith(".gz") else text)
        elif fmt == "csv":
            pacsv.write_csv(pa.Table.from_pylist(rows), str(tmp / f"part-{f}.csv"))
        elif fmt in ("arrow", "arrows"):          # the IPC file format, and the stream format
            table = pa.Table.from_pylist(rows)
            opener = paipc.new_file if fmt == "arrow" else paipc.new_stream
            with pa.OSFile(str(tmp / f"part-{f}.arrow"), "wb") as sink, opener(sink, table.schema) as w:
                w.write_table(table)
    return str(tmp / "*")


FORMATS = ["jsonl", "jsonl.gz", "csv", "arrow", "arrows"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_source_reads_every_row_once_per_epoch(tmp_path, fmt):
    src = ol.FileSource("t", write(tmp_path, fmt), shuffle=False, epochs=2)
    assert isinstance(src, ol.Source) and src.num_rows == FILES * ROWS
    got = [rec for _, rec in src]
    expected = [r for f in range(FILES) for r in _rows(f)]
    assert got == expected + expected                  # shuffle=False: file order, then row order


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "arrow"])
def test_file_source_shuffles_by_seed_and_resumes_exactly_at_random_points(tmp_path, fmt):
    glob = write(tmp_path, fmt)
    make = lambda: ol.FileSource("t", glob, columns=["id"], seed=3)   # noqa: E731
    full = [rec["id"] for _, (_, rec) in zip(range(3 * FILES * ROWS), make())]
    assert sorted(full[:FILES * ROWS]) == sorted(r["id"] for f in range(FILES) for r in _rows(f))
    assert full[:FILES * ROWS] != full[FILES * ROWS:2 * FILES * ROWS]   # a new order in the next epoch
    rng = random.Random(fmt)
    for k in [0, ROWS, FILES * ROWS - 1, FILES * ROWS] + rng.sample(range(1, 3 * FILES * ROWS), 5):
        a = make()
        for _ in zip(range(k), a):
            pass
        state = torch.load(_saved(a.state_dict()), weights_only=True)
        b = make()
        b.load_state_dict(state)
        assert [rec["id"] for _, (_, rec) in zip(range(3 * FILES * ROWS - k), b)] == full[k:], k


def _saved(state):
    import io
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_file_source_errors_name_the_file_and_say_what_to_do(tmp_path):
    glob = write(tmp_path / "j", "jsonl")
    bad = tmp_path / "j" / "part-1.jsonl"
    bad.write_text(bad.read_text().replace("}\n", "}\n{oops\n", 1))
    with pytest.raises(ol.ConfigError, match=r"source 't': .*part-1\.jsonl: not a readable JSON Lines file.*on_error='skip'"):
        ol.FileSource("t", glob)
    src = ol.FileSource("t", glob, on_error="skip", shuffle=False, epochs=1)
    assert [s["file"] for s in src.skipped] == [str(bad)]
    assert len([r for _, r in src]) == (FILES - 1) * ROWS            # the other files, every row
    with pytest.raises(ol.ConfigError, match=r"part-0\.jsonl has no column\(s\) \['body'\]; available columns: \['id', 'text'\]"):
        ol.FileSource("t", str(tmp_path / "j" / "part-0.jsonl"), columns=["body"])
    (tmp_path / "x.txt").write_text("hello\n")
    with pytest.raises(ol.ConfigError, match=r"x\.txt: cannot tell its format from its name; pass format="):
        ol.FileSource("t", str(tmp_path / "x.txt"))
    with pytest.raises(ol.ConfigError, match=r"source 't' has no rows .*point it at non-empty CSV files"):
        ol.FileSource("t", str(tmp_path / "x.txt"), format="csv")       # a header, no rows
    with pytest.raises(ol.ConfigError, match=r"format must be None"):
        ol.FileSource("t", glob, format="xml")


def test_an_empty_text_file_is_empty_not_unreadable(tmp_path):
    """An empty or blank JSON Lines/CSV file has no row, as an empty Parquet file: among others it adds
    nothing (not 'not readable', not 'has no column'); alone, the source has no rows and says which
    file it is. Journaled like any file: once it gets rows, the next opening reads them."""
    glob = write(tmp_path / "j", "jsonl")
    (tmp_path / "j" / "a-empty.jsonl").write_bytes(b"")
    (tmp_path / "j" / "b-blank.jsonl").write_text("\n\n")
    (tmp_path / "j" / "c-empty.jsonl.gz").write_bytes(gzip.compress(b""))
    (tmp_path / "j" / "d-empty.csv").write_bytes(b"")
    src = ol.FileSource("t", glob, columns=["text"], shuffle=False, epochs=1)
    assert src.skipped == [] and len(src.files) == FILES + 4
    assert [r["text"] for _, r in src] == [r["text"] for f in range(FILES) for r in _rows(f)]
    cache = str(tmp_path / "cache")
    lone = tmp_path / "lone.jsonl"
    lone.write_bytes(b"")
    for _ in range(2):                      # the second opening from the journal: the same error
        with pytest.raises(ol.ConfigError, match=r"'t' has no rows \(1 usable file\(s\): .*lone\.jsonl, 0 skipped"):
            ol.FileSource("t", str(lone), columns=["id"], metadata_cache=cache)
    lone.write_text(json.dumps({"id": 7}) + "\n")
    assert [r for _, r in ol.FileSource("t", str(lone), columns=["id"], epochs=1, metadata_cache=cache)] == [{"id": 7}]
    (tmp_path / "broken.arrow").write_bytes(b"")      # an Arrow IPC file always has a schema: 0 bytes is damage
    with pytest.raises(ol.ConfigError, match=r"broken\.arrow: not a readable Arrow IPC file"):
        ol.FileSource("t", str(tmp_path / "broken.arrow"))


def test_a_file_changed_after_opening_is_an_error_naming_it(tmp_path):
    glob = write(tmp_path, "jsonl")
    src = ol.FileSource("t", glob, shuffle=False)
    p = tmp_path / "part-0.jsonl"
    p.write_text(p.read_text() + json.dumps({"id": -1, "text": "new"}) + "\n")
    with pytest.raises(ol.SourceReadError, match=r"part-0\.jsonl.*18 rows now, 17 when the source was opened"):
        next(iter(src))


def test_transform_errors_name_file_and_row(tmp_path):
    glob = write(tmp_path, "csv")

    def fails_on_7(row):
        if row["id"] % 1000 == 7:
            raise ValueError("bad row")
        return row
    with pytest.raises(ol.SourceReadError, match=r"part-0\.csv row 7 .*ValueError: bad row"):
        list(ol.FileSource("t", glob, fails_on_7, shuffle=False, epochs=1))
    src = ol.FileSource("t", glob, fails_on_7, shuffle=False, epochs=1, on_error="skip")
    assert len(list(src)) == FILES * ROWS - FILES and len(src.skipped) == FILES


# -- NodeSource ----------------------------------------------------------------------------------

class Counter(BaseNode):
    """A user's own stateful node: 0, 1, 2, ... up to ``n`` (its state: the next value)."""

    def __init__(self, n=50):
        super().__init__()
        self.n = n

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.i = 0 if initial_state is None else initial_state["i"]

    def next(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return {"value": self.i - 1, "square": (self.i - 1) ** 2}

    def get_state(self):
        return {"i": self.i}


def counter():
    return Counter(50)


def wrapped_range():
    return IterableWrapper(range(100, 160))


@pytest.mark.parametrize("factory", [counter, wrapped_range])
def test_node_source_resumes_from_the_nodes_own_state(factory):
    full = [rec for _, rec in ol.NodeSource("n", factory)]
    assert len(full) in (50, 60)
    for k in [0, 1, 17, len(full) - 1, len(full)]:
        a = ol.NodeSource("n", factory)
        head = [rec for _, (_, rec) in zip(range(k), a)]
        b = ol.NodeSource("n", factory)
        b.load_state_dict(torch.load(_saved(a.state_dict()), weights_only=True))
        assert head + [rec for _, rec in b] == full, k


def test_node_source_needs_a_factory_for_rpc_and_names_bad_nodes():
    with pytest.raises(ol.ConfigError, match=r"NodeSource needs a factory.*NodeSource\('n', make_node\)"):
        SourceSpec.from_source(ol.NodeSource("n", Counter(5)))
    spec = SourceSpec.from_source(ol.NodeSource("n", counter))
    rebuilt = spec.build()
    assert isinstance(rebuilt, ol.NodeSource) and [r["value"] for _, r in rebuilt][:3] == [0, 1, 2]
    with pytest.raises(ol.ConfigError, match=r"returned a list, not a torchdata.nodes.BaseNode"):
        ol.NodeSource("n", lambda: [1, 2])
    with pytest.raises(ol.ConfigError, match=r"a source must be a Source"):
        SourceSpec.from_source(object())


def test_node_source_transform_errors_and_endless_skips():
    def odd_only(x):
        if x["value"] % 2 == 0:
            raise ValueError("even")
        return x
    with pytest.raises(ol.SourceReadError, match=r"source 'n': transform failed on item 0: ValueError: even"):
        list(ol.NodeSource("n", counter, odd_only))
    got = [r["value"] for _, r in ol.NodeSource("n", counter, odd_only, on_error="skip")]
    assert got == list(range(1, 50, 2))
    loader = SourceLoader(ol.NodeSource("n", counter, lambda x: 1 / 0, on_error="skip", max_skips_in_a_row=20), 4)
    with pytest.raises(ol.SourceReadError, match=r"20 items in a row were skipped"):
        loader.fill()
    loader.close()


def test_source_loader_over_a_node_source_takes_out_of_order_and_resumes():
    def make():
        return SourceLoader(ol.NodeSource("n", counter, lambda x: {"input_ids": torch.arange(1 + x["value"] % 7)}), 6)
    a = make()
    taken = []
    for _ in range(5):
        meta = a.metadata()
        i = int(meta.index[int(meta.tokens.argmax())])
        taken.append(i)
        a.take([i])
    state = a.get_state()
    b = make()
    b.reset(state)
    assert b.metadata().index.tolist() == a.metadata().index.tolist()
    assert not set(taken) & set(b.metadata().index.tolist())
    a.close(), b.close()


# -- both runtimes ---------------------------------------------------------------------------------

_RPC_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
import torchdata_overlord as ol
from test_sources import both_runtimes_sources, both_runtimes_strategy
out = {{}}
for runtime in ("local", "rpc"):
    with ol.OverlordLoader(both_runtimes_sources({root!r}), both_runtimes_strategy, ol.ClientPlaceTree(dp=2),
                           rank=None, global_batch=8, seq_len=None, runtime=runtime) as loader:
        out[runtime] = [x for _, x in zip(range(6), loader)]
        state = loader.state_dict()
        out[runtime] += [x for _, x in zip(range(3), loader)]
    with ol.OverlordLoader(both_runtimes_sources({root!r}), both_runtimes_strategy, ol.ClientPlaceTree(dp=2),
                           rank=None, global_batch=8, seq_len=None, runtime=runtime) as loader:
        loader.load_state_dict(state)
        out[runtime + "-tail"] = [x for _, x in zip(range(3), loader)]
torch.save(out, {out!r})
"""


def tokens_of(row):
    """JSONL rows and node items as samples with token ids (module level: rpc workers unpickle it)."""
    text = row["text"] if "text" in row else " " * (1 + row["value"] % 9)
    return {"input_ids": torch.tensor([ord(c) % 97 for c in text[:64]], dtype=torch.int64)}


def both_runtimes_sources(root):
    return [ol.FileSource("jsonl", str(Path(root) / "*.jsonl"), tokens_of, seed=1),
            ol.NodeSource("node", counter, tokens_of)]


def both_runtimes_strategy(g):
    return g.mix({"jsonl": 0.5, "node": 0.5}).distribute("DP").cost(ol.token_count).balance("greedy").plan()


@pytest.mark.slow
def test_file_and_node_sources_stream_the_same_in_both_runtimes(tmp_path):
    write(tmp_path / "data", "jsonl")
    out = tmp_path / "out.pt"
    script = _RPC_SCRIPT.format(tests=str(ROOT / "tests"), root=str(tmp_path / "data"), out=str(out))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=False)
    assert len(got["local"]) == 9
    assert_identical(got["rpc"], got["local"])
    assert_identical(got["local-tail"], got["local"][6:])             # resumed at step 6, in each runtime
    assert_identical(got["rpc-tail"], got["local"][6:])


# -- a read error while refilling ------------------------------------------------------------------

class BreaksAt(Counter):
    """A node whose reads fail at item ``at`` (a disk gone mid-run): items before it are good."""

    def __init__(self, at):
        super().__init__(n=10 * at)
        self.at = at

    def next(self):
        if self.i == self.at:
            raise OSError(f"disk gone at item {self.i}")
        return super().next()


def breaks_at_10():
    return BreaksAt(10)


def single_source_strategy(g):
    return g.mix({"n": 1.0}).distribute("DP").cost(ol.token_count).balance("greedy").plan()


_REFILL_SCRIPT = """
import sys, json
sys.path.insert(0, {tests!r})
import torchdata_overlord as ol
from test_sources import breaks_at_10, single_source_strategy, tokens_of
out = {{}}
for runtime in ("local", "rpc"):
    got = []
    with ol.OverlordLoader([ol.NodeSource("n", breaks_at_10, tokens_of)], single_source_strategy, ol.ClientPlaceTree(dp=1),
                           rank=0, global_batch=4, seq_len=None, runtime=runtime, prefetch=1) as loader:
        try:
            for item in loader:
                got.append(sorted(k for mb in item["microbatches"] for k in mb["sample_keys"]))
        except ol.OverlordError as e:
            out[runtime] = {{"steps": got, "error": f"{{type(e).__name__}}: {{e}}"}}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_read_error_while_refilling_fails_the_next_step_not_the_one_delivered(tmp_path):
    """A loader refills its buffer as it delivers a step (for the next step's plan): a read that fails
    then is the next step's error, raised once, naming the source and item; every sample read before
    it is delivered, in both runtimes."""
    script = _REFILL_SCRIPT.format(tests=str(ROOT / "tests"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for runtime in ("local", "rpc"):
        got = out[runtime]
        # items 0..9 are good: two full steps of 4 (buffer = global batch), then the refill reaching
        # item 10 fails, so step 2 fails (its buffer would need items 8..11)
        assert [len(s) for s in got["steps"]] == [4, 4], got
        assert sorted(k for s in got["steps"] for k in s) == sorted(f"n:{i}" for i in range(8))
        assert "SourceReadError" in got["error"] and "item 10" in got["error"] and "disk gone" in got["error"], got


def test_record_bytes_counts_tensor_storage_strings_and_eight_per_other_leaf():
    """What a loader reports as bytes sent: tensors by their bytes, strings and bytes by length, 8 per other
    leaf, summed through dicts, lists and tuples."""
    from torchdata_overlord.roles.source_loader import record_bytes

    ids = torch.arange(37, dtype=torch.int64)                 # 296 bytes
    px = torch.zeros(3, 5, 7, dtype=torch.uint8)              # 105 bytes
    text = {"input_ids": ids, "tokens": 37, "truncated": False, "weight": 0.5}
    assert record_bytes(text) == 296 + 3 * 8
    image = {**text, "pixels": px, "grid": (2, 3), "image_patches": [6], "caption": "a cat", "raw": b"\x00" * 9,
             "extra": {"mask": torch.ones(4, dtype=torch.bool), "none": None}}
    assert record_bytes(image) == 296 + 3 * 8 + 105 + 2 * 8 + 8 + 5 + 9 + 4 + 8
    assert record_bytes([text, (ids, "ab")]) == record_bytes(text) + 296 + 2
    assert record_bytes(ids) == 296 and record_bytes(7) == 8 and record_bytes("abc") == 3

"""The Source protocol and its implementations beyond Parquet: FileSource (JSON Lines, CSV, Arrow IPC,
gzip) and NodeSource (any stateful torchdata node). Real files written by pyarrow and gzip in a temp dir."""

from __future__ import annotations

import csv
import gzip
import io
import json
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.ipc as paipc
import pyarrow.parquet as pq
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
    if fmt == "csv":                                   # a CSV cell is the text in the file
        expected = [{k: str(v) for k, v in r.items()} for r in expected]
    assert got == expected + expected                  # shuffle=False: file order, then row order


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_source_over_a_directory_reads_its_text_files(tmp_path, fmt):
    """A directory given to FileSource reads its JSON Lines / CSV / Arrow IPC files (each maybe .gz), as a
    glob of them would, not only ``*.parquet``; a Parquet file beside them is left out."""
    write(tmp_path / "d", fmt)
    pq.write_table(pa.table({"id": [1]}), tmp_path / "d" / "other.parquet")
    got = [rec for _, rec in ol.FileSource("t", str(tmp_path / "d"), shuffle=False, epochs=1)]
    assert got == [rec for _, rec in ol.FileSource("t", str(tmp_path / "d" / "part-*"), shuffle=False, epochs=1)]
    assert len(got) == FILES * ROWS


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "arrow"])
def test_file_source_shuffles_by_seed_and_resumes_exactly_at_random_points(tmp_path, fmt):
    glob = write(tmp_path, fmt)
    make = lambda: ol.FileSource("t", glob, columns=["id"], seed=3)   # noqa: E731
    full = [int(rec["id"]) for _, (_, rec) in zip(range(3 * FILES * ROWS), make())]   # CSV: the text
    assert sorted(full[:FILES * ROWS]) == sorted(r["id"] for f in range(FILES) for r in _rows(f))
    assert full[:FILES * ROWS] != full[FILES * ROWS:2 * FILES * ROWS]   # a new order in the next epoch
    rng = random.Random(fmt)
    for k in [0, ROWS, FILES * ROWS - 1, FILES * ROWS] + rng.sample(range(1, 3 * FILES * ROWS), 5):
        _, b = _resumed(make, k)
        assert [int(rec["id"]) for _, (_, rec) in zip(range(3 * FILES * ROWS - k), b)] == full[k:], k


@pytest.mark.parametrize("fmt", ["jsonl.gz", "csv"])
def test_file_source_resumes_over_its_files_copied_under_another_root(tmp_path, fmt):
    """A FileSource's state refers to its files as a ParquetSource's does: the same files (relative path,
    size, rows) under another root continue the stream exactly; a changed one is refused, naming it."""
    import shutil

    glob = write(tmp_path / "data", fmt)
    a = ol.FileSource("t", glob, seed=5)
    for _ in zip(range(ROWS + 4), a):
        pass
    state = torch.load(_saved(a.state_dict()), weights_only=True)
    shutil.copytree(tmp_path / "data", tmp_path / "mnt" / "copy")
    b = ol.FileSource("t", str(tmp_path / "mnt" / "copy" / "*"), seed=5)
    b.load_state_dict(state)
    assert [rec for _, (_, rec) in zip(range(3 * FILES * ROWS), b)] == \
        [rec for _, (_, rec) in zip(range(3 * FILES * ROWS), a)]
    name = f"part-1.{fmt}"
    text = (tmp_path / "data" / name).read_bytes()
    doubled = text + text if fmt == "csv" else gzip.compress(gzip.decompress(text) * 2)    # CSV: the header too
    (tmp_path / "mnt" / "copy" / name).write_bytes(doubled)
    with pytest.raises(ol.ConfigError, match=rf"file list differs.*state has \[{name!r}, \d+, {ROWS}\], now "
                                             rf"\[{name!r}, \d+, {2 * ROWS + (fmt == 'csv')}\]"):
        ol.FileSource("t", str(tmp_path / "mnt" / "copy" / "*"), seed=5).load_state_dict(state)


def _resumed(make, k: int):
    """``(a, b)``: a source ``make()`` gives after reading ``k`` records, and a fresh one loaded with its state
    (saved by torch.save, read back with weights_only=True)."""
    a = make()
    for _ in zip(range(k), a):
        pass
    b = make()
    b.load_state_dict(torch.load(_saved(a.state_dict()), weights_only=True))
    return a, b


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
        if int(row["id"]) % 1000 == 7:                  # a CSV cell: the text in the file
            raise ValueError("bad row")
        return row
    with pytest.raises(ol.SourceReadError, match=r"part-0\.csv row 7 .*ValueError: bad row"):
        list(ol.FileSource("t", glob, fails_on_7, shuffle=False, epochs=1))
    src = ol.FileSource("t", glob, fails_on_7, shuffle=False, epochs=1, on_error="skip")
    assert len(list(src)) == FILES * ROWS - FILES and len(src.skipped) == FILES


# -- CSV cells as text ---------------------------------------------------------------------------

# columns pyarrow.csv's inference would retype or null: leading zeros and exponents (a float column),
# booleans and null markers (a bool column), and text
CODES = ["00123", "1e3", "007", "-0", "3.10", "NaN"]
FLAGS = ["true", "NA", "null", "", "FALSE", "N/A"]
TEXTS = ["00123", "1e3", "true", "NA", "null", "", "2024-01-02", " 42 ", "0x1F", "1,5", 'say "hi"', "#N/A"]


def _csv_rows(f: int, n: int = ROWS) -> list[dict]:
    """Rows whose cells are all strings as the CSV file holds them (``id`` keeps its leading zeros)."""
    return [{"id": f"{f:02d}{r:04d}", "code": CODES[(f + r) % len(CODES)],
             "text": TEXTS[(3 * r + f) % len(TEXTS)] + " " + str(r)[:1] * (r % 2), "flag": FLAGS[r % len(FLAGS)]}
            for r in range(n)]


def write_csv(tmp: Path, gz: bool = False, files: int = FILES, quote_all: bool = False) -> str:
    """CSV files written by Python's csv module (not pyarrow: no schema behind them); returns the glob."""
    tmp.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=["id", "code", "text", "flag"],
                           quoting=csv.QUOTE_ALL if quote_all else csv.QUOTE_MINIMAL, lineterminator="\n")
        w.writeheader()
        w.writerows(_csv_rows(f))
        data = buf.getvalue().encode()
        (tmp / f"part-{f}.csv{'.gz' if gz else ''}").write_bytes(gzip.compress(data) if gz else data)
    return str(tmp / "*")


@pytest.mark.parametrize("gz", [False, True], ids=["csv", "csv.gz"])
@pytest.mark.parametrize("quote_all", [False, True], ids=["minimal-quotes", "all-quoted"])
def test_csv_cells_arrive_as_the_exact_text_in_the_file(tmp_path, gz, quote_all):
    src = ol.FileSource("t", write_csv(tmp_path, gz, quote_all=quote_all), shuffle=False, epochs=1)
    got = [rec for _, rec in src]
    expected = [r for f in range(FILES) for r in _csv_rows(f)]
    assert got == expected
    assert all(type(v) is str for rec in got for v in rec.values())          # no float, bool or None
    assert [rec["code"] for rec in got[:6]] == ["00123", "1e3", "007", "-0", "3.10", "NaN"]
    assert [rec["flag"] for rec in got[:6]] == ["true", "NA", "null", "", "FALSE", "N/A"]
    assert got[0]["id"] == "000000"


@pytest.mark.parametrize("gz", [False, True], ids=["csv", "csv.gz"])
def test_csv_the_reported_file_reads_as_written_and_infer_is_the_old_reading(tmp_path, gz):
    data = "code,text\n00123,NA\n00042,null\n007,\n1e3,true\n".encode()
    (tmp_path / f"x.csv{'.gz' if gz else ''}").write_bytes(gzip.compress(data) if gz else data)
    glob = str(tmp_path / "x.csv*")
    assert [rec for _, rec in ol.FileSource("t", glob, shuffle=False, epochs=1)] == [
        {"code": "00123", "text": "NA"}, {"code": "00042", "text": "null"}, {"code": "007", "text": ""},
        {"code": "1e3", "text": "true"}]
    assert [rec for _, rec in ol.FileSource("t", glob, shuffle=False, epochs=1, csv_convert_options="infer")] == [
        {"code": 123.0, "text": None}, {"code": 42.0, "text": None}, {"code": 7.0, "text": None},
        {"code": 1000.0, "text": True}]


def test_csv_rows_reach_tokenize_without_being_skipped(tmp_path):
    """The user's report: "NA"/"null"/"" texts were None, so Tokenize failed and on_error='skip' dropped them."""
    def to_text(row):
        if not isinstance(row["text"], str) or not isinstance(row["code"], str):
            raise TypeError(f"must be a string, got {row['text']!r}, {row['code']!r}")
        return {"input_ids": torch.tensor([ord(c) for c in row["code"] + row["text"]], dtype=torch.int64)}
    src = ol.FileSource("t", write_csv(tmp_path), to_text, shuffle=False, epochs=1, on_error="skip")
    assert len(list(src)) == FILES * ROWS and src.skipped == []


@pytest.mark.parametrize("gz", [False, True], ids=["csv", "csv.gz"])
def test_csv_resumes_exactly_mid_file_and_rebuilds_from_spec_args(tmp_path, gz):
    glob = write_csv(tmp_path, gz)
    make = lambda **kw: ol.FileSource("t", glob, seed=5, **kw)   # noqa: E731
    n = 2 * FILES * ROWS
    full = [rec for _, (_, rec) in zip(range(n), make())]
    assert sorted(full[:FILES * ROWS], key=lambda r: r["id"]) == [r for f in range(FILES) for r in _csv_rows(f)]
    for k in [5, ROWS + 3, FILES * ROWS + ROWS // 2]:                  # mid-file, in both epochs
        a, b = _resumed(make, k)
        assert [rec for _, (_, rec) in zip(range(n - k), b)] == full[k:], k
        rebuilt = pickle.loads(pickle.dumps(SourceSpec.from_source(a))).build()      # the rpc runtime's way
        assert rebuilt.csv_convert_options is None
        assert [rec for _, (_, rec) in zip(range(n - k), rebuilt)] == full[k:], k
        # row counts and positions are those of pyarrow's inference: its states resume here too
        c = make(csv_convert_options="infer")
        for _ in zip(range(k), c):
            pass
        assert c.state_dict() == a.state_dict() and c.num_rows == a.num_rows
        d = make()
        d.load_state_dict(c.state_dict())
        assert [rec for _, (_, rec) in zip(range(n - k), d)] == full[k:], k


def test_csv_as_text_without_default_column_type(tmp_path, monkeypatch):
    """pyarrow < 26 has no ConvertOptions(default_column_type=): every header name is typed a string."""
    from torchdata_overlord.sources import files
    glob = write_csv(tmp_path, gz=True)
    expected = [rec for _, rec in ol.FileSource("t", glob, shuffle=False, epochs=1, metadata_cache=False)]
    monkeypatch.setattr(files, "_DEFAULT_COLUMN_TYPE", False)
    src = ol.FileSource("t", glob, shuffle=False, epochs=1, metadata_cache=False)
    assert [rec for _, rec in src] == expected == [r for f in range(FILES) for r in _csv_rows(f)]


def test_csv_convert_options_opt_into_pyarrow_conversion(tmp_path):
    glob = write_csv(tmp_path)
    first = lambda src: next(iter(src))[1]                  # noqa: E731
    inferred = first(ol.FileSource("t", glob, shuffle=False, csv_convert_options="infer"))
    assert inferred == {"id": 0, "code": 123.0, "text": "00123 ", "flag": True}
    opts = pacsv.ConvertOptions(column_types={"id": pa.int64()}, null_values=["NA", "null", ""],
                                strings_can_be_null=True)
    src = ol.FileSource("t", glob, shuffle=False, csv_convert_options=opts)
    rows = [rec for _, (_, rec) in zip(range(6), src)]
    assert [r["id"] for r in rows] == list(range(6)) and rows[0]["code"] == 123.0     # the rest inferred
    assert [r["flag"] for r in rows] == ["true", None, None, None, "FALSE", "N/A"]   # null where asked
    assert isinstance(src.spec_args()[2]["csv_convert_options"], dict)     # a ConvertOptions does not pickle
    rebuilt = pickle.loads(pickle.dumps(SourceSpec.from_source(src))).build()      # at row 6, as src
    ref = [rec for _, (_, rec) in zip(range(6 + ROWS),
                                      ol.FileSource("t", glob, shuffle=False, csv_convert_options=opts))]
    assert [repr(rec) for _, (_, rec) in zip(range(ROWS), rebuilt)] == [repr(rec) for rec in ref[6:]]   # nan
    as_dict = first(ol.FileSource("t", glob, shuffle=False, csv_convert_options={"column_types": {"id": pa.int64()}}))
    assert as_dict["id"] == 0 and as_dict["code"] == 123.0
    with pytest.raises(ol.ConfigError, match=r"source 't': csv_convert_options must be None .*'infer'.*got 'strings'"):
        ol.FileSource("t", glob, csv_convert_options="strings")
    with pytest.raises(ol.ConfigError, match=r"csv_convert_options is not valid pyarrow.csv.ConvertOptions "
                                             r"\(TypeError: .*bogus"):
        ol.FileSource("t", glob, csv_convert_options={"bogus": 1})
    with pytest.raises(ol.ConfigError, match=r"csv_convert_options is for CSV files; this source reads format='json'"):
        ol.FileSource("t", glob, format="json", csv_convert_options="infer")
    with pytest.raises(ol.ConfigError, match=r"part-0\.csv: not a readable CSV file .*ArrowInvalid"):
        ol.FileSource("t", glob, csv_convert_options={"column_types": {"code": pa.int64()}})


def test_json_lines_keep_their_types_beside_csv_as_text(tmp_path):
    rows = [{"code": "00123", "n": 5, "x": None, "b": True, "f": 1e3},
            {"code": "NA", "n": 6, "x": 1.5, "b": False, "f": 2.0}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "b.csv").write_text("code,n\n00123,5\n")
    src = ol.FileSource("t", [str(tmp_path / "a.jsonl"), str(tmp_path / "b.csv")], shuffle=False, epochs=1)
    assert [rec for _, rec in src] == rows + [{"code": "00123", "n": "5"}]


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

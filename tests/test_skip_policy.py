"""``on_error="skip"`` end to end: skipped rows are refilled, nothing good is lost, the log is a summary.

Real Parquet files whose rows carry their global id (``gid``) and a text that is null on the rows
meant to be bad; a real sentencepiece model trained here; ``Tokenize`` fails on a null text, as it
would on a user's data. Expected keys come from the files' ``gid`` column, never from the code
under test.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchdata_overlord as ol
from torchdata_overlord import testing
from torchdata_overlord.roles.source_loader import SourceLoader
from torchdata_overlord.sources import ParquetSource, SourceReadError
from torchdata_overlord.sources.skip_log import SkipLog
from torchdata_overlord.transforms import Tokenize

TEXTS = testing.make_text_corpus(300, seed=3, max_words=12)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    return testing.train_sentencepiece(TEXTS, tmp_path_factory.mktemp("spm") / "tok", vocab_size=200)


def write_texts(path, gids, bad=(), row_group_size=4, field="text"):
    """A Parquet file of rows ``gid`` and ``field`` (null where ``gid`` is in ``bad``)."""
    gids = list(gids)
    text = [None if g in bad else TEXTS[g % len(TEXTS)] for g in gids]
    pq.write_table(pa.table({"gid": pa.array(gids, pa.int64()), field: pa.array(text, pa.string())}), path,
                   row_group_size=row_group_size)
    return str(path)


def skip_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]


# ---- item 8: a skipped row is replaced, a step is short only when a source is exhausted ---------

def one_source_strategy(g):
    return g.mix({"web": 1.0}).distribute("DP").cost(ol.token_count).balance("greedy", microbatches=2).plan()


def test_skipped_rows_are_refilled_so_a_source_can_make_up_a_whole_step(spm_model, tmp_path):
    """One source makes up every step of 16 with the default buffer (16): a null text every 7 rows
    used to leave the buffer at 15 and fail step 0 with BufferShortageError."""
    n, batch = 100, 16
    bad = set(range(3, n, 7))
    write_texts(tmp_path / "web.parquet", range(n), bad)
    src = ParquetSource("web", str(tmp_path / "web.parquet"), Tokenize(spm_model), on_error="skip", epochs=1)
    delivered = []
    with ol.OverlordLoader([src], one_source_strategy, ol.ClientPlaceTree(dp=2), rank=None, global_batch=batch,
                           seq_len=None, prefetch=0) as loader:
        for item in loader:
            keys = loader.last_plan.sampled_keys()
            assert len(keys) == batch and all(k.source == "web" for k in keys)
            assert all(it["delivery"] == "data" for it in item.values())
            delivered += [k.index for k in keys]
        stats = loader.stats()["sources"]["web"]
    good = sorted(set(range(n)) - bad)
    # every full step was delivered; only the last, short one (the source ran out) is missing
    assert len(delivered) == len(set(delivered)) == batch * (len(good) // batch)
    assert set(delivered) <= set(good)
    assert "finished their configured epochs" in loader.exhausted_reason
    # what was left, not a shortage's advice (enlarging a buffer does not bring an ended source back)
    assert "samples left, the step needs" in loader.exhausted_reason and "enlarge" not in loader.exhausted_reason
    assert stats["skipped"] == len(bad) and stats["skipped_distinct"] == len(bad)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(3, 40), bad_frac=st.floats(0, 0.9), rg=st.integers(1, 9), buffer_size=st.integers(1, 12),
       workers=st.sampled_from([0, 2]), seed=st.integers(0, 2**16), cut=st.floats(0, 1))
def test_buffer_is_full_unless_exhausted_and_every_good_row_comes_once_per_epoch(
        spm_model, tmp_path_factory, n, bad_frac, rg, buffer_size, workers, seed, cut):
    rng = np.random.default_rng(seed)
    bad = set(rng.choice(n, int(bad_frac * n), replace=False).tolist())     # at most 90%: some row is good
    path = write_texts(tmp_path_factory.mktemp("prop") / "s.parquet", range(n), bad, row_group_size=rg)
    epochs = 2

    def make():
        src = ParquetSource("s", path, Tokenize(spm_model), on_error="skip", epochs=epochs, seed=seed % 7)
        return SourceLoader(src, buffer_size=buffer_size, workers=workers)

    def run(loader, start, stop=None):
        """Take a random part of the buffer each step (as plans do); the indices taken, per step."""
        out = []
        for step in range(start, stop if stop is not None else 10**6):
            meta = loader.metadata()
            assert len(meta) == buffer_size or loader.exhausted
            if not len(meta):
                break
            chosen = np.random.default_rng([seed, step]).random(len(meta)) < 0.6
            chosen[0] = True                                     # the oldest is never starved forever
            out.append(loader.take(meta.index[chosen].tolist()))
        return [sorted(x) for x in out]

    loader = make()
    try:
        steps = run(loader, 0)
    finally:
        loader.close()
    taken = sorted(i for s in steps for i in s)
    good = [g for g in range(n) if g not in bad]
    assert taken == sorted(e * n + g for e in range(epochs) for g in good)     # none lost, none twice
    assert loader.stats()["skipped"] == len(bad) * epochs

    # resume from a midpoint continues with exactly the same takes
    k = int(cut * len(steps))
    first = make()
    try:
        run(first, 0, k)
        state = first.get_state()
    finally:
        first.close()
    again = make()
    try:
        again.reset(state)
        assert run(again, k) == steps[k:]
    finally:
        again.close()


def test_a_source_whose_every_row_is_skipped_raises_instead_of_cycling(spm_model, tmp_path):
    path = write_texts(tmp_path / "nulls.parquet", range(9), bad=set(range(9)), row_group_size=2)
    loader = SourceLoader(ParquetSource("nulls", path, Tokenize(spm_model), on_error="skip"), buffer_size=4)
    with pytest.raises(SourceReadError, match=r"source 'nulls': .*no row of this source is usable") as err:
        loader.metadata()
    assert "nulls.parquet" in str(err.value) and "null" in str(err.value)
    src = ParquetSource("nulls", path, Tokenize(spm_model), on_error="skip")
    with pytest.raises(SourceReadError, match="no row of this source is usable"):
        next(src)
    # one usable row is enough to go on forever
    path = write_texts(tmp_path / "one.parquet", range(9), bad=set(range(9)) - {5}, row_group_size=2)
    src = ParquetSource("one", path, Tokenize(spm_model), on_error="skip", seed=1)
    assert [k for k, _ in (next(src) for _ in range(20))] == [5] * 20


# ---- item 8: a file without the transform's column ---------------------------------------------------------

def test_file_without_the_transforms_column_says_to_fix_the_transforms_field(spm_model, tmp_path):
    path = write_texts(tmp_path / "code.parquet", range(5), field="content")
    with pytest.raises(ol.ConfigError) as err:
        ParquetSource("code", path, Tokenize(spm_model, field="text"))
    msg = str(err.value)
    assert "code.parquet" in msg and "'text'" in msg and "'content'" in msg
    assert "Tokenize(field=" in msg and "columns=" not in msg


def test_file_without_the_transforms_column_is_skipped_under_on_error_skip(spm_model, tmp_path, caplog):
    d = tmp_path / "data"
    d.mkdir()
    write_texts(d / "a.parquet", range(0, 6))
    write_texts(d / "b.parquet", range(6, 10), field="content")        # the odd file out
    write_texts(d / "c.parquet", range(10, 15))
    with caplog.at_level(logging.WARNING, logger="torchdata_overlord"):
        src = ParquetSource("web", str(d / "*.parquet"), Tokenize(spm_model), on_error="skip", epochs=1,
                            shuffle=False)
    assert [s["file"].rsplit("/", 1)[1] for s in src.skipped] == ["b.parquet"]
    assert "has no column(s) ['text']" in src.skipped[0]["error"] and src.skipped[0]["row"] is None
    assert any("b.parquet" in line for line in skip_lines(caplog))
    gids = pq.read_table(d / "a.parquet")["gid"].to_pylist() + pq.read_table(d / "c.parquet")["gid"].to_pylist()
    assert [k for k, _ in src] == list(range(len(gids)))            # the two files' rows, keys dense
    # every file without it: the error says why there is nothing to read
    with pytest.raises(ol.ConfigError, match=r"has no rows: all its 2 file\(s\) were skipped \(on_error='skip'\): "
                                             r".*a\.parquet: .*has no column.*c\.parquet: .*has no column"):
        ParquetSource("code", str(d / "[ac].parquet"), Tokenize(spm_model, field="content"), on_error="skip")


# ---- item 9: a summary per source at most every N seconds, exact counts in stats() -------------------------

def test_a_bad_row_is_logged_once_then_summed_up_not_again_every_epoch(spm_model, tmp_path, caplog):
    epochs, bad = 30, {2, 7}
    path = write_texts(tmp_path / "web.parquet", range(10), bad)
    src = ParquetSource("web", path, Tokenize(spm_model), on_error="skip", epochs=epochs)   # 60 s between lines
    loader = SourceLoader(src, buffer_size=4)
    with caplog.at_level(logging.WARNING, logger="torchdata_overlord"):
        served = 0
        while len(loader.metadata()):
            served += len(loader.take(loader.metadata().index.tolist()))
        assert len(skip_lines(caplog)) == 1                # not 60: the first skip, in full
        assert loader.stats()["skipped"] == len(bad) * epochs and loader.stats()["skipped_distinct"] == 2
        loader.close()
    lines = skip_lines(caplog)
    assert len(lines) == 2 and "59 more" in lines[1] and "60 in all" in lines[1] and "2 distinct" in lines[1]
    assert served == (10 - len(bad)) * epochs
    assert sorted(s["count"] for s in src.skipped) == [epochs, epochs]


def test_a_restore_does_not_count_a_skip_again(spm_model, tmp_path):
    path = write_texts(tmp_path / "web.parquet", range(12), {1, 9})
    src = ParquetSource("web", path, Tokenize(spm_model), on_error="skip", shuffle=False)
    loader = SourceLoader(src, buffer_size=5)
    state = loader.get_state()
    loader.take(loader.metadata().index[:2].tolist())
    assert loader.stats()["skipped"] == 1
    loader.reset(state)                                    # re-reads row 1 of the same epoch
    loader.metadata()
    assert loader.stats()["skipped"] == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(interval=st.sampled_from([0.0, 1.0, 5.0, 30.0]),
       events=st.lists(st.tuples(st.floats(0, 8), st.integers(0, 5), st.integers(0, 1)), min_size=1, max_size=60))
def test_skip_log_writes_at_most_a_line_per_interval_and_loses_no_count(caplog, interval, events):
    now = [0.0]
    log = SkipLog("s", interval, clock=lambda: now[0])
    epoch, counted, times = 0, set(), []
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchdata_overlord"):
        for dt, row, next_epoch in events:
            now[0] += dt
            epoch += next_epoch
            before = len(caplog.records)
            log.add("f.parquet", row, "TypeError: null", epoch)
            counted.add((row, epoch))
            times += [now[0]] * (len(caplog.records) - before)
        assert log.total == len(counted) and log.stats()["skipped_distinct"] == len({r for r, _ in counted})
        assert all(b - a >= interval for a, b in zip(times, times[1:]))      # at most one line per interval
        log.flush()
    lines = [r.getMessage() for r in caplog.records]
    # every skip is in exactly one line: the first by itself, the others in the summaries' "N more"
    assert 1 + sum(int(m) for line in lines for m in re.findall(r"skipped (\d+) more", line)) == log.total
    log.flush()
    assert len(caplog.records) == len(lines)               # nothing left to say


# ---- a text holding the image placeholder literally: a bad row like any other under on_error="skip" ---------

@pytest.fixture(scope="module")
def spm_image(tmp_path_factory):
    """A sentencepiece model with ``<image>`` as a piece of its own (as a VLM's tokenizer has it)."""
    import sentencepiece as spm

    prefix = str(tmp_path_factory.mktemp("spm_image") / "tok")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS), model_prefix=prefix, vocab_size=200,
                                   model_type="bpe", pad_id=0, bos_id=1, eos_id=2, unk_id=3, character_coverage=1.0,
                                   hard_vocab_limit=False, num_threads=1, minloglevel=2,
                                   user_defined_symbols=["<image>"])
    model = prefix + ".model"
    return model, spm.SentencePieceProcessor(model_file=model).piece_to_id("<image>")


def test_a_text_holding_the_image_placeholder_is_skipped_and_counted_as_a_failing_row(spm_image, tmp_path, caplog):
    """Rows 3 and 8 say '<image>' in their text, row 5 is null (the transform fails on it). With image_token_id
    set, the placeholder rows used to raise under on_error='skip' too (the whole stream failed); now they are
    skipped like row 5: the same counters, the same log, every other row delivered once."""
    model, img = spm_image
    n, stray, null = 12, {3, 8}, {5}
    gids = list(range(n))
    text = [None if g in null else (f"look <image> here {g}" if g in stray else TEXTS[g]) for g in gids]
    path = tmp_path / "web.parquet"
    pq.write_table(pa.table({"gid": pa.array(gids, pa.int64()), "text": pa.array(text, pa.string())}), path,
                   row_group_size=4)
    assert img in Tokenize(model)({"text": text[3]})["input_ids"].tolist()    # the row really holds the id

    def drain(on_error, buffer_size=4):
        src = ParquetSource("web", str(path), Tokenize(model), on_error=on_error, epochs=1, shuffle=False)
        loader = SourceLoader(src, buffer_size=buffer_size, image_token_id=img)
        got = []
        try:
            while len(meta := loader.metadata()):
                got += loader.take(meta.index.tolist())
        finally:
            loader.close()
        return got, loader.stats(), src

    with caplog.at_level(logging.WARNING, logger="torchdata_overlord"):
        got, stats, src = drain("skip")
    assert sorted(got) == [g for g in gids if g not in stray | null]
    assert stats["skipped"] == 3 and stats["skipped_distinct"] == 3 and stats["skipped_files"] == {}
    assert sorted(s["row"] for s in src.skipped) == [3, 5, 8]
    assert all(s["file"] == str(path) and s["count"] == 1 for s in src.skipped)
    by_row = {s["row"]: s["error"] for s in src.skipped}
    assert f"image placeholder id {img}" in by_row[3] and "'<image>'" in by_row[3] and "null" in by_row[5]
    # the log: the first skip (row 3) in full, as a failing row's is; the rest summed up at close
    lines = skip_lines(caplog)
    assert lines[0].startswith(f"source 'web': skipped {path} row 3: ValueError: ") and "placeholder" in lines[0]
    assert "(on_error='skip'" in lines[0]
    assert len(lines) == 2 and "2 more" in lines[1] and "3 in all" in lines[1] and "row 8" in lines[1]

    # through the loader (the user's report): no error, the rows skipped and counted in stats()
    src = ParquetSource("web", str(path), Tokenize(model), on_error="skip", epochs=1, shuffle=False)
    with ol.OverlordLoader([src], one_source_strategy, ol.ClientPlaceTree(dp=1), rank=0, global_batch=3,
                           seq_len=None, prefetch=0, image_token_id=img) as loader:
        keys = [k for b in loader for mb in b["microbatches"] for k in mb["sample_keys"]]
        web = loader.stats()["sources"]["web"]
    assert sorted(int(k.split(":")[1]) for k in keys) == [g for g in gids if g not in stray | null]
    assert web["skipped"] == 3 and web["skipped_distinct"] == 3

    # under "raise" it raises naming the row, and says what skips it
    with pytest.raises(SourceReadError, match=rf"sample 3 \(.*web\.parquet row 3\) has the image placeholder id "
                                              rf"{img} in its text") as err:
        drain("raise")
    assert "on_error='skip'" in str(err.value)

    # a NodeSource skips it the same way
    from torchdata.nodes import IterableWrapper
    node = ol.NodeSource("items", IterableWrapper([{"text": t or "x"} for t in text]), Tokenize(model), on_error="skip")
    loader = SourceLoader(node, buffer_size=4, image_token_id=img)
    got = []
    while len(meta := loader.metadata()):
        got += loader.take(meta.index.tolist())
    assert sorted(got) == [g for g in gids if g not in stray]
    assert sorted(s["row"] for s in node.skipped) == [3, 8] and loader.stats()["skipped"] == 2

    # every row holding it: no row usable, which raises rather than cycling
    pq.write_table(pa.table({"text": ["<image> only"] * 5}), tmp_path / "all.parquet")
    src = ParquetSource("all", str(tmp_path / "all.parquet"), Tokenize(model), on_error="skip")
    with pytest.raises(SourceReadError, match=r"no row of this source is usable \(latest: .*placeholder"):
        SourceLoader(src, buffer_size=2, image_token_id=img).metadata()


# ---- messages that fit the policy: no advice to pass on_error='skip' once it is passed -----------------------

def test_skip_messages_fit_the_policy_and_an_all_skipped_source_says_why(spm_model, tmp_path, caplog):
    """A file skipped under on_error='skip' (no such column, corrupt Parquet, CSV with invalid UTF-8, JSON Lines
    with a broken line) used to be logged with '... or pass on_error='skip''; and a source whose every file was
    skipped said 'point it at non-empty ... files' of files that are not empty. Under 'raise' the advice stays."""
    d = tmp_path / "pq"
    d.mkdir()
    write_texts(d / "a.parquet", range(0, 6))
    write_texts(d / "b.parquet", range(6, 10), field="body")                  # no 'text' column
    (d / "c.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 2 + b"PAR1")  # not Parquet inside
    t = tmp_path / "text"
    t.mkdir()
    good = TEXTS[:4]
    (t / "a.csv").write_bytes(b"text\n" + b"\n".join(f'"{x}"'.encode() for x in good[:2]) + b'\n"caf\xe9 latin1"\n'
                              + b"\n".join(f'"{x}"'.encode() for x in good[2:]) + b"\n")    # one row not UTF-8
    (t / "b.jsonl").write_text('{"text": "fine"}\n{"text": "unterminated\n{"text": "fine too"}\n')
    (t / "c.jsonl").write_text("".join(f'{{"text": "{x}"}}\n' for x in good))

    # under "raise": each bad file raises, naming it and saying what to do, on_error='skip' included
    for paths, bad, what in ((d / "[ab].parquet", "b.parquet", "has no column"),
                             (d / "[ac].parquet", "c.parquet", "not a readable Parquet file"),
                             (t / "a.csv", "a.csv", "not a readable CSV file"),
                             (t / "b.jsonl", "b.jsonl", "not a readable JSON Lines file")):
        cls = ParquetSource if str(paths).endswith(".parquet") else ol.FileSource
        with pytest.raises(ol.ConfigError, match=rf"{re.escape(bad)}:? {what}.*on_error='skip' to skip such files"):
            cls("s", str(paths), Tokenize(spm_model), metadata_cache=False)

    # under "skip": skipped, and neither what is recorded nor the log advises passing on_error='skip'
    with caplog.at_level(logging.WARNING, logger="torchdata_overlord"):
        src = ParquetSource("s", str(d / "*.parquet"), Tokenize(spm_model), on_error="skip", metadata_cache=False)
        text = ol.FileSource("t", str(t / "*"), Tokenize(spm_model), on_error="skip", metadata_cache=False)
        src.close()
        text.close()
    assert sorted(s["file"].rsplit("/", 1)[1] for s in src.skipped) == ["b.parquet", "c.parquet"]
    assert sorted(s["file"].rsplit("/", 1)[1] for s in text.skipped) == ["a.csv", "b.jsonl"]
    errors = {s["file"].rsplit("/", 1)[1]: s["error"] for s in src.skipped + text.skipped}
    assert "has no column(s) ['text']" in errors["b.parquet"] and "Tokenize(field=...)" in errors["b.parquet"]
    assert "not a readable Parquet file" in errors["c.parquet"]
    assert "not a readable CSV file" in errors["a.csv"] and "UTF8" in errors["a.csv"]
    assert "not a readable JSON Lines file" in errors["b.jsonl"]
    lines = skip_lines(caplog)
    assert len(lines) == 4 and all(f in " ".join(lines) for f in errors)
    for said in [*errors.values(), *lines]:
        assert "pass on_error" not in said and "or on_error" not in said, said
    # (the columns= advice, too)
    with caplog.at_level(logging.WARNING, logger="torchdata_overlord"):
        src = ParquetSource("s", str(d / "[ab].parquet"), columns=["text"], on_error="skip", metadata_cache=False)
    assert src.skipped[0]["error"].endswith("Fix `columns=`.")

    # every file skipped: says so, and why (the first reasons), and what to do; not "non-empty" files
    with pytest.raises(ol.ConfigError) as err:
        ol.FileSource("t", str(t / "[ab].*"), Tokenize(spm_model), on_error="skip", metadata_cache=False)
    msg = str(err.value)
    assert msg.startswith("source 't' has no rows: all its 2 file(s) were skipped (on_error='skip'): ")
    assert "a.csv: ConfigError: " in msg and "invalid UTF8" in msg and "b.jsonl: ConfigError: " in msg
    assert msg.endswith("Fix these files or remove them from the source's paths")
    assert "non-empty" not in msg and "pass on_error" not in msg
    # more than three: the first three reasons and how many more
    many = tmp_path / "many"
    many.mkdir()
    for i in range(5):
        write_texts(many / f"{i}.parquet", range(3), field="body")
    with pytest.raises(ol.ConfigError, match=r"all its 5 file\(s\) were skipped .*0\.parquet.*1\.parquet.*2\."
                                             r"parquet.* at one of the available columns; and 2 more\. Fix these "
                                             r"files") as err:
        ParquetSource("s", str(many / "*.parquet"), Tokenize(spm_model), on_error="skip", metadata_cache=False)
    assert "3.parquet" not in str(err.value) and "4.parquet" not in str(err.value)
    # usable files that are empty beside skipped ones: both said
    (t / "empty.csv").write_text("")
    with pytest.raises(ol.ConfigError, match=r"has no rows: its 1 usable file\(s\) \(.*empty\.csv\) are empty, and the "
                                             r"other 1 were skipped \(on_error='skip'\): .*a\.csv: .*UTF8 data\)\. "
                                             r"Fix the skipped files, or point the source at non-empty JSON "
                                             r"Lines/CSV/Arrow IPC files$"):
        ol.FileSource("t", [str(t / "a.csv"), str(t / "empty.csv")], Tokenize(spm_model), on_error="skip",
                      metadata_cache=False)


def test_a_row_whose_text_is_not_a_string_says_what_it_is_with_the_right_article(spm_model, tmp_path):
    """The reason a skip records (and the error under 'raise') named the value's type after 'a': 'got a int'."""
    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": pa.array([1, 2, 3], pa.int64())}), path)
    with pytest.raises(SourceReadError, match=r"field 'text' must be a string, got an int\. Fix the transform"):
        next(ParquetSource("ints", str(path), Tokenize(spm_model), shuffle=False))
    pq.write_table(pa.table({"text": pa.array([TEXTS[0], None, TEXTS[2]]), "n": [1, 2, 3]}), path)
    src = ParquetSource("ints", str(path), Tokenize(spm_model, field="n"), on_error="skip", shuffle=False)
    with pytest.raises(SourceReadError, match="no row of this source is usable"):
        next(src)
    assert [s["error"] for s in src.skipped] == ["TypeError: Tokenize: field 'n' must be a string, got an int"] * 3
    pq.write_table(pa.table({"text": pa.array([[1.5], [2.5]])}), path)
    with pytest.raises(SourceReadError, match=r"must be a string, got a list\. "):
        next(ParquetSource("lists", str(path), Tokenize(spm_model), shuffle=False))


def test_one_row_that_does_not_parse_skips_its_whole_text_file(spm_model, tmp_path):
    """What README and FileSource's docstring say: a JSON Lines/CSV file plays one row group, so under
    on_error='skip' one row pyarrow cannot parse skips the whole file (none of its good rows is read), while a
    row the transform fails on is skipped alone. (Documents the behaviour; it passes before the docs said so.)"""
    good = TEXTS[:5]
    (tmp_path / "a.jsonl").write_text("".join(f'{{"text": "{x}"}}\n' for x in good[:2]) + '{"text": \n'
                                      + "".join(f'{{"text": "{x}"}}\n' for x in good[2:]))
    (tmp_path / "b.csv").write_text("text\n" + "".join(f'"{x}"\n' for x in good[:2]) + '"x",extra\n'
                                    + "".join(f'"{x}"\n' for x in good[2:]))           # one row, too many cells
    (tmp_path / "c.jsonl").write_text("".join(f'{{"text": "{x}"}}\n' for x in good[:2]) + '{"text": null}\n'
                                      + "".join(f'{{"text": "{x}"}}\n' for x in good[2:]))
    src = ol.FileSource("t", str(tmp_path / "*.*"), Tokenize(spm_model), on_error="skip", epochs=1, shuffle=False,
                        metadata_cache=False)
    assert [(s["file"].rsplit("/", 1)[1], s["row"]) for s in src.skipped] == [("a.jsonl", None), ("b.csv", None)]
    assert src.files == [str(tmp_path / "c.jsonl")] and src.num_rows == 6
    got = [k for k, _ in src]
    assert got == [0, 1, 3, 4, 5] and [(s["file"].rsplit("/", 1)[1], s["row"]) for s in src.skipped][2:] == \
        [("c.jsonl", 2)]


# ---- a string value that is not valid UTF-8: a failing row, not a bare UnicodeDecodeError ---------------------

def write_not_utf8(tmp_path, fmt, n=12, bad=(3, 8), null=(5,)):
    """12 rows ``TEXTS[0..11]`` as a JSON Lines file or a Parquet file (row groups of 4) whose ``text`` at rows
    ``bad`` holds the bytes ``\\xff\\xfe`` (not UTF-8: pyarrow's JSON reader and Parquet accept them, reading
    the value as ``str`` fails) and at rows ``null`` is null (the transform fails on it)."""
    values = [None if g in null else (f"bad \xff\xfe {g}" if g in bad else TEXTS[g]) for g in range(n)]
    raw = [None if v is None else v.encode("latin-1" if g in bad else "utf-8") for g, v in enumerate(values)]
    if fmt == "jsonl":
        path = tmp_path / "web.jsonl"
        path.write_bytes(b"".join(b'{"gid": %d, "text": ' % g + (b"null" if v is None else b'"' + v + b'"') + b"}\n"
                                  for g, v in enumerate(raw)))
    else:
        path = tmp_path / "web.parquet"
        text = pa.array(raw, pa.binary()).view(pa.string())
        pq.write_table(pa.table({"gid": pa.array(range(n), pa.int64()), "text": text}), path, row_group_size=4)
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_string_that_is_not_utf8_is_a_failing_row_skipped_and_counted_or_named(spm_model, tmp_path, caplog, fmt):
    """A JSON Lines or Parquet string that is not valid UTF-8 opened fine, then reading its row raised a bare
    UnicodeDecodeError naming no file or row, under on_error='skip' too (the local loader died; under rpc the
    start-up failed). Now it is a failing row: under 'skip' skipped and counted as a row the transform fails on
    (exact counts, the same log, the rest of the stream unchanged and resumable), under 'raise' a
    SourceReadError naming the file, row and column and saying what to do."""
    n, bad, null = 12, {3, 8}, {5}
    good = [g for g in range(n) if g not in bad | null]
    path = write_not_utf8(tmp_path, fmt)
    cls = ParquetSource if fmt == "parquet" else ol.FileSource

    def source(on_error, **kw):
        return cls("web", path, Tokenize(spm_model), on_error=on_error, shuffle=False, metadata_cache=False, **kw)

    # the source alone, under "skip": every other row once, each bad row counted once per epoch
    with caplog.at_level(logging.WARNING, logger="torchdata_overlord"):
        src = source("skip", epochs=2)
        keys = [k for k, _ in src]
        src.close()
    assert keys == good * 2
    assert src.skips.stats() == {"skipped": 6, "skipped_distinct": 3, "skipped_files": {}}
    assert sorted((s["file"], s["row"], s["count"]) for s in src.skipped) == [(path, r, 2) for r in (3, 5, 8)]
    by_row = {s["row"]: s["error"] for s in src.skipped}
    for r in (3, 8):
        assert by_row[r].startswith("ValueError: column 'text' holds a string that is not valid UTF-8 "
                                    "(UnicodeDecodeError: ") and "0xff" in by_row[r]
    lines = skip_lines(caplog)          # the first skip in full, as a failing row's; the rest summed up at close
    assert lines[0].startswith(f"source 'web': skipped {path} row 3: ValueError: column 'text' holds a string")
    assert len(lines) == 2 and "5 more" in lines[1] and "6 in all" in lines[1] and "3 distinct" in lines[1]
    assert all("pass on_error" not in x for x in lines + list(by_row.values()))

    # a state taken at any point (before, at or after a bad row) resumes exactly: the same rest, the same keys
    for cut in range(len(good) + 1):
        src = source("skip", epochs=1)
        head = [k for _, (k, _) in zip(range(cut), src)]
        state = src.state_dict()
        again = source("skip", epochs=1)
        again.load_state_dict(state)
        assert head + [k for k, _ in again] == good, cut

    # through a Source Loader (the read path a loader uses), with states taken between takes
    for buffer_size in (1, 3):
        loader = SourceLoader(source("skip", epochs=1), buffer_size=buffer_size)
        got, states = [], []
        while len(meta := loader.metadata()):
            states.append((len(got), loader.get_state()))
            got += sorted(loader.take(meta.index[:1].tolist()))
        assert got == good and loader.stats()["skipped"] == 3, buffer_size
        for at, state in states:
            fresh = SourceLoader(source("skip", epochs=1), buffer_size=buffer_size)
            fresh.reset(state)
            rest = []
            while len(meta := fresh.metadata()):
                rest += sorted(fresh.take(meta.index[:1].tolist()))
            assert got[:at] + rest == good, (buffer_size, at)
        loader.reset(states[0][1])              # a restore in the same process does not count a skip again
        while len(meta := loader.metadata()):
            loader.take(meta.index.tolist())
        assert loader.stats()["skipped"] == 3

    # under "raise": names the file, the row and the column, says what to do; a state taken then resumes at it
    src = source("raise", epochs=1)
    assert [k for _, (k, _) in zip(range(3), src)] == [0, 1, 2]
    with pytest.raises(SourceReadError) as err:
        next(src)
    msg = str(err.value)
    assert f"reading {path} row 3 (key 3) failed: column 'text' holds a string that is not valid UTF-8" in msg
    assert "Fix that row in the file, or pass on_error='skip'" in msg
    assert isinstance(err.value.__cause__, UnicodeDecodeError)
    assert src.state_dict()["row"] == 3
    with pytest.raises(SourceReadError, match=r"row 3 \(key 3\) failed: column 'text'"):
        next(src)

    # the local loader: under "skip" it serves every good row once and counts the skips exactly; under "raise" it
    # fails with the named error
    with ol.OverlordLoader([source("skip", epochs=1)], one_source_strategy, ol.ClientPlaceTree(dp=1), rank=0,
                           global_batch=3, seq_len=None, prefetch=0) as loader:
        served = [int(k.split(":")[1]) for b in loader for mb in b["microbatches"] for k in mb["sample_keys"]]
        web = loader.stats()["sources"]["web"]
    assert sorted(served) == good and web["skipped"] == 3 and web["skipped_distinct"] == 3
    with pytest.raises(SourceReadError, match=rf"{re.escape(path)} row 3 \(key 3\) failed: column 'text' holds a "
                                              rf"string that is not valid UTF-8"):
        with ol.OverlordLoader([source("raise", epochs=1)], one_source_strategy, ol.ClientPlaceTree(dp=1), rank=0,
                               global_batch=3, seq_len=None, prefetch=0) as loader:
            list(loader)


def test_a_string_that_is_not_utf8_skips_its_row_in_rpc_role_processes_too(spm_model, tmp_path):
    """runtime='rpc': the bad row failed the role's start-up ('raised by loader:s.warm()'); now under 'skip' the
    rows around it are served and the skip counted, and under 'raise' the named error reaches the trainer."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    path = write_not_utf8(tmp_path, "jsonl", n=7, bad=(1,), null=())
    out = tmp_path / "out.json"
    script = f"""
import json
import torchdata_overlord as ol

def strategy(g):
    return g.mix({{"web": 1.0}}).distribute("DP").cost(ol.token_count).balance("greedy", microbatches=1).plan()

if __name__ == "__main__":
    got = {{}}
    for policy in ("skip", "raise"):
        src = ol.FileSource("web", {path!r}, ol.Tokenize({str(spm_model)!r}), on_error=policy, shuffle=False,
                            epochs=1, metadata_cache=False)
        try:
            with ol.OverlordLoader([src], strategy, ol.ClientPlaceTree(dp=1), rank=0, global_batch=2, seq_len=None,
                                   runtime="rpc") as loader:
                keys = [k for b in loader for mb in b["microbatches"] for k in mb["sample_keys"]]
                got[policy] = [sorted(keys), loader.stats()["sources"]["web"]["skipped"]]
        except Exception as e:
            got[policy] = [type(e).__name__, str(e)]
    json.dump(got, open({str(out)!r}, "w"))
"""
    (tmp_path / "run_rpc.py").write_text(script)        # a file: the roles import the strategy from it
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(tmp_path / "run_rpc.py")], capture_output=True, text=True,
                          timeout=180, cwd=str(root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["skip"] == [[f"web:{k}" for k in (0, 2, 3, 4, 5, 6)], 1]      # 3 full steps of 2
    kind, msg = got["raise"]
    assert kind == "SourceReadError" and f"reading {path} row 1 (key 1) failed: column 'text' holds a string that " \
                                          f"is not valid UTF-8" in msg, msg

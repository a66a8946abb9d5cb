"""Read ahead (``sources/read_ahead.py``): a Source Loader over ``ReadAhead(source)`` gives what it gives
over the source itself, whatever was read ahead and whenever.

Two identical Parquet sources (real files, several row groups, two epochs, some rows skipped under
``on_error="skip"``) each under a :class:`SourceLoader`, one wrapped: a random run of steps (fill,
take the oldest samples and some out of order), of read-ahead requests of random depth (waited for
or not), of states saved and reset to, must give the same samples, metadata and states at every
step. Errors met ahead (a file that does not decode, a transform that raises) are raised at the same
step with the same text; closing stops the thread.
"""

from __future__ import annotations

import copy
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from torchdata_overlord.roles.source_loader import SourceLoader
from torchdata_overlord.sources import NodeSource, ParquetSource, SourceReadError
from torchdata_overlord.runtime.switches import env_on
from torchdata_overlord.sources.read_ahead import ReadAhead
from _support import numbered_parquet

WAIT = 30.0


def _transform(row):
    if row["n"] % 13 == 4:
        raise ValueError("a bad row")          # skipped under on_error="skip"
    return {"input_ids": np.full(row["n"] % 9 + 1, row["n"] % 89 + 1, dtype=np.int64), "n": row["n"]}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return numbered_parquet(tmp_path_factory.mktemp("ahead"), seed=1, rows=(30, 70), row_groups=(5, 14))


def _pair(files, buffer: int, **kw):
    make = lambda: ParquetSource("s", files, _transform, seed=5, on_error="skip", epochs=2, **kw)   # noqa: E731
    ahead = ReadAhead(make())
    return SourceLoader(make(), buffer), SourceLoader(ahead, buffer), ahead


def _same(a: SourceLoader, b: SourceLoader) -> None:
    ma, mb = a.metadata(), b.metadata()
    assert ma.index.tolist() == mb.index.tolist()
    assert ma.tokens.tolist() == mb.tokens.tolist()
    assert a.get_state() == b.get_state()
    assert a.exhausted == b.exhausted and a.epochs_started == b.epochs_started


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), buffer=st.integers(3, 12), steps=st.integers(5, 40))
def test_same_stream_states_and_errors_as_the_source_itself(files, seed, buffer, steps):
    rng = np.random.default_rng(seed)
    plain, wrapped, ahead = _pair(files, buffer)
    saved = []
    try:
        for _ in range(steps):
            _same(plain, wrapped)
            if rng.random() < 0.2:
                saved.append(copy.deepcopy(plain.get_state()))
            if saved and rng.random() < 0.1:              # back to a state saved earlier (a resume)
                state = saved[int(rng.integers(len(saved)))]
                plain.reset(copy.deepcopy(state))
                wrapped.reset(copy.deepcopy(state))
                continue
            meta = plain.metadata()
            if not len(meta.index):
                break
            want = min(len(meta.index), int(rng.integers(1, buffer + 1)))
            pick = meta.index[:want].tolist()
            if len(meta.index) > want and rng.random() < 0.5:      # one out of order
                pick.append(int(meta.index[int(rng.integers(want, len(meta.index)))]))
            got_a, got_b = plain.take(pick), wrapped.take(pick)
            assert list(got_a) == list(got_b) == pick
            for i in pick:
                assert got_a[i]["n"] == got_b[i]["n"]
                assert np.array_equal(got_a[i]["input_ids"], got_b[i]["input_ids"])
            plain.fill()
            wrapped.fill()
            ahead.ahead(int(rng.integers(0, 2 * buffer)))
            if rng.random() < 0.5:
                assert ahead.wait_ready(WAIT)
        _same(plain, wrapped)
        # a row skipped ahead is counted when its transform ran, before it is consumed
        assert 0 <= wrapped.stats()["skipped"] - plain.stats()["skipped"] <= ahead.counts["read"]
    finally:
        plain.close()
        wrapped.close()


def test_rows_read_ahead_are_used_and_not_counted_in_the_state(files):
    plain, wrapped, ahead = _pair(files, 6)
    try:
        wrapped.fill()
        state = wrapped.get_state()
        ahead.ahead(10)
        assert ahead.wait_ready(WAIT)
        assert ahead.counts["read"] >= 10
        assert wrapped.get_state() == state          # reading ahead moved nothing a checkpoint sees
        for loader in (plain, wrapped):
            loader.fill()
            loader.take(loader.metadata().index[:6].tolist())
            loader.fill()
        assert ahead.counts["ready"] >= 6            # the refill found them transformed
        _same(plain, wrapped)
    finally:
        plain.close()
        wrapped.close()


def test_finish_is_applied_to_the_samples_the_thread_transformed(files):
    """``finish`` (the rpc loader's hold into shared memory) runs on what the read-ahead thread transformed,
    on that thread, and not on a row the consumer transformed itself; the samples keep their values."""
    ahead = ReadAhead(ParquetSource("s", files, _transform, seed=5, epochs=2))     # a bad row raises
    plain = ParquetSource("s", files, _transform, seed=5, epochs=2)
    seen = []

    def finish(sample):
        seen.append(threading.current_thread().name)
        return {**sample, "finished": True}

    ahead.finish = finish
    try:
        ahead.ahead(8)
        assert ahead.wait_ready(WAIT)
        got, finished = [], []
        for k in range(14):                      # 8 rows transformed ahead, then rows read and transformed now
            index, row, where = ahead.next_raw()
            try:
                sample = ahead.apply(row, where)
            except SourceReadError:              # a bad row: raised where consumed, finish or not
                continue
            finished.append((k < 8, sample.pop("finished", False)))
            got.append((index, sample))
        assert finished and all(ahead_ == done for ahead_, done in finished)
        assert len(seen) == sum(a for a, _ in finished) and all(n.startswith("overlord-ahead-") for n in seen)
        want = []
        while len(want) < len(got):
            index, row, where = plain.next_raw()
            try:
                want.append((index, plain.apply(row, where)))
            except SourceReadError:
                pass
        assert [i for i, _ in got] == [i for i, _ in want]
        assert all(a["n"] == b["n"] and np.array_equal(a["input_ids"], b["input_ids"])
                   for (_, a), (_, b) in zip(got, want))
    finally:
        ahead.close()
        plain.close()


@pytest.mark.parametrize("bad", ["row group", "transform"])
def test_an_error_met_ahead_is_raised_at_the_same_step_with_the_same_text(tmp_path, bad):
    for f in range(2):
        pq.write_table(pa.table({"n": np.arange(40 * f, 40 * f + 40)}), tmp_path / f"f{f}.parquet", row_group_size=10)
    if bad == "row group":                           # the second file's second row group garbled, its footer intact
        path = tmp_path / "f1.parquet"
        col = pq.ParquetFile(path).metadata.row_group(1).column(0)
        raw = bytearray(path.read_bytes())
        start = col.dictionary_page_offset or col.data_page_offset
        raw[start:start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
        path.write_bytes(bytes(raw))

    def strict(row):
        if bad == "transform" and row["n"] == 37:
            raise ValueError("row 37 is bad")
        return {"input_ids": np.full(3, row["n"], dtype=np.int64)}

    def run(wrap: bool):
        src = ParquetSource("s", str(tmp_path / "*.parquet"), strict, shuffle=False)
        ahead = ReadAhead(src) if wrap else None
        loader = SourceLoader(ahead or src, 5)
        try:
            for step in range(20):
                try:
                    loader.take(loader.metadata().index[:5].tolist())
                    if ahead is not None:
                        ahead.ahead(30)
                        assert ahead.wait_ready(WAIT)
                    loader.fill()
                except SourceReadError as e:
                    return step, str(e), loader.get_state()
        finally:
            loader.close()
        return None

    got, expected = run(True), run(False)
    assert expected is not None and expected[0] > 0
    assert ("row 37 is bad" if bad == "transform" else "f1.parquet") in expected[1]
    assert got == expected


def test_the_end_of_the_source_read_ahead_ends_the_loader_at_the_same_sample(tmp_path):
    pq.write_table(pa.table({"n": np.arange(23)}), tmp_path / "a.parquet", row_group_size=4)

    def run(wrap: bool):
        src = ParquetSource("s", str(tmp_path / "a.parquet"), _transform, shuffle=False, epochs=1, on_error="skip")
        ahead = ReadAhead(src) if wrap else None
        loader = SourceLoader(ahead or src, 4)
        out = []
        try:
            while True:
                meta = loader.metadata()
                if not len(meta.index):
                    return out, loader.exhausted, loader.get_state()
                out += list(loader.take(meta.index[:3].tolist()))
                if ahead is not None:
                    ahead.ahead(50)
                    assert ahead.wait_ready(WAIT)
        finally:
            loader.close()

    assert run(True) == run(False)


def _node():
    from torchdata.nodes import IterableWrapper

    return IterableWrapper(range(50))


def test_a_source_without_read_order_keys_stays_one():
    src = ReadAhead(NodeSource("nodes", _node, transform=lambda x: {"input_ids": [x + 1]}))
    assert not hasattr(src, "last_order")
    plain = SourceLoader(NodeSource("nodes", _node, transform=lambda x: {"input_ids": [x + 1]}), 4)
    wrapped = SourceLoader(src, 4)
    try:
        assert not wrapped.ordered
        for _ in range(8):
            src.ahead(5)
            a = plain.take(plain.metadata().index[:3].tolist())
            b = wrapped.take(wrapped.metadata().index[:3].tolist())
            assert a == b
            assert plain.get_state() == wrapped.get_state()
    finally:
        plain.close()
        wrapped.close()


def test_close_stops_the_thread(files):
    plain, wrapped, ahead = _pair(files, 5)
    plain.close()
    wrapped.fill()
    ahead.ahead(20)
    assert any(t.name == "overlord-ahead-s" for t in threading.enumerate())
    wrapped.close()
    assert not any(t.name == "overlord-ahead-s" for t in threading.enumerate())
    ahead.ahead(5)                                   # after close: nothing starts again
    assert not any(t.name == "overlord-ahead-s" for t in threading.enumerate())


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), ("off", False), ("no", False)])
def test_the_environment_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("OVERLORD_READ_AHEAD", raising=False)
    else:
        monkeypatch.setenv("OVERLORD_READ_AHEAD", value)
    assert env_on("OVERLORD_READ_AHEAD") is on

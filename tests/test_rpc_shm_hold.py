"""Held records (runtime/wire.hold, runtime/shm.hold): a sample's tensors put into shared memory ahead of
its step travel by place, not by copy, and an unchanged held record as the pickle made when it was held
(a record changed since travels as it is now). They arrive identical (dtypes, shapes, strides); a region is
reused only once the sender's record and every receiver's views of it are gone, whatever the order;
a region whose slots are all taken, a tensor moved since it was held, or a full arena fall back to a
copy; a message never sent gives its slots back; and across processes a receiver's views outlive
the sender's record and the sender itself."""

from __future__ import annotations

import copy
import gc
import io
import os
import pickle
import random
import signal
import time
import types

import numpy as np
import pytest
import torch

from torchdata_overlord.runtime import shm
from torchdata_overlord.runtime.procstats import process_running
from torchdata_overlord.runtime.wire import _PLACES, HOLD_MIN_BYTES, HeldRecord, discard, hold, pack, unpack

from test_rpc_shm import arena  # noqa: F401 (fixture: this process's arena, a pretend peer of the host)


def hold_all(record):
    """:func:`hold` whatever the record's size (the mechanics; by default only records of 256 KiB and more)."""
    return hold(record, min_bytes=0)


def _record(i: int, n: int = 500) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"input_ids": torch.randint(0, 50_000, (n,), generator=g),
            "pixels": [torch.randint(0, 256, (5, 4, 3), dtype=torch.uint8, generator=g).permute(2, 0, 1),
                       torch.randint(0, 256, (3, 2, 2), dtype=torch.uint8, generator=g)],
            "scores": torch.rand(7, generator=g).to(torch.bfloat16), "grid": (2, 2), "index": i, "source": "web"}


def _place(t: torch.Tensor):
    """Where :func:`hold` put ``t``."""
    return _PLACES[id(t)]


def _same(a: dict, b: dict) -> bool:
    def eq(x, y):
        return x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride() and torch.equal(x, y)
    return (a.keys() == b.keys() and eq(a["input_ids"], b["input_ids"]) and eq(a["scores"], b["scores"])
            and len(a["pixels"]) == len(b["pixels"]) and all(map(eq, a["pixels"], b["pixels"]))
            and all(a[k] == b[k] for k in ("grid", "index", "source")))


def _in_arena(t: torch.Tensor) -> bool:
    a = shm.current()
    start = np.frombuffer(a.mm, np.uint8, count=1).ctypes.data
    return start <= t.data_ptr() < start + a.size


def _all_free() -> bool:
    """Whether every region of this process's arena is free (all its header words), after forgetting them."""
    a = shm.current()
    with a.lock:
        a._sweep()
        return not a.starts


def _sent_by_place(ref) -> bool:
    return isinstance(ref, tuple) and bool(ref[6])


def test_a_held_record_travels_by_place_and_arrives_identical(arena):
    plain = {i: _record(i) for i in range(4)}
    held = {i: hold_all(r) for i, r in plain.items()}
    assert all(_same(held[i], plain[i]) for i in plain)
    assert all(_in_arena(t) for r in held.values() for t in (r["input_ids"], r["scores"], *r["pixels"]))
    assert all(type(held[i]["pixels"]) is list for i in held)
    data, ref = pack(held, peer="peer")
    assert _sent_by_place(ref) and ref[4] == -1        # every tensor by place: no buffer at all
    got = unpack(data, ref)
    assert all(_same(got[i], plain[i]) for i in plain)
    # with a tensor that is not held, the message has a buffer too; both arrive
    data, ref = pack({"held": held[0], "plain": torch.arange(10)}, peer="peer")
    assert _sent_by_place(ref) and ref[4] >= 0
    got = unpack(data, ref)
    assert _same(got["held"], plain[0]) and torch.equal(got["plain"], torch.arange(10))
    # to a peer that is not known to share the host, a held record is copied as any other
    data, ref = pack(held, peer="elsewhere")
    assert isinstance(ref, torch.Tensor)
    assert all(_same(unpack(data, ref)[i], plain[i]) for i in plain)


def _sealed(data: bytes) -> bool:
    """Whether a packed message carries a held record as the pickle made when it was held."""
    return b"_unseal" in data


def test_a_held_record_is_sent_as_the_pickle_made_when_it_was_held(arena):
    """The put walks no held record: it sends the pickle made by hold (its tensors as places) and the region;
    the receiver gets a plain dict. Pickled any other way, or copied, a held record is a plain dict with its
    values, and its tensors save with torch.save."""
    plain = {i: _record(i) for i in range(3)}
    held = {i: hold_all(r) for i, r in plain.items()}
    assert all(type(r) is HeldRecord and isinstance(r, dict) for r in held.values())
    data, ref = pack({"step": 7, "recs": held}, peer="peer")
    assert _sealed(data) and _sent_by_place(ref) and ref[4] == -1
    got = unpack(data, ref)
    assert got["step"] == 7 and all(type(got["recs"][i]) is dict and _same(got["recs"][i], plain[i]) for i in plain)
    data, ref = pack(held, peer="elsewhere")               # to a peer not known to share the host: copied
    assert not _sealed(data) and isinstance(ref, torch.Tensor)
    assert all(_same(unpack(data, ref)[i], plain[i]) for i in plain)
    for other in (pickle.loads(pickle.dumps(held[0])), copy.deepcopy(held[0]), copy.copy(held[0])):
        assert type(other) is dict and _same(other, plain[0])
    saved = io.BytesIO()                                    # its tensors save as any (the place is no attribute)
    torch.save({k: held[0][k] for k in ("input_ids", "pixels", "scores")}, saved)
    saved.seek(0)
    back = torch.load(saved, weights_only=True)
    assert torch.equal(back["input_ids"], plain[0]["input_ids"]) and torch.equal(back["pixels"][0], plain[0]["pixels"][0])


@pytest.mark.parametrize("change", ["set a key", "remove a key", "replace a list item", "append to a list",
                                    "add in place", "resize", "set_", "assign .data", "another dtype",
                                    "require grad"])
def test_a_held_record_changed_since_is_sent_as_it_is_now(arena, change):
    """Whatever changed after hold (the dict, one of its lists, a tensor's values or storage), the receiver
    gets the record as it is at the put, not as it was held."""
    mine = hold_all(_record(5))
    if change == "set a key":
        mine["index"] = 99
    elif change == "remove a key":
        del mine["source"]
    elif change == "replace a list item":
        mine["pixels"][1] = torch.full((3, 2, 2), 7, dtype=torch.uint8)
    elif change == "append to a list":
        mine["pixels"].append(torch.ones(2, dtype=torch.uint8))
    elif change == "add in place":
        mine["input_ids"].add_(1)
    elif change == "resize":
        mine["scores"].resize_(3)
    elif change == "assign .data":                       # (bumps no version counter)
        mine["input_ids"].data = mine["input_ids"].clone() + 1   # (same shape and strides, other memory)
    elif change == "another dtype":                      # (same memory, shape and strides; no version bump)
        mine["input_ids"].data = mine["input_ids"].view(torch.float64)
    elif change == "require grad":
        mine["scores"].requires_grad_()
    else:
        mine["input_ids"].set_(torch.arange(5))
    expected = {k: (list(v) if type(v) is list else v) for k, v in mine.items()}
    data, ref = pack({"r": mine}, peer="peer")
    assert not _sealed(data) or change == "add in place"     # (values changed in place: the region has them)
    got = unpack(data, ref)["r"]
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v) and got[k].requires_grad == v.requires_grad, k
        elif isinstance(v, list):
            assert len(got[k]) == len(v) and all(torch.equal(a, b) for a, b in zip(got[k], v)), k
        else:
            assert got[k] == v, k


def test_a_held_record_with_a_value_hold_cannot_watch_is_held_but_not_sealed(arena):
    """A value that could change unseen (a nested dict) keeps the record a plain dict: its tensors still
    travel by place, one by one."""
    r = {**_record(6), "meta": {"lang": "en"}}
    held = hold_all(r)
    assert type(held) is dict and _in_arena(held["input_ids"])
    data, ref = pack({"r": held}, peer="peer")
    assert not _sealed(data) and _sent_by_place(ref)
    got = unpack(data, ref)["r"]
    assert got["meta"] == {"lang": "en"} and torch.equal(got["input_ids"], r["input_ids"])


def test_by_default_only_records_of_images_are_held(arena):
    """Holding costs more Python than a put's copy of a few KiB saves: a loader holds only big records."""
    small = _record(0)                                       # ~4 KiB of tensors
    assert hold(small) is small
    image = {**_record(1), "pixels": torch.zeros(3, 300, 300, dtype=torch.uint8)}   # 270 KiB
    assert sum(t.nbytes for t in (image["input_ids"], image["pixels"], image["scores"])) >= HOLD_MIN_BYTES
    held = hold(image)
    assert held is not image and _in_arena(held["pixels"]) and _in_arena(held["input_ids"])
    assert _sent_by_place(pack({"r": held}, peer="peer")[1])


def test_hold_leaves_a_record_alone_when_it_cannot_hold_it(arena, monkeypatch):
    r = {"x": torch.arange(3.0, requires_grad=True), "n": 1}
    assert hold_all(r) is r                               # nothing it holds (a tensor that needs grad)
    seq = [torch.arange(3)]
    assert hold_all(seq) is seq                           # not a dict
    shm.set_enabled(False)
    r = _record(0)
    assert hold_all(r) is r
    shm.set_enabled(True)
    monkeypatch.setenv(shm.SIZE_ENV, "4")
    shm.reset()
    shm.set_enabled(True)
    big = {"x": torch.zeros(1_100_000, dtype=torch.uint8)}   # more than a quarter of a 4 MiB arena
    assert hold_all(big) is big


def test_a_held_region_is_reused_only_once_the_sender_and_every_receiver_let_go(arena):
    """A record sent twice: its region stays while the sender's record or either receiver's views live,
    whichever goes last, and is reused (lowest addresses first) once all are gone, without a GC pass."""
    for order in ([0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]):
        gc.disable()
        try:
            mine = hold_all(_record(1))
            start = _place(mine["input_ids"]).region
            first = unpack(*pack({"r": mine}, peer="peer"))["r"]
            second = unpack(*pack({"r": mine}, peer="peer"))["r"]
            holders = [mine, first, second]
            del mine, first, second
            for k, who in enumerate(order):
                holders[who] = None
                probe = hold_all(_record(99))             # lands in the lowest free region
                reused = _place(probe["input_ids"]).region == start
                assert reused == (k == len(order) - 1), (order, k)
                assert all(_same(h, _record(1)) for h in holders if h is not None)
                del probe
        finally:
            gc.enable()


def test_each_region_of_a_message_is_freed_on_its_own(arena):
    """A receiver that keeps one record of a message (a trainer keeping one image) keeps that record's region
    only: the others' slots are free, and the kept tensor's storage is its own bytes, not more."""
    mine = {i: hold_all(_record(i)) for i in range(3)}
    got = unpack(*pack(mine, peer="peer"))
    kept = got[0]["input_ids"]
    del got
    words = shm.current().words
    starts = {i: _place(r["input_ids"]).region // 8 for i, r in mine.items()}
    slots = {i: words[w:w + 8].tolist() for i, w in starts.items()}
    assert slots[0][1] == 1 and slots[1][1:] == [0] * 7 and slots[2][1:] == [0] * 7
    assert kept.untyped_storage().nbytes() == kept.nbytes
    assert torch.equal(kept, _record(0)["input_ids"])


def test_randomized_holds_sends_and_drops_never_reuse_a_region_that_is_seen(arena):
    """Random interleavings of holding, sending (to up to three receivers), discarding unsent messages
    and dropping records and views: every record still held anywhere keeps its values."""
    for seed in range(6):
        rng = random.Random(seed)
        alive: list[tuple[torch.Tensor, dict]] = []      # (the values it must keep, a received record)
        senders: list[tuple[torch.Tensor, dict]] = []    # (the values it must keep, a held record)
        for step in range(150):
            op = rng.random()
            if op < 0.3 or not senders:
                r = _record(rng.randrange(1000), rng.choice([10, 500, 3000, 40_000]))
                senders.append((r["input_ids"].clone(), hold_all(r)))
            elif op < 0.6:
                want, r = rng.choice(senders)
                data, ref = pack({"r": r}, peer="peer")
                if rng.random() < 0.2:
                    discard(ref)
                else:
                    alive.append((want, unpack(data, ref)["r"]))
            elif op < 0.8:
                senders.pop(rng.randrange(len(senders)))
            elif alive:
                alive.pop(rng.randrange(len(alive)))
            for want, r in alive + senders:
                assert torch.equal(r["input_ids"], want), (seed, step)
        del alive, senders, want, r
        gc.collect()
        assert _all_free()


def test_a_region_with_every_slot_taken_sends_by_copy(arena):
    mine = hold_all(_record(2))
    kept = []
    for k in range(9):
        data, ref = pack({"r": mine}, peer="peer")
        kept.append(unpack(data, ref)["r"])
        assert _sent_by_place(ref) == (k < 7)              # 7 slots per region, then copies
        assert _same(kept[-1], _record(2))
    del kept
    data, ref = pack({"r": mine}, peer="peer")
    assert _sent_by_place(ref)                              # slots given back by the receivers' views


def test_a_message_never_sent_gives_its_slots_back(arena):
    mine = hold_all(_record(3))
    for _ in range(20):                                     # more than the 7 slots, if discard kept them
        data, ref = pack({"r": mine}, peer="peer")
        assert _sent_by_place(ref)
        discard(ref)


def test_a_held_tensor_changed_since_is_copied_with_its_new_values(arena):
    mine = hold_all(_record(4))
    ids = mine["input_ids"]
    ids.set_(torch.arange(7))                               # another storage: no longer in the arena
    px = mine["pixels"][1]
    px.resize_(2, 2)                                        # same place, another shape
    data, ref = pack({"r": mine}, peer="peer")
    assert _sent_by_place(ref)                              # (its other tensors still go by place)
    got = unpack(data, ref)["r"]
    assert torch.equal(got["input_ids"], torch.arange(7))
    assert got["pixels"][1].shape == (2, 2) and torch.equal(got["pixels"][1], px)
    assert torch.equal(got["pixels"][0], mine["pixels"][0]) and torch.equal(got["scores"], mine["scores"])


def test_a_region_allocated_over_old_bytes_starts_with_free_slots(arena):
    """Regions are carved out of bytes that held other messages' data: a held region there must start with
    every slot free, or it would never be reused (and would refuse places)."""
    data, ref = pack({"x": torch.full((20_000,), -1, dtype=torch.int64)}, peer="peer")   # all bits set
    del data
    discard(ref)
    small = {"ids": torch.arange(4)}
    first, second = hold_all(small), hold_all(small)     # the second starts inside the old message's bytes
    start = _place(second["ids"]).region
    assert ref[4] < start < ref[4] + 20_000 * 8
    assert shm.current().words[start // 8:start // 8 + 8].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    for _ in range(10):
        _, sent = pack({"r": second}, peer="peer")
        assert _sent_by_place(sent)
        discard(sent)
    del first, second
    assert _all_free()


def test_a_loader_holds_ahead_only_while_most_of_its_samples_leave_its_process(arena, monkeypatch):
    """A sample that stays in the loader's process would be held (copied) for nothing: the read-ahead thread
    holds while most of a step's samples go to constructors of other processes of this host."""
    from torchdata_overlord.runtime import loader_actor, rpc_agent

    class Peers:
        def where(self, name):
            return {"c0": "me", "c1": "near-host", "c2": "elsewhere"}[name]

    actor = loader_actor.LoaderActor.__new__(loader_actor.LoaderActor)      # just its placement policy
    actor.ahead, actor.peers = types.SimpleNamespace(finish=None), Peers()
    monkeypatch.setattr(rpc_agent, "self_name", lambda: "me")
    monkeypatch.setitem(shm._PEERS, "near-host", True)
    monkeypatch.setitem(shm._PEERS, "elsewhere", False)                      # another host: copied anyway
    for routes, holds in [({"c0": [1, 2, 3], "c1": [4]}, False), ({"c0": [1], "c1": [4, 5]}, True),
                          ({"c0": [1], "c2": [4, 5]}, False), ({"c1": [4], "c0": [1]}, False), ({"c1": [4]}, True)]:
        actor._hold_ahead(routes)
        assert (actor.ahead.finish is hold) == holds, routes
    monkeypatch.setitem(shm._PEERS, "near-host", False)                      # (a new group: nothing known yet)
    actor._hold_ahead({"c1": [4]})
    assert actor.ahead.finish is None


# ------------------------------------------------------------------------------------ across processes

class Keeper:
    """Holds records and sends them; keeps what it receives."""

    def __init__(self, peers=None):
        self.peers, self.mine, self.got = peers, {}, []

    def make(self, first: int, n: int) -> int:
        self.mine = {i: hold_all(_record(i)) for i in range(first, first + n)}
        return sum(_in_arena(r["input_ids"]) for r in self.mine.values())

    def send(self, to: str) -> None:
        self.peers.call(to, "put", self.mine, timeout=30).result(35)

    def drop(self) -> None:
        self.mine = {}
        gc.collect()

    def put(self, recs: dict) -> int:
        self.got.append(recs)
        return len(recs)

    def check(self) -> list[bool]:
        return [all(_same(r, _record(i)) for i, r in recs.items()) for recs in self.got]

    def stats(self) -> dict:
        return shm.stats()


@pytest.mark.slow
def test_rpc_held_records_cross_by_place_and_outlive_the_sender():
    from torchdata_overlord.runtime.rpc_transport import RpcTransport

    with RpcTransport(n_workers=2, startup_timeout=60, rpc_timeout=30, stop_timeout=10) as t:
        t.place({"a": 0, "b": 1})
        t.start_actor("b", Keeper, worker=1)
        t.start_actor("a", Keeper, t.peers(), worker=0)
        call = lambda who, m, *args: t.call(who, m, *args, timeout=30).result(40)   # noqa: E731

        def sent_by_place() -> bool:                        # once the peer said it maps this arena
            call("a", "send", "b")
            return call("a", "stats")["held_messages"] > 0
        assert call("a", "make", 0, 4) == 4
        deadline = time.monotonic() + 30
        while not sent_by_place():
            assert time.monotonic() < deadline, "no held record went by place within 30 s"
        for k in range(1, 6):                               # the sender drops, holds new records over and over
            call("a", "drop")
            call("a", "make", 10 * k, 4)
            call("a", "send", "b")
        assert all(call("b", "check"))                       # every received view kept its values
        assert call("b", "stats")["received"] >= 5
        killed = t.worker_pids[0]
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while process_running(killed):
            assert time.monotonic() < deadline, f"process {killed} did not exit"
            time.sleep(0.01)
        assert all(call("b", "check"))                       # and outlive the sender

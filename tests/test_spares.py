"""Where replacements start (runtime/spares.py): the least-loaded live spare, never an avoided one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdata_overlord.runtime.fault_policy import RoleLost
from torchdata_overlord.runtime.spares import Spares, serving, spare_order
from torchdata_overlord.runtime.transport import ActorDied

SPARES = [f"w{i}" for i in range(5)]


@settings(max_examples=200, deadline=None)
@given(placed=st.dictionaries(st.text("abcdef", min_size=1, max_size=3), st.sampled_from(SPARES + ["w9"])),
       dead=st.sets(st.sampled_from(SPARES)), avoid=st.sets(st.sampled_from(SPARES + [None])))
def test_spare_order_is_least_loaded_live_and_never_avoided(placed, dead, avoid):
    order = spare_order(SPARES, placed, dead, avoid)
    assert sorted(order) == sorted(w for w in SPARES if w not in dead and w not in avoid)
    ranked = [(list(placed.values()).count(w), SPARES.index(w)) for w in order]
    assert ranked == sorted(ranked)                 # least loaded first, ties in the spares' order

def test_serving_counts_only_roles_that_serve_now():
    roles = {"active": {"web": "shadow:web", "caps": "loader:caps"}, "shadow": {"web": "shadow:web#3", "caps": None},
             "constructors": ["constructor:0", "constructor:1#2"], "starting": {"shadow:caps#4": "w2"},
             "where": {"shadow:web#3": "w0", "constructor:1#2": "w1", "loader:web#1": "w1", "planner#1": "w3"},
             "home": "w3"}
    # loader:web#1 was replaced (not serving); the originals live on the role workers, not on spares
    assert serving(roles) == {"shadow:web#3": "w0", "constructor:1#2": "w1", "shadow:caps#4": "w2", "<planner>": "w3"}


def test_spares_spawn_skips_a_dead_spare_and_says_when_none_is_left():
    """Spares.spawn: a spare that cannot start the role is dead from then on; the replacement's
    placement is recorded; with no live spare left (or only avoided ones) the role is lost, by name."""
    class Peers:
        def __init__(self):
            self.started = []

        def spawn(self, name, factory, args, worker):
            if worker == "w0":
                raise ActorDied("w0 is gone")
            self.started.append((name, worker))

    roles = {"active": {}, "shadow": {}, "constructors": [], "where": {"x": "w1"}}
    peers = Peers()
    spares = Spares(peers, ["w0", "w1", "w2"], lambda: dict(roles, active={"a": "x"}))
    assert spares.spawn("loader:web#1", object, (), avoid=("w2",)) == "w1"     # w0 dead, w2 avoided
    assert spares.dead == {"w0"} and spares.where == {"loader:web#1": "w1"}
    assert peers.started == [("loader:web#1", "w1")]
    assert spares.order() == ["w2", "w1"]              # w1 hosts x: the idle w2 first
    with pytest.raises(RoleLost, match="constructor:0#2"):
        spares.spawn("constructor:0#2", object, (), avoid=("w1", "w2"))

"""Issue 13: fault tolerance with packed role processes. The rpc runtime's default placement puts
several actors in one process (on a 2-core machine every role in one); a killed process takes all of
them, and every one is recovered with the trainer's stream unchanged, bit for bit. Shadows are never
in their primary's process. Real processes, run by ``torchdata_overlord.sim.fault_run`` (see
test_fault_tolerance.py: ``run`` checks that nothing is left running)."""

from __future__ import annotations

import pytest

import torchdata_overlord as ol
from torchdata_overlord.roles.loader_parts import part_key
from torchdata_overlord.runtime.job_config import RoleConfig
from torchdata_overlord.runtime.refs import loader_actor, shadow_actor
from torchdata_overlord.scaling import Placement, SourcePlacement

from test_fault_tolerance import corpus, no_thread_left_behind, reference, run  # noqa: F401 - fixtures

ACTIVE = {"planner", "loader:web", "loader:caps", "constructor:0", "constructor:1"}


def killed_pid(rep) -> int:
    pids = [e["pid"] for e in rep["events"] if "killed" in e]
    assert len(pids) == 1, rep["events"]
    return pids[0]


def held_by(roles: dict, pid: int) -> set:
    return {r for r, p in roles.items() if p == pid}


def shadows_apart(roles: dict) -> None:
    """Every shadow in a process other than its primary's."""
    shadows = {r.split(":", 1)[1]: p for r, p in roles.items() if r.startswith("shadow:")}
    assert shadows, roles
    for key, pid in shadows.items():
        assert pid != roles[loader_actor(key)], (key, roles)


def explicit(web_processes: tuple, shadows: bool) -> dict:
    """Two role processes: the Planner and both constructors in process 0, the loaders (``web`` in
    ``len(web_processes)`` data-parallel parts) in process 1, the shadows in process 0."""
    placed = {"web": SourcePlacement("web", len(web_processes), 0, web_processes, -1, "test"),
              "caps": SourcePlacement("caps", 1, 0, (1,), -1, "test")}
    return Placement(placed, 2, 0, (0, 0), {"web": 0, "caps": 0} if shadows else {}, method="explicit").to_dict()


def recovery_times(rep) -> str:
    return ", ".join(f"{r['kind']} {r['role']} {r['seconds']:.2f} s ({r['how']})" for r in rep["recoveries"])


@pytest.mark.slow
@pytest.mark.parametrize("shadows", [False, True], ids=["no-shadows", "shadows"])
def test_killing_the_default_placements_one_role_process_recovers_every_actor_it_held(corpus, tmp_path, shadows):
    """The default placement (no n_workers) packs the Planner, both loaders and both constructors in
    one process here; SIGKILL it mid-run: the stream is the uninterrupted run's. Without shadows each
    role is replaced on a spare; with shadows (in a standby process of their own, never beside their
    primaries) the new Planner has them take over the loaders, restored from the store, and the other
    roles go to spares."""
    steps = 24
    rep = run(corpus, tmp_path, steps=steps, prefetch=2, spares=3, shadows=shadows, snapshot_every=3,
              faults=[{"step": 8, "kill": ["loader:web"]}])
    print("recoveries:", recovery_times(rep))
    assert rep["error"] is None, rep["error"]
    assert rep["digests"] == reference(corpus, 2, steps)
    assert rep["placement"]["method"] == "auto"
    before, pid = rep["roles_at"]["8"], killed_pid(rep)
    assert held_by(before, pid) == ACTIVE                       # the default put every active role there
    if shadows:
        assert rep["placement"]["processes"] == 2 and set(rep["placement"]["shadows"].values()) == {1}
        shadows_apart(before)
        shadows_apart(rep["roles"])
    after = rep["roles"]
    assert pid not in after.values()
    loaders = {"loader:web", "loader:caps"}
    on_spares = ACTIVE - loaders if shadows else ACTIVE
    assert {after[r] for r in on_spares} <= set(rep["spares"]), (after, rep["spares"])
    if shadows:                                                 # the standby process serves them now
        assert {after[r] for r in loaders} == {before["shadow:web"]} == {before["shadow:caps"]}, (before, after)
        assert all("its shadow took over" in r["how"] for r in rep["recoveries"] if r["kind"] == "loader")
    assert {r["kind"] for r in rep["recoveries"]} >= {"planner", "loader"}
    replaced = {r: v["recoveries"] for r, v in rep["role_recovery"].items()}
    assert all(replaced[r] >= 1 for r in ACTIVE), replaced


@pytest.mark.slow
@pytest.mark.parametrize("shadows", [False, True], ids=["no-shadows", "shadows"])
def test_a_killed_process_of_several_loaders_but_not_the_planner(corpus, tmp_path, shadows):
    """An explicit 2-process placement: process 1 holds both loaders, the Planner is in process 0.
    Killing process 1 replaces both loaders (restored on spares, or their shadows promoted) within
    the step; the Planner and the constructors are untouched."""
    steps = 24
    rep = run(corpus, tmp_path, steps=steps, prefetch=2, spares=2, shadows=shadows, snapshot_every=3,
              placement=explicit((1,), shadows), faults=[{"step": 8, "kill": ["loader:caps"]}])
    print("recoveries:", recovery_times(rep))
    assert rep["error"] is None, rep["error"]
    assert rep["digests"] == reference(corpus, 2, steps)
    before, pid = rep["roles_at"]["8"], killed_pid(rep)
    assert held_by(before, pid) == {"loader:web", "loader:caps"}
    assert sorted(r["role"] for r in rep["recoveries"]) == ["loader:caps", "loader:web"]
    how = "promoted its shadow" if shadows else "restored on a spare process"
    assert all(r["how"].startswith(how) for r in rep["recoveries"]), rep["recoveries"]
    after = rep["roles"]
    assert pid not in after.values()
    assert {after[r] for r in ("planner", "constructor:0", "constructor:1")} == {before["planner"]}
    if shadows:
        shadows_apart(before)
        shadows_apart(after)                    # the new shadows, on spares, not beside the promoted ones
    else:
        assert {after["loader:web"], after["loader:caps"]} <= set(rep["spares"])


@pytest.mark.slow
@pytest.mark.parametrize("shadows", [False, True], ids=["no-shadows", "shadows"])
def test_a_killed_process_of_a_data_parallel_source_recovers_both_parts(corpus, tmp_path, shadows):
    """``web`` in two data-parallel parts, both in process 1 (with ``caps``): killing it recovers both
    parts (each restored on a spare from the source's snapshot, or promoted from its own shadow) and
    the stream is the single-loader run's."""
    steps = 24
    rep = run(corpus, tmp_path, steps=steps, prefetch=2, spares=3, shadows=shadows, snapshot_every=3,
              placement=explicit((1, 1), shadows), faults=[{"step": 8, "kill": ["loader:web@0of2"]}])
    print("recoveries:", recovery_times(rep))
    assert rep["error"] is None, rep["error"]
    assert rep["digests"] == reference(corpus, 2, steps)
    parts = {"loader:web@0of2", "loader:web@1of2"}
    before, pid = rep["roles_at"]["8"], killed_pid(rep)
    assert held_by(before, pid) == parts | {"loader:caps"}
    assert sorted(r["role"] for r in rep["recoveries"]) == ["loader:caps", "loader:web@0of2", "loader:web@1of2"]
    after = rep["roles"]
    assert pid not in after.values() and parts <= set(after)
    if shadows:
        assert {"shadow:web@0of2", "shadow:web@1of2"} <= set(before)
        shadows_apart(before)
        shadows_apart(after)


def test_round_robin_never_puts_a_part_beside_its_own_shadow():
    """``RoleConfig.placement`` without a Placement (n_workers=, or actors=): every loader part's
    shadow is in another worker whenever there are two."""
    for n_workers in range(1, 10):
        cfg = RoleConfig(["web", "caps"], None, ol.ClientPlaceTree(dp=2), 8, None, shadows=True,
                         actors={"web": 2, "caps": 3})
        where = cfg.placement(n_workers)
        keys = [part_key("web", j, 2) for j in range(2)] + [part_key("caps", j, 3) for j in range(3)]
        assert set(keys) == set(cfg.parts.keys)
        for key in keys:
            assert (where[shadow_actor(key)] != where[loader_actor(key)]) or n_workers == 1, (n_workers, key, where)


def test_shadows_placed_beside_their_primaries_are_named():
    """Only a single role process (n_workers=1, or a one-process Placement) puts a shadow beside its
    primary; RpcJob warns then (the default placement gives the shadows a process of their own)."""
    mesh = ol.ClientPlaceTree(dp=2)
    cfg = RoleConfig(["web", "caps"], None, mesh, 8, None, shadows=True)
    assert cfg.shadows_beside_primaries(1) == ["web", "caps"]
    assert all(cfg.shadows_beside_primaries(n) == [] for n in range(2, 9))
    assert RoleConfig(["web", "caps"], None, mesh, 8, None).shadows_beside_primaries(1) == []
    one = Placement({n: SourcePlacement(n, 1, 0, (0,), -1, "test") for n in ("web", "caps")}, 1, 0, (0, 0),
                    {"web": 0, "caps": 0}, method="explicit")
    assert RoleConfig(["web", "caps"], None, mesh, 8, None, shadows=True, plan=one).shadows_beside_primaries(1) == \
        ["web", "caps"]
    assert RoleConfig(["web", "caps"], None, mesh, 8, None, shadows=True,
                      plan=Placement.from_dict(explicit((1, 1), True))).shadows_beside_primaries(2) == []


def test_a_placement_sets_the_constructor_count_and_a_mismatch_is_named():
    """A Placement places one process per Data Constructor: without ``constructors=`` the job has as many as it
    places; ``constructors=`` that disagrees is a ConfigError before any role starts (a KeyError on
    'constructor:1' in start_roles before)."""
    mesh = ol.ClientPlaceTree(dp=2)
    one = Placement({n: SourcePlacement(n, 1, 0, (0,), -1, "test") for n in ("web", "caps")}, 1, 0, (0,), {},
                    method="explicit")
    assert RoleConfig(["web", "caps"], None, mesh, 8, None, plan=one).constructors == 1
    with pytest.raises(ol.ConfigError, match=r"the placement places 1 Data Constructor\(s\) but the job has "
                                             r"constructors=2: .* or pass constructors=1"):
        RoleConfig(["web", "caps"], None, mesh, 8, None, constructors=2, plan=one)
    assert RoleConfig(["web", "caps"], None, mesh, 8, None, plan=Placement.from_dict(explicit((1, 1), False))
                      ).constructors == 2

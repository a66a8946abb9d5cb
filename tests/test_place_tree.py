"""ClientPlaceTree: ranks <-> coordinates, groups, buckets, group_size merging, attached modules."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torchdata_overlord as ol
from _support import AXES, brute_coords

sizes_st = st.fixed_dictionaries({a: st.integers(1, 3) for a in AXES})
orders_st = st.permutations(AXES).map(tuple)


@settings(max_examples=40, deadline=None)
@given(sizes=sizes_st, order=orders_st)
def test_coords_and_rank_round_trip_for_every_rank(sizes, order):
    mesh = ol.ClientPlaceTree(**sizes, order=order)
    expected = brute_coords(sizes, order)
    assert mesh.world_size == len(expected) == math.prod(sizes.values())
    for r, c in enumerate(expected):
        assert mesh.coords(r) == c
        assert mesh.rank(**c) == r
        assert mesh.rank(**{k.upper(): v for k, v in c.items()}) == r   # axis names are case-insensitive


@settings(max_examples=40, deadline=None)
@given(sizes=sizes_st, order=orders_st, axis=st.sampled_from(AXES + ("WORLD",)))
def test_group_matches_brute_force(sizes, order, axis):
    mesh = ol.ClientPlaceTree(**sizes, order=order)
    coords = brute_coords(sizes, order)
    for r, c in enumerate(coords):
        if axis == "WORLD":
            want = list(range(len(coords)))
        else:
            same = [q for q, d in enumerate(coords) if all(d[a] == c[a] for a in AXES if a != axis)]
            want = sorted(same, key=lambda q: coords[q][axis])
        got = mesh.group(r, axis)
        assert got == want
        assert r in got and len(got) == mesh.axis_size(axis)


def _brute_buckets(coords, keys):
    by = {}
    for r, c in enumerate(coords):
        by.setdefault(tuple(c[a] for a in keys), []).append(r)
    return [tuple(by[k]) for k in sorted(by)]


@settings(max_examples=40, deadline=None)
@given(sizes=sizes_st, order=orders_st, group_size=st.one_of(st.none(), st.integers(1, 5)))
def test_buckets_partition_ranks_and_match_brute_force(sizes, order, group_size):
    mesh = ol.ClientPlaceTree(**sizes, order=order)
    coords = brute_coords(sizes, order)
    # DP: ranks that share a dp index share samples; CP: (dp, cp) pairs; WORLD: one rank each
    expected = {"DP": _brute_buckets(coords, ("dp",)),
                "CP": _brute_buckets(coords, ("dp", "cp")),
                "WORLD": [(r,) for r in range(len(coords))],
                "TP": _brute_buckets(coords, ("tp",))}
    assert len(expected["DP"]) == sizes["dp"] and len(expected["CP"]) == sizes["dp"] * sizes["cp"]
    for axis, want in expected.items():
        if group_size is not None:
            want = [tuple(r for b in want[i:i + group_size] for r in b) for i in range(0, len(want), group_size)]
        got = mesh.buckets(axis, group_size=group_size) if group_size else mesh.buckets(axis)
        assert got == want, axis
        flat = sorted(r for b in got for r in b)
        assert flat == list(range(mesh.world_size)), f"{axis} buckets do not partition the ranks"


def test_buckets_ordered_by_dp_then_cp_with_inner_axes_inside():
    mesh = ol.ClientPlaceTree(pp=2, dp=2, cp=2, tp=2)
    # rank = ((pp * 2 + dp) * 2 + cp) * 2 + tp, written out by hand
    assert mesh.buckets("DP") == [(0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)]
    assert mesh.buckets("CP") == [(0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13), (6, 7, 14, 15)]
    assert mesh.buckets("CP", group_size=3) == [(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13), (6, 7, 14, 15)]
    assert mesh.group(13, "tp") == [12, 13]
    assert mesh.group(13, "pp") == [5, 13]
    assert mesh.coords(13) == {"pp": 1, "dp": 1, "cp": 0, "tp": 1}


def test_extra_axis_in_order():
    mesh = ol.ClientPlaceTree(dp=2, tp=2, ep=3, order=("dp", "ep", "tp"))
    assert mesh.world_size == 12
    assert mesh.coords(5) == {"dp": 0, "ep": 2, "tp": 1}
    assert mesh.group(5, "ep") == [1, 3, 5]
    assert mesh.buckets("EP") == [(0, 1, 6, 7), (2, 3, 8, 9), (4, 5, 10, 11)]


def test_attach_encoder_in_world_wide_dp():
    mesh = ol.ClientPlaceTree(pp=2, dp=2, cp=2, tp=2)
    enc = mesh.attach("encoder", dp=16)
    assert mesh.module("encoder") is enc and mesh.module("backbone") is mesh
    assert set(mesh.modules) == {"backbone", "encoder"}
    assert enc.world_size == mesh.world_size == 16
    assert enc.buckets("DP") == [(r,) for r in range(16)]
    assert enc.group(7, "dp") == list(range(16))
    assert mesh.to_dict()["modules"]["encoder"]["sizes"] == {"dp": 16}
    # the backbone's own view is unchanged
    assert len(mesh.buckets("DP")) == 2
    with pytest.raises(ol.ConfigError, match="already attached"):
        mesh.attach("encoder", dp=16)
    with pytest.raises(ol.ConfigError, match="no module 'vision'"):
        mesh.module("vision")


def test_attach_with_other_world_size_names_both_sizes():
    mesh = ol.ClientPlaceTree(dp=4, tp=2)
    with pytest.raises(ol.ConfigError) as err:
        mesh.attach("encoder", dp=4)
    msg = str(err.value)
    assert "'encoder'" in msg and "4 ranks" in msg and "8" in msg and "dp=4" in msg


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_axis_size_must_be_positive_int(bad):
    with pytest.raises(ol.ConfigError) as err:
        ol.ClientPlaceTree(dp=2, cp=bad)
    assert "'cp'" in str(err.value) and repr(bad) in str(err.value)


def test_world_size_mismatch_names_axes_and_sizes():
    with pytest.raises(ol.ConfigError) as err:
        ol.ClientPlaceTree(pp=2, dp=4, tp=2, world_size=32)
    msg = str(err.value)
    assert "world_size=32" in msg and "16 ranks" in msg and "dp=4" in msg and "pp=2" in msg
    assert ol.ClientPlaceTree(pp=2, dp=4, tp=2, world_size=16).world_size == 16


def test_unknown_axis_and_out_of_range_coordinates():
    mesh = ol.ClientPlaceTree(dp=2, tp=2)
    with pytest.raises(ol.ConfigError, match=r"unknown axis 'ep'.*\['pp', 'dp', 'cp', 'tp'\]"):
        mesh.group(0, "EP")
    with pytest.raises(ol.ConfigError, match="unknown axis 'xp'"):
        mesh.buckets("xp")
    with pytest.raises(ol.ConfigError, match=r"unknown axes \['ep'\]"):
        mesh.rank(ep=1)
    with pytest.raises(ol.ConfigError, match="dp=2 is outside 0..1"):
        mesh.rank(dp=2)
    for r in (-1, 4):
        with pytest.raises(ol.ConfigError, match=f"rank {r} is outside"):
            mesh.coords(r)
    with pytest.raises(ol.ConfigError, match="must be a string"):
        mesh.axis_size(3)
    with pytest.raises(ol.ConfigError, match="group_size must be an integer >= 1"):
        mesh.buckets("DP", group_size=0)


def test_order_errors():
    with pytest.raises(ol.ConfigError, match="names an axis twice"):
        ol.ClientPlaceTree(order=("dp", "DP"))
    with pytest.raises(ol.ConfigError, match=r"no size.*ep=2"):
        ol.ClientPlaceTree(order=("dp", "ep"))
    with pytest.raises(ol.ConfigError, match=r"missing from order"):
        ol.ClientPlaceTree(dp=2, tp=2, order=("dp",))


def test_equality_render_and_dict():
    a = ol.ClientPlaceTree(dp=2, cp=3)
    assert a == ol.ClientPlaceTree(dp=2, cp=3)
    assert a != ol.ClientPlaceTree(dp=3, cp=2)
    text = a.render()
    assert text.splitlines()[0] == "backbone (pp=1 x dp=2 x cp=3 x tp=1, 6 ranks)"
    # every leaf is named with its rank
    assert all(f"-> rank {r}" in text for r in range(6))
    wide = ol.ClientPlaceTree(dp=7).render(max_children=4)
    assert "... 3 more dp" in wide and "-> rank 4" not in wide

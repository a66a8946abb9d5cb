"""The DGraph primitives: chaining, oversize policies, modality views, broadcast, CP spans, render."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torchdata_overlord as ol
from _support import (AXES, assert_pieces_complete, assert_valid_permutation, brute_coords, dropped_keys,
                      entry_frame, graph, make_buffers, tokens_of)


# -- CP spans ------------------------------------------------------------------------------------
@st.composite
def span_case(draw):
    sizes = {a: draw(st.integers(1, 3)) for a in AXES}
    sizes["cp"] = draw(st.integers(2, 3))
    order = tuple(draw(st.permutations(AXES)))
    n = draw(st.integers(1, 80))
    seed = draw(st.integers(0, 2**16))
    toks = tokens_of(draw(st.sampled_from(["uniform", "pareto", "bimodal"])), n, seed)
    max_tokens = draw(st.integers(max(int(toks.max()) // (2 * sizes["cp"]), 2), max(int(toks.max()), 2)))
    return dict(mesh=ol.ClientPlaceTree(**sizes, order=order), toks=toks, max_tokens=max_tokens,
                method=draw(st.sampled_from(["greedy", "karmarkar_karp"])),
                microbatches=draw(st.integers(1, 3)), oversize=draw(st.sampled_from(["truncate", "split", "drop"])),
                intra=draw(st.booleans()), level=draw(st.sampled_from(["both", "lockstep"])))


@settings(max_examples=50, deadline=None)
@given(case=span_case())
def test_cp_spans_sit_in_consecutive_cp_ranks_of_one_dp_group(case):
    mesh, mt = case["mesh"], case["max_tokens"]
    cp = mesh.sizes["cp"]
    plan = (graph(mesh, {"long": case["toks"]}).distribute("CP").cost(ol.attention_flops)
            .balance(case["method"], microbatches=case["microbatches"], max_tokens=mt, oversize=case["oversize"],
                     intra=case["intra"], level=case["level"]).plan())
    assert_valid_permutation(plan, dropped_keys(plan))
    assert_pieces_complete(plan)
    assert (plan.bin_tokens() <= mt).all()
    spans: dict = {}
    for ent in entry_frame(plan):
        even = 2 * (mt // 2)          # a rank's zig-zag shard of a spanning sequence is 2 * ceil(n / 2k)
        need = -(-ent["tokens"] // even) if ent["tokens"] > mt else 1
        assert ent["nshards"] == need, "a piece spans exactly the ranks it needs"
        assert ent["nshards"] <= cp
        spans.setdefault((ent["key"], ent["piece"]), []).append(ent)
    long_pieces = 0
    for (key, piece), ents in spans.items():
        ents.sort(key=lambda x: x["shard"])
        assert [x["shard"] for x in ents] == list(range(ents[0]["nshards"]))
        assert len({x["mb"] for x in ents}) == 1, f"{key}: shards in different microbatches"
        coords = []
        for x in ents:
            ranks = plan.buckets[x["bucket"]]
            cs = [mesh.coords(r) for r in ranks]
            assert len({(c["dp"], c["cp"]) for c in cs}) == 1, "a CP bucket is one (dp, cp) pair"
            coords.append((cs[0]["dp"], cs[0]["cp"]))
        assert len({d for d, _ in coords}) == 1, f"{key}: shards in different DP groups {coords}"
        cps = [c for _, c in coords]
        assert cps == list(range(cps[0], cps[0] + len(cps))), f"{key}: CP ranks not consecutive {cps}"
        long_pieces += len(ents) > 1
    if plan.stats["oversize"]["dropped"] == 0 and (case["toks"] > mt).any():
        assert long_pieces > 0
    if long_pieces:
        assert plan.stats["level"] == "lockstep"     # spans are placed in pooled bins


def test_spans_need_level_both_with_a_method():
    mesh = ol.ClientPlaceTree(dp=2, cp=2)
    g = graph(mesh, {"a": [300, 50, 50, 50]}).distribute("CP")
    for kw in (dict(method="arrival"), dict(method="greedy", level="bucket"), dict(method="greedy", equal_counts=True)):
        with pytest.raises(ol.ConfigError, match="spanning several CP ranks"):
            g.balance(microbatches=1, max_tokens=200, **kw)
    # the same graph balances when the sequences fit one rank
    assert_valid_permutation(g.balance("arrival", max_tokens=300).plan())


# -- chaining ------------------------------------------------------------------------------------
def test_primitives_return_new_graphs_and_record_history():
    mesh = ol.ClientPlaceTree(dp=2, tp=2)
    g0 = graph(mesh, {"web": [10, 20, 30, 40], "code": [5, 500]}, global_batch=4)
    g1 = g0.mix({"web": 1, "code": 1})
    g2 = g1.distribute("DP")
    g3 = g2.cost(ol.attention_flops)
    g4 = g3.balance("greedy", microbatches=2)
    g5 = g4.broadcast_at("TP")
    # each step leaves its input untouched
    assert len(g0) == 6 and len(g1) == 4
    assert g1.layout is None and g2.layout is not None
    assert g2.costs is None and g3.costs is not None and g3.placement is None and g4.placement is not None
    assert g4.broadcast == () and g5.broadcast == ("tp",)
    assert [len(g.history) for g in (g0, g1, g2, g3, g4, g5)] == [1, 2, 3, 4, 5, 6]
    # render lists every primitive applied, in order
    text = g5.render()
    lines = text.splitlines()
    assert lines[0] == "buffers: web=4, code=2"
    kinds = ["mix[", "distribute('DP')", "cost(", "balance('greedy'", "broadcast_at('tp')"]
    for line, kind in zip(lines[1:], kinds):
        assert kind in line, (line, kind)
    assert "code=2, web=2" in lines[1]                  # the mix counts
    assert "2 buckets of 2 ranks" in lines[2]
    plan = g5.plan()
    assert plan.history == list(g5.history)


def test_cost_model_values_reach_the_plan():
    mesh = ol.ClientPlaceTree(dp=2)
    toks = [100, 2000, 30, 4096]
    plan = graph(mesh, {"a": toks}).distribute("DP").cost(ol.AttentionFlops(hidden=64, ffn_mult=2)).balance(
        "greedy").plan()
    h, f = 64.0, 2.0
    want = {1000 * 0 + i: 4 * h * t * t + 2 * t * (4 + 2 * f) * h * h for i, t in enumerate(toks)}
    for ent in entry_frame(plan):
        assert ent["cost"] == pytest.approx(want[ent["key"].index])
    # the default cost without cost(): token counts
    plain = graph(mesh, {"a": toks}).distribute("DP").balance("greedy").plan()
    assert sorted(e["cost"] for e in entry_frame(plain)) == sorted(float(t) for t in toks)


def test_select_keeps_rows_and_costs():
    mesh = ol.ClientPlaceTree(dp=2)
    g = graph(mesh, {"a": [1, 50, 3, 70]}).cost(lambda r: r.tokens * 2.0)
    s = g.select(lambda r: r.tokens > 10)
    assert s.records.keys() == [ol.SampleKey("a", 1), ol.SampleKey("a", 3)]
    assert s.costs.tolist() == [100.0, 140.0]
    with pytest.raises(ol.ConfigError, match=r"mask has shape \(2,\), expected \(4,\)"):
        g.select(np.array([True, False]))


def test_plan_without_balance_uses_arrival_order():
    mesh = ol.ClientPlaceTree(dp=2)
    plan = graph(mesh, {"a": [9, 8, 7, 6, 5]}).distribute("DP").plan()
    assert plan.stats["method"] == "arrival"
    assert [[it.index for it in mb] for mb in plan.bucket_microbatches(0)] == [[0, 1, 2]]
    assert [[it.index for it in mb] for mb in plan.bucket_microbatches(1)] == [[3, 4]]


# -- oversize policies -------------------------------------------------------------------------------
@st.composite
def oversize_case(draw):
    axis = draw(st.sampled_from(["DP", "CP"]))
    cp = draw(st.integers(1, 3))
    mesh = ol.ClientPlaceTree(dp=draw(st.integers(1, 3)), cp=cp)
    n = draw(st.integers(1, 60))
    toks = tokens_of(draw(st.sampled_from(["pareto", "bimodal", "uniform"])), n, draw(st.integers(0, 2**16)))
    max_tokens = draw(st.integers(max(int(toks.max()) // 8, 2), max(int(toks.max()), 2)))
    if axis == "DP":
        max_tokens = max(max_tokens, 2 * cp)       # a CP-split row's sequences take multiples of 2*cp
    return dict(mesh=mesh, axis=axis, toks=toks, max_tokens=max_tokens,
                method=draw(st.sampled_from(["greedy", "karmarkar_karp"])), microbatches=draw(st.integers(1, 3)))


def _balance(case, policy):
    half = len(case["toks"]) // 2
    g = graph(case["mesh"], {"src": case["toks"][:half], "other": case["toks"][half:]})
    return g.distribute(case["axis"]).cost(ol.attention_flops).balance(
        case["method"], microbatches=case["microbatches"], max_tokens=case["max_tokens"], oversize=policy).plan()


@settings(max_examples=40, deadline=None)
@given(case=oversize_case())
def test_oversize_policies(case):
    cp = case["mesh"].sizes["cp"] if case["axis"] == "CP" else 1
    # a CP rank holds a zig-zag shard of 2 * ceil(n / 2k) tokens: even budgets per rank, at most cp ranks
    limit = 2 * (case["max_tokens"] // 2) * cp if cp > 1 else case["max_tokens"]
    row_cp = case["mesh"].sizes["cp"] if case["axis"] == "DP" else 1
    if row_cp > 1:   # DP rows are split per sequence over CP ranks: pieces are whole multiples of 2*cp
        limit -= limit % (2 * row_cp)
    half = len(case["toks"]) // 2
    by_key = {ol.SampleKey("src", i): int(t) for i, t in enumerate(case["toks"][:half])}
    by_key.update({ol.SampleKey("other", 1000 + i): int(t) for i, t in enumerate(case["toks"][half:])})
    over = [k for k, t in by_key.items() if t > limit]

    if over:
        with pytest.raises(ol.OversizeSampleError) as err:
            _balance(case, "error")
        msg = str(err.value)
        m = re.search(r"sample (\w+):(\d+) has (\d+) tokens", msg)
        assert m, msg
        key = ol.SampleKey(m.group(1), int(m.group(2)))
        assert key in over and int(m.group(3)) == by_key[key]
        assert f"max_tokens={case['max_tokens']}" in msg and f"({len(over)} such samples" in msg
    else:
        assert_valid_permutation(_balance(case, "error"))

    drop = _balance(case, "drop")
    st_ = drop.stats["oversize"]
    assert st_["dropped"] == len(over) and sorted(st_["dropped_keys"]) == sorted(str(k) for k in over)
    assert_valid_permutation(drop, over)
    assert not set(drop.planned_keys()) & set(over)

    trunc = _balance(case, "truncate")
    assert trunc.stats["oversize"]["truncated"] == len(over) and trunc.stats["oversize"]["limit"] == limit
    assert_valid_permutation(trunc)
    for ent in entry_frame(trunc):
        want = min(by_key[ent["key"]], limit)
        assert ent["tokens"] == want and ent["npieces"] == 1

    split = _balance(case, "split")
    assert split.stats["oversize"]["split"] == len(over)
    assert_valid_permutation(split)
    assert_pieces_complete(split)
    piece_tokens: dict = {}
    for ent in entry_frame(split):
        piece_tokens.setdefault(ent["key"], {})[ent["piece"]] = ent["tokens"]
        assert ent["tokens"] <= limit
    for key, pieces in piece_tokens.items():
        assert sum(pieces.values()) == by_key[key]
        assert len(pieces) == max(-(-by_key[key] // limit), 1)
        # every piece but the last is full
        assert all(t == limit for p, t in pieces.items() if p < len(pieces) - 1)

    for plan in (drop, trunc, split):
        assert (plan.bin_tokens() <= case["max_tokens"]).all()


def test_oversize_error_message_by_hand():
    g = graph(ol.ClientPlaceTree(dp=2), {"web": [10, 20, 5000, 30]}).distribute("DP")
    with pytest.raises(ol.OversizeSampleError, match=r"step 0: sample web:2 has 5000 tokens, over max_tokens=4096"):
        g.balance("greedy", max_tokens=4096)


@settings(max_examples=40, deadline=None)
@given(toks=st.lists(st.integers(0, 40), min_size=1, max_size=40), cp=st.integers(2, 3), extra=st.integers(0, 30),
       method=st.sampled_from(["greedy", "karmarkar_karp"]), dp=st.integers(1, 2))
def test_dp_rows_split_over_cp_count_each_sequence_at_its_padded_length(toks, cp, extra, method, dp):
    """distribute("DP") on a cp > 1 mesh: the Data Constructor pads every sequence to a multiple of
    2*cp before the per-sequence CP split, so max_tokens and the costs must count that layout, or a
    planned microbatch overflows seq_len = max_tokens (issue 11 item 12)."""
    m = 2 * cp
    max_tokens = m * max(-(-max(toks) // m), 1) + extra   # every sample fits alone
    plan = (graph(ol.ClientPlaceTree(dp=dp, cp=cp), {"a": toks}).distribute("DP").cost(ol.token_count)
            .balance(method, microbatches=2, max_tokens=max_tokens).plan())
    assert_valid_permutation(plan)
    bins = Counter()
    for ent in entry_frame(plan):
        laid = -(-ent["tokens"] // m) * m                   # by hand: the sequence's padded length
        assert ent["tokens"] == toks[ent["key"].index] and ent["cost"] == laid
        bins[ent["bucket"], ent["mb"]] += laid
    assert max(bins.values()) <= max_tokens
    assert plan.bin_tokens().max() == max(bins.values())


def test_dp_rows_split_over_cp_need_max_tokens_of_at_least_2cp():
    g = graph(ol.ClientPlaceTree(dp=2, cp=2), {"a": [1, 2, 3]}).distribute("DP")
    with pytest.raises(ol.ConfigError, match=r"max_tokens=3 cannot hold a sequence split over cp=2 .* 2\*cp=4"):
        g.balance("greedy", max_tokens=3)
    with pytest.raises(ol.OversizeSampleError, match=r"over max_tokens=6 \(rounded down to 4"):
        graph(ol.ClientPlaceTree(dp=2, cp=2), {"a": [1, 5]}).distribute("DP").balance("greedy", max_tokens=6)


def test_truncate_recosts_the_truncated_sample():
    mesh = ol.ClientPlaceTree(dp=1)
    plan = (graph(mesh, {"a": [100, 900]}).distribute("DP").cost(ol.AttentionFlops(hidden=8, ffn_mult=1))
            .balance("greedy", max_tokens=500, oversize="truncate").plan())
    costs = {e["key"].index: e["cost"] for e in entry_frame(plan)}
    assert costs[1] == pytest.approx(4 * 8 * 500 ** 2 + 2 * 500 * 6 * 64)


# -- modality views and a second module ----------------------------------------------------------
def _vlm_buffers():
    # caps: 6 samples with 0-2 images (patch counts per image); web: text only
    images = {"caps": [[16, 0], [0, 0], [9, 25], [4, 0], [0, 0], [36, 36]]}
    tokens = {"caps": [12, 30, 0, 7, 0, 5], "web": [100, 200, 300]}
    return tokens, images


def test_views_select_by_modality():
    mesh = ol.ClientPlaceTree(dp=2)
    tokens, images = _vlm_buffers()
    g = graph(mesh, tokens, images_by_source=images)
    text = g.view("text")
    img = g.view("image")
    # by hand: text = tokens > 0; image = at least one image
    assert text.records.keys() == [ol.SampleKey("caps", i) for i in (0, 1, 3, 5)] + \
        [ol.SampleKey("web", 1000 + i) for i in range(3)]
    assert img.records.keys() == [ol.SampleKey("caps", i) for i in (0, 2, 3, 5)]
    assert len(g.view("all")) == len(g) == 9
    assert text.modality == "text" and img.costs is None and img.layout is None
    with pytest.raises(ol.ConfigError, match="unknown modality 'video'"):
        g.view("video")


def test_encoder_module_rides_along_with_its_own_layout():
    mesh = ol.ClientPlaceTree(pp=1, dp=2, tp=2)
    mesh.attach("encoder", dp=4)
    tokens, images = _vlm_buffers()

    def strategy(g):
        m = g.mix({"caps": 2, "web": 1})
        text = m.view("text").distribute("DP").cost(ol.attention_flops).balance("greedy", microbatches=2)
        enc = m.view("image").distribute("WORLD", module="encoder").cost(ol.encoder_cost).balance("karmarkar_karp")
        return text.broadcast_at("TP").plan(encoder=enc)

    planner = ol.Planner(strategy, mesh, global_batch=9)
    plan = planner.plan(make_buffers(tokens, images))
    enc = plan.module("encoder")
    assert plan.module("backbone") is plan and plan.module(None) is plan
    assert len(enc.buckets) == 4 and enc.mesh.name == "encoder"
    assert set(enc.planned_keys()) == {ol.SampleKey("caps", i) for i in (0, 2, 3, 5)}
    assert set(plan.planned_keys()) == {ol.SampleKey("caps", i) for i in (0, 1, 3, 5)} | \
        {ol.SampleKey("web", 1000 + i) for i in range(3)}
    # encoder cost written out: 4 h sum p^2 + 2 sum p (4 + 2 f) h^2, h = 1024, f = 4
    patches = {0: [16], 2: [9, 25], 3: [4], 5: [36, 36]}
    for ent in entry_frame(enc):
        p = patches[ent["key"].index]
        assert ent["cost"] == pytest.approx(4 * 1024 * sum(x * x for x in p) + 2 * sum(p) * 12 * 1024 ** 2)
    assert "module encoder:" in plan.render()
    assert plan.to_dict()["modules"]["encoder"]["module"] == "encoder"
    with pytest.raises(ol.ConfigError, match="plan has no module 'audio'"):
        plan.module("audio")


# -- broadcast and delivery -----------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(sizes=st.fixed_dictionaries({a: st.integers(1, 3) for a in AXES}), axis=st.sampled_from(["DP", "CP"]),
       bcast=st.lists(st.sampled_from(["tp", "pp"]), unique=True))
def test_delivery_per_rank_matches_brute_force(sizes, axis, bcast):
    mesh = ol.ClientPlaceTree(**sizes)
    g = graph(mesh, {"a": np.arange(1, 40)}).distribute(axis).balance("greedy", microbatches=2)
    for d in bcast:
        g = g.broadcast_at(d.upper())
    plan = g.plan()
    coords = brute_coords(sizes, AXES)
    for r, c in enumerate(coords):
        want = "none" if any(c[d] > 0 for d in bcast) else ("metadata" if c["pp"] > 0 else "data")
        assert plan.delivery(r) == want
        mbs = plan.microbatches(r)
        if want == "none":
            assert mbs == []
            continue
        # the rank gets its own bucket's lists: same dp (and cp for CP) coordinates
        key = (c["dp"],) if axis == "DP" else (c["dp"], c["cp"])
        b = plan.bucket_of(r)
        ranks = plan.buckets[b]
        assert all((coords[q]["dp"],) + ((coords[q]["cp"],) if axis == "CP" else ()) == key for q in ranks)
        assert mbs == plan.bucket_microbatches(b)
    assert sorted(plan.clients("data") + plan.clients("metadata") + plan.clients("none")) == list(range(len(coords)))


def test_broadcast_errors():
    mesh = ol.ClientPlaceTree(dp=2, cp=2, tp=2)
    g = graph(mesh, {"a": [1, 2, 3]})
    with pytest.raises(ol.ConfigError, match=r"broadcast_at\('xp'\): unknown axis"):
        g.broadcast_at("XP")
    with pytest.raises(ol.ConfigError, match=r"would starve buckets: 'dp' splits the data"):
        g.distribute("DP").broadcast_at("DP")
    with pytest.raises(ol.ConfigError, match=r"'cp' splits the data when distributing along 'cp'"):
        g.distribute("CP").broadcast_at("CP")
    # under distribute("DP") each CP rank receives its own shard of every row: a broadcast from CP rank 0 would
    # hand the others rank 0's shard (half of every sequence never trained on), declared before or after distribute
    with pytest.raises(ol.ConfigError, match=r"broadcast_at\('cp'\) with distribute\('dp'\) on a mesh with cp=2"):
        g.distribute("DP").broadcast_at("CP")
    with pytest.raises(ol.ConfigError, match=r"broadcast_at\('cp'\) with distribute\('dp'\)"):
        g.broadcast_at("CP").distribute("DP").balance("greedy", microbatches=1).plan()
    # a CP axis of size 1 splits nothing: broadcasting along it is harmless
    one = graph(ol.ClientPlaceTree(dp=2, cp=1, tp=2), {"a": [1, 2, 3]})
    assert one.distribute("DP").broadcast_at("CP").broadcast == ("cp",)
    plan = g.distribute("DP").broadcast_at("TP").balance("greedy", microbatches=1).plan()
    assert plan.broadcast == ("tp",)


# -- render ------------------------------------------------------------------------------------------
def _render_plan(n_buckets=3, sources=("web", "code", "long")):
    mesh = ol.ClientPlaceTree(pp=2, dp=n_buckets, tp=2)
    rng = np.random.default_rng(5)
    toks = {s: rng.integers(1, 3000, 20) for s in sources}
    return (graph(mesh, toks).distribute("DP").cost(ol.attention_flops).balance("greedy", microbatches=2)
            .broadcast_at("TP").plan())


def test_render_text_mentions_sources_buckets_and_microbatches():
    plan = _render_plan()
    text = plan.render()
    first = text.splitlines()[0]
    assert "60 samples from 3 sources -> 3 buckets along DP x 2 microbatches -> 12 clients" in first
    for s in ("web", "code", "long"):
        assert re.search(rf"\b{s} 20 \(\d+ tok\)", text), s
    for b in range(3):
        assert f"bucket {b} [" in text
    assert text.count("    mb0:") == 3 and text.count("    mb1:") == 3
    # the item counts per microbatch add up to the batch
    assert sum(int(x) for x in re.findall(r"mb\d: (\d+) items", text)) == 60
    assert "metadata: " in text and "none: " in text


def test_render_elides_buckets_past_max():
    plan = _render_plan(n_buckets=5)
    text = plan.render(max_buckets=2)
    assert "bucket 1 [" in text and "bucket 2 [" not in text and "... 3 more buckets" in text
    dot = plan.render("dot", max_buckets=2)
    assert "b1 -> b1m0" in dot and "b2 ->" not in dot and "-> b2 " not in dot


def test_render_dot_is_a_digraph_with_edges_per_bucket():
    plan = _render_plan()
    dot = plan.render("dot")
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    for b in range(3):
        # an edge from some source into the bucket, and from the bucket to each microbatch
        assert re.search(rf"src\d -> b{b} \[", dot), b
        assert f"b{b} -> b{b}m0;" in dot and f"b{b} -> b{b}m1;" in dot
        for r in plan.buckets[b]:
            assert re.search(rf"b{b}m0 -> r{r} \[style=(solid|dashed|dotted)\]", dot)
    for i, s in enumerate(("web", "code", "long")):
        assert f'src{i} [label="{s}"' in dot
    # edge labels from sources add up to the batch
    assert sum(int(x) for x in re.findall(r'src\d -> b\d \[label="(\d+)"\]', dot)) == 60
    with pytest.raises(ValueError, match="'text' or 'dot'"):
        plan.render("svg")


def test_plan_accessors():
    plan = _render_plan()
    e = plan.entries
    # entries are sorted by (bucket, microbatch)
    keys = list(zip(e["bucket"].tolist(), e["mb"].tolist()))
    assert keys == sorted(keys)
    assert Counter(it.key for b in range(3) for mb in plan.bucket_microbatches(b) for it in mb) == plan.planned_keys()
    d = plan.to_dict()
    assert d["n_microbatches"] == 2 and d["buckets"] == [list(b) for b in plan.buckets] and d["broadcast"] == ["tp"]
    assert len(d["entries"][0]) == 60 and all(isinstance(k, str) for k in d["entries"][0])
    assert "buckets=3 along dp" in repr(plan)

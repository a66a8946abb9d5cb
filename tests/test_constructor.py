"""Data Constructor: every planned token reaches exactly the right clients, in the right shape.

Plans are made by the real Planner from metadata of real records (a sentencepiece model trained on
generated text, images encoded by pillow and decoded by ``ImageText``). Each bucket's microbatches
are rebuilt from its data clients (zig-zag merge across CP ranks, unpack by ``cu_seqlens``) and
compared with sequences computed here from the records: placeholders then caption ids, pieces as
slices of it, CP shards as hand-computed chunk pairs.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest
import torch

import torchdata_overlord as ol
from torchdata_overlord.roles.constructor import DataConstructor, MissingSampleError, sequence_length, sequence_of
from torchdata_overlord.testing import make_image_bytes, make_text_corpus, train_sentencepiece
from torchdata_overlord.transforms import ImageText, Tokenize, zigzag_merge

IMG = 1000          # image placeholder id, outside the 256-piece vocabulary
PATCH = 8
IGNORE = -100
PAD = 0
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")
ROW_FIELDS = ("input_ids", "labels", "loss_mask", "position_ids", "segment_ids")


# -- data --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("constructor")
    model = train_sentencepiece(make_text_corpus(400, seed=11), d / "sp", vocab_size=256)
    tok, it = Tokenize(model), ImageText(model, patch=PATCH, max_side=96)
    samples = {}
    texts = make_text_corpus(36, seed=3) + [" ".join(make_text_corpus(10, seed=100 + i)) for i in range(4)]
    for i, t in enumerate(texts):
        samples[ol.SampleKey("web", i)] = tok({"text": t})
    rng = random.Random(5)
    caps = make_text_corpus(14, seed=7, min_words=2, max_words=12)
    for i, c in enumerate(caps):
        w, h = rng.randint(10, 110), rng.randint(10, 110)
        samples[ol.SampleKey("caps", i)] = it({"image": make_image_bytes(w, h, "PNG", seed=i), "text": c})
    assert all(int(r["input_ids"].max()) < IMG for r in samples.values())
    by_source = defaultdict(list)
    for k, r in samples.items():
        by_source[k.source].append({"index": k.index, "tokens": sequence_length(r, IMG),
                                    "image_patches": r.get("image_patches", [])})
    buffers = [ol.BufferMeta.from_samples(s, rows) for s, rows in by_source.items()]
    return {"samples": samples, "buffers": buffers, "longest": max(sequence_length(r, IMG) for r in samples.values())}


def targets(following: torch.Tensor) -> torch.Tensor:
    """The labels of tokens whose next tokens are ``following``: those tokens, but IGNORE where one is an
    image placeholder (never a target)."""
    return torch.where(following == IMG, torch.full_like(following, IGNORE), following)


def full_sequence(rec) -> torch.Tensor:
    """Placeholders then caption ids, written out here (independent of sequence_of)."""
    ids = rec["input_ids"].tolist()
    return torch.tensor([IMG] * (rec["patches"] if "pixels" in rec else 0) + ids, dtype=torch.int64)


def piece_bounds(plan, item, n) -> tuple[int, int]:
    a = item.piece * plan.stats["oversize"]["limit"] if item.npieces > 1 else 0
    assert a + item.tokens <= n
    return a, a + item.tokens


# -- plans -------------------------------------------------------------------------------------

MESHES = [dict(pp=1, dp=2, cp=1, tp=1), dict(pp=2, dp=2, cp=1, tp=2), dict(pp=1, dp=2, cp=2, tp=1),
          dict(pp=2, dp=1, cp=2, tp=2), dict(pp=3, dp=1, cp=2, tp=1)]
CP_MESHES = [m for m in MESHES if m["cp"] > 1] + [dict(pp=1, dp=2, cp=2, tp=2)]


def make_plan(data, mesh, strategy):
    return ol.Planner(strategy, mesh, global_batch=len(data["samples"])).plan(data["buffers"])


def dp_strategy(max_tokens=None, oversize="error", microbatches=2, method="karmarkar_karp"):
    def strategy(g):
        return (g.distribute("DP").cost(ol.attention_flops)
                .balance(method, microbatches=microbatches, max_tokens=max_tokens, oversize=oversize)
                .broadcast_at("TP"))
    return strategy


def cp_strategy(max_tokens):
    def strategy(g):
        return (g.distribute("CP").cost(ol.attention_flops)
                .balance("karmarkar_karp", microbatches=2, max_tokens=max_tokens, level="lockstep", oversize="split")
                .broadcast_at("TP"))
    return strategy


def build_all(plan, cons, samples):
    return {b: cons.build(plan, b, samples) for b in range(len(plan.buckets))}


# -- checks ------------------------------------------------------------------------------------

def bucket_rows(plan, outs, b):
    """The bucket's microbatches as seen by its data clients, zig-zag merged across CP ranks when
    the constructor split them; every replica (other tp/pp coordinates) must agree."""
    mesh, per_group = plan.mesh, defaultdict(dict)
    for r in plan.buckets[b]:
        if plan.delivery(r) != "data":
            continue
        c = mesh.coords(r)
        per_group[tuple((a, v) for a, v in c.items() if a != "cp")][c.get("cp", 0)] = client_list(outs[b][r])
    split = plan.axis == "dp" and mesh.sizes.get("cp", 1) > 1
    merged = []
    for group in per_group.values():
        clients = [group[i] for i in sorted(group)]
        rows = []
        for m in range(plan.n_microbatches):
            mbs = [cl[m] for cl in clients]
            row = dict(mbs[0])
            if split:
                assert sorted(group) == list(range(mesh.sizes["cp"]))
                row.update(cp_merge(mbs))
            rows.append(row)
        merged.append(rows)
    assert merged, f"bucket {b} has no data client"
    for other in merged[1:]:
        for x, y in zip(merged[0], other):
            for f in ROW_FIELDS:
                assert torch.equal(x[f], y[f])
    return merged[0]


def cp_positions(cu_padded, cp, rank):
    """Row positions CP rank holds: chunks rank and 2*cp-1-rank of every entry (THD with CP), by hand."""
    out = []
    for a, b in zip(cu_padded, cu_padded[1:]):
        assert (b - a) % (2 * cp) == 0, "every sequence is padded to a multiple of 2*cp"
        c = (b - a) // (2 * cp)
        out += list(range(a + rank * c, a + (rank + 1) * c)) + list(range(a + (2 * cp - 1 - rank) * c,
                                                                          a + (2 * cp - rank) * c))
    return out


def cp_merge(mbs):
    """The row the CP ranks' shards came from, put back together position by position; checks that
    each rank holds its chunks of every sequence and an equal share of each sequence's real tokens."""
    k = len(mbs)
    cu_p, cu = mbs[0]["cu_seqlens_padded"].tolist(), mbs[0]["cu_seqlens"].tolist()
    n = cu_p[-1]
    row = {}
    for i, mb in enumerate(mbs):
        assert int(mb["cp_rank"]) == i and int(mb["cp_size"]) == k
        assert mb["token_index"].tolist() == cp_positions(cu_p, k, i)
    for f in ROW_FIELDS:
        vals = [None] * n
        for mb in mbs:
            for at, v in zip(mb["token_index"].tolist(), mb[f].tolist()):
                vals[at] = v
        assert None not in vals
        row[f] = torch.tensor(vals, dtype=mbs[0][f].dtype)
    for j, (a, b) in enumerate(zip(cu, cu[1:])):
        real = [int((mb["segment_ids"] == j).sum()) for mb in mbs]
        assert sum(real) == b - a and max(real) - min(real) <= 2 * k - 1, (j, real)
    return row


def check_row_invariants(row, seq_len, mult):
    ids, lab, lm, pos, seg, cu, cu_p = (row[f] for f in (*ROW_FIELDS, "cu_seqlens", "cu_seqlens_padded"))
    n = ids.numel()
    assert all(t.numel() == n for t in (lab, lm, pos, seg))
    if seq_len is not None:
        assert n == seq_len
    assert n % mult == 0 and n >= 1
    cu, cu_p = cu.tolist(), cu_p.tolist()
    real = [b - a for a, b in zip(cu, cu[1:])]
    assert cu[0] == cu_p[0] == 0 and cu_p[-1] == n and len(cu) == len(cu_p)
    assert int(row["max_seqlen"]) == max(real)               # padding is never attended
    spans = {s["segment"] for s in row["spans"]}
    n_seq = len(row["sample_keys"])
    for j, ((a, b), r) in enumerate(zip(zip(cu_p, cu_p[1:]), real)):
        assert 0 <= r <= b - a and (b - a) % mult == 0
        if j < n_seq and j not in spans:
            assert b - a == -(-r // mult) * mult             # a sequence is padded to the next multiple only
        # positions restart at every entry; padding after the real tokens never trains
        if j not in spans:
            assert pos[a:b].tolist() == list(range(b - a))
        assert (seg[a + r:b] == -1).all() and not lm[a + r:b].any() and (lab[a + r:b] == IGNORE).all()
        assert (ids[a + r:b] == PAD).all()
        if j in spans:
            continue
        if not r:
            continue
        # labels never cross sequences; an image placeholder is never a target
        assert seg[a:a + r].tolist() == [j] * r
        want = targets(ids[a + 1:a + r])
        assert torch.equal(lm[a:a + r - 1], want != IGNORE) and not lm[a + r - 1]
        assert torch.equal(lab[a:a + r - 1], want) and lab[a + r - 1] == IGNORE
    assert torch.equal(lab[~lm], torch.full_like(lab[~lm], IGNORE))


def check_plan(plan, outs, samples, seq_len=None):
    """Every planned sample's tokens in exactly the right rows; images at their placeholder runs."""
    cp = plan.mesh.sizes.get("cp", 1)
    mult = 2 * cp if plan.axis == "dp" and cp > 1 else 1
    pieces = defaultdict(dict)                     # key -> piece -> tokens
    shards = defaultdict(dict)                     # (key, piece) -> shard -> (segment fields, span)
    seen = Counter()
    for b in range(len(plan.buckets)):
        assert set(outs[b]) == set(plan.buckets[b])
        check_clients(plan, outs, b)
        rows = bucket_rows(plan, outs, b)
        for m, (items, row) in enumerate(zip(plan.bucket_microbatches(b), rows)):
            check_row_invariants(row, seq_len, mult)
            assert row["sample_keys"] == [str(it.key) for it in items]
            cu, cu_real = row["cu_seqlens_padded"].tolist(), row["cu_seqlens"].tolist()
            assert len(cu) - 1 in (len(items), len(items) + 1)     # sequences (+ trailing padding)
            spans = {s["segment"]: s for s in row["spans"]}
            want_images = []
            for j, it in enumerate(items):
                rec = samples[it.key]
                full = full_sequence(rec)
                a, z = piece_bounds(plan, it, full.numel())
                got = {f: row[f][cu[j]:cu[j + 1]] for f in ROW_FIELDS}
                seen[(it.key, it.piece, it.shard)] += 1
                if it.nshards == 1:
                    got = {f: v[:cu_real[j + 1] - cu_real[j]] for f, v in got.items()}   # the real tokens
                    assert j not in spans
                    assert torch.equal(got["input_ids"], full[a:z])
                    pieces[it.key][it.piece] = got["input_ids"]
                    if "pixels" in rec and min(z, rec["patches"]) > a:
                        lo, hi = a, min(z, rec["patches"])
                        want_images.append((str(it.key), cu[j] + lo - a, hi - lo, lo))
                else:
                    sp = spans[j]
                    assert (sp["key"], sp["shard"], sp["nshards"], sp["tokens"]) == (str(it.key), it.shard,
                                                                                      it.nshards, z - a)
                    assert (sp["offset"], sp["length"]) == (cu[j], cu[j + 1] - cu[j])
                    assert torch.equal(got["position_ids"], sp["token_index"])
                    shards[(it.key, it.piece)][it.shard] = (got, sp, it.nshards, full[a:z])
                    if "pixels" in rec and min(z, rec["patches"]) > a:
                        lo, hi = a, min(z, rec["patches"])
                        if any(lo - a <= p < hi - a for p in sp["token_index"].tolist()):
                            want_images.append((str(it.key), lo - a, hi - lo, lo))
            check_images(plan, row, want_images, samples, spans)
    # every planned (sample, piece, shard) exactly once
    want = Counter((ol.SampleKey(*k), p, s) for k, p, s in
                   zip([(plan.records.sources[plan.records.source_id[r]], int(plan.records.index[r]))
                        for r in plan.entries["row"]], plan.entries["piece"].tolist(), plan.entries["shard"].tolist()))
    assert seen == want
    # CP spans: the shards merge back to the (padded) piece, with labels of the whole sequence
    for (key, p), by_shard in shards.items():
        k = next(iter(by_shard.values()))[2]
        assert sorted(by_shard) == list(range(k))
        piece = next(iter(by_shard.values()))[3]
        merged = {f: zigzag_merge([by_shard[s][0][f] for s in range(k)]) for f in ROW_FIELDS}
        T, n = piece.numel(), merged["input_ids"].numel()
        assert n % (2 * k) == 0 and n - T < 2 * k
        assert torch.equal(merged["input_ids"][:T], piece) and (merged["input_ids"][T:] == PAD).all()
        assert merged["position_ids"].tolist() == list(range(n))
        assert torch.equal(merged["labels"][:T - 1], targets(piece[1:])) and (merged["labels"][T - 1:] == IGNORE).all()
        assert torch.equal(merged["loss_mask"][:T - 1], targets(piece[1:]) != IGNORE)
        assert not merged["loss_mask"][T - 1:].any()
        pieces[key][p] = piece
    # split pieces concatenate back to the full sequence; truncated samples are prefixes
    for key, ps in pieces.items():
        full = full_sequence(samples[key])
        cat = torch.cat([ps[i] for i in sorted(ps)])
        assert sorted(ps) == list(range(len(ps)))
        if len(ps) > 1:
            assert torch.equal(cat, full)
        else:
            assert torch.equal(cat, full[:cat.numel()])
    return pieces


def check_images(plan, row, want, samples, spans):
    if not want:
        assert "image_keys" not in row
        return
    keys = [w[0] for w in want]
    assert row["image_keys"] == keys
    pos = row["image_positions"].tolist()
    assert [tuple(p) for p in pos] == [(w[1], w[2]) for w in want]
    assert row["image_patch_offsets"].tolist() == [w[3] for w in want]
    for (key, start, length, _), seg in zip(want, row["image_segments"].tolist()):
        rec = samples[ol.SampleKey(*key.rsplit(":", 1)[:1], int(key.rsplit(":", 1)[1]))]
        if seg in spans:     # a CP span: positions in its sequence's coordinates
            continue
        ids = row["input_ids"]
        assert (ids[start:start + length] == IMG).all()
        if start + length < ids.numel():
            assert ids[start + length] != IMG or length < rec["patches"]
    assert row["image_grid"].dtype == torch.int64 and row["image_grid"].shape == (len(want), 2)
    for k, g in zip(keys, row["image_grid"].tolist()):
        rec = samples[ol.SampleKey(k.rsplit(":", 1)[0], int(k.rsplit(":", 1)[1]))]
        assert tuple(g) == tuple(rec["grid"]) and g[0] * g[1] == rec["patches"]
    if "pixels" in row:
        for k, px in zip(keys, row["pixels"]):
            rec = samples[ol.SampleKey(k.rsplit(":", 1)[0], int(k.rsplit(":", 1)[1]))]
            assert px.dtype == torch.uint8 and torch.equal(px, rec["pixels"])
            assert tuple(px.shape) == (3, rec["grid"][0] * PATCH, rec["grid"][1] * PATCH)


def client_list(out):
    assert set(out) == {"delivery", "microbatches", "encoder"}      # one shape for every delivery
    return out["microbatches"]


def check_clients(plan, outs, b):
    """tp > 0 after broadcast_at('TP') get nothing; pp > 0 get metadata; labels on the last stage only."""
    mesh = plan.mesh
    pp = mesh.sizes.get("pp", 1)
    for r in plan.buckets[b]:
        c, got = mesh.coords(r), client_list(outs[b][r])
        if c.get("tp", 0) > 0:
            assert got is None
            continue
        assert isinstance(got, list) and len(got) == plan.n_microbatches
        if c.get("pp", 0) == 0:
            assert all("input_ids" in mb for mb in got)
            continue
        ref = client_list(outs[b][mesh.rank(**{**c, "pp": 0})])
        for mb, base in zip(got, ref):
            assert "input_ids" not in mb and "pixels" not in mb
            assert ("labels" in mb) == ("loss_mask" in mb) == (c["pp"] == pp - 1)
            for f in ("position_ids", "segment_ids", "cu_seqlens", "max_seqlen", "labels", "loss_mask"):
                if f in mb:
                    assert torch.equal(mb[f], base[f])
            assert mb["sample_keys"] == base["sample_keys"] and len(mb["spans"]) == len(base["spans"])


# -- tests -------------------------------------------------------------------------------------

def test_sequence_of_puts_placeholders_before_the_caption(data):
    rec = data["samples"][ol.SampleKey("caps", 0)]
    seq = sequence_of(rec, IMG)
    assert seq.tolist() == [IMG] * rec["patches"] + rec["input_ids"].tolist()
    assert sequence_length(rec, IMG) == seq.numel() == rec["tokens"] + rec["patches"]
    assert torch.equal(sequence_of(rec, None), rec["input_ids"]) and sequence_length(rec, None) == rec["tokens"]
    text = data["samples"][ol.SampleKey("web", 0)]
    assert torch.equal(sequence_of(text, IMG), text["input_ids"]) and sequence_length(text, IMG) == text["tokens"]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(f"{a}{v}" for a, v in m.items()))
@pytest.mark.parametrize("fixed", [False, True], ids=["padfree", "seqlen"])
def test_distribute_dp_with_broadcast_tp(data, mesh, fixed):
    cap = -(-data["longest"] // 64) * 64
    plan = make_plan(data, ol.ClientPlaceTree(**mesh), dp_strategy(max_tokens=cap if fixed else None))
    cons = DataConstructor(cap if fixed else None, pad_id=PAD, ignore_index=IGNORE, image_token_id=IMG)
    outs = build_all(plan, cons, data["samples"])
    check_plan(plan, outs, data["samples"], seq_len=cap if fixed else None)
    # the step's images all arrive, each in exactly one bucket's microbatch
    keys = Counter(k for b in outs for mb in bucket_rows(plan, outs, b) for k in mb.get("image_keys", []))
    assert keys == Counter(str(k) for k in data["samples"] if k.source == "caps")


@pytest.mark.parametrize("mesh", [MESHES[0], MESHES[2], MESHES[4]], ids=["dp2", "dp2cp2", "pp3cp2"])
@pytest.mark.parametrize("oversize", ["split", "truncate"])
def test_oversize_split_and_truncate(data, mesh, oversize):
    cap = 96
    plan = make_plan(data, ol.ClientPlaceTree(**mesh), dp_strategy(cap, oversize, microbatches=3, method="greedy"))
    assert plan.stats["oversize"][{"split": "split", "truncate": "truncated"}[oversize]] > 0
    cons = DataConstructor(cap, pad_id=PAD, ignore_index=IGNORE, image_token_id=IMG)
    outs = build_all(plan, cons, data["samples"])
    pieces = check_plan(plan, outs, data["samples"], seq_len=cap)
    long = [k for k, r in data["samples"].items() if full_sequence(r).numel() > cap]
    assert long
    for k in long:
        n = full_sequence(data["samples"][k]).numel()
        if oversize == "split":
            assert len(pieces[k]) == -(-n // cap) and sum(p.numel() for p in pieces[k].values()) == n
        else:
            assert list(pieces[k]) == [0] and pieces[k][0].numel() == cap


def test_image_run_cut_across_pieces_keeps_patch_offsets(data):
    """An image whose placeholders straddle a piece boundary appears in both pieces' microbatches."""
    cap = 40
    plan = make_plan(data, ol.ClientPlaceTree(dp=2), dp_strategy(cap, "split", microbatches=2, method="greedy"))
    outs = build_all(plan, DataConstructor(cap, image_token_id=IMG), data["samples"])
    check_plan(plan, outs, data["samples"], seq_len=cap)
    cut = [k for k, r in data["samples"].items() if "pixels" in r and r["patches"] > cap]
    assert cut
    for key in cut:
        parts = sorted((int(off), int(ln)) for b in outs for mb in bucket_rows(plan, outs, b)
                       for k, off, (_, ln) in zip(mb.get("image_keys", []), mb.get("image_patch_offsets", []),
                                                 mb.get("image_positions", torch.zeros(0, 2)).tolist())
                       if k == str(key))
        assert parts[0][0] == 0 and sum(ln for _, ln in parts) == data["samples"][key]["patches"]
        assert all(o2 == o1 + l1 for (o1, l1), (o2, _) in zip(parts, parts[1:]))


@pytest.mark.parametrize("mesh", CP_MESHES, ids=lambda m: "x".join(f"{a}{v}" for a, v in m.items()))
def test_distribute_cp_with_sequences_spanning_ranks(data, mesh):
    cap = 128
    plan = make_plan(data, ol.ClientPlaceTree(**mesh), cp_strategy(cap))
    assert (plan.entries["nshards"] > 1).any() and (plan.entries["npieces"] > 1).any()
    outs = build_all(plan, DataConstructor(None, pad_id=PAD, ignore_index=IGNORE, image_token_id=IMG),
                     data["samples"])
    check_plan(plan, outs, data["samples"])
    span_images = sum(int(s in mb["image_segments"].tolist()) for b in outs for mb in bucket_rows(plan, outs, b)
                      if "image_segments" in mb for s in (sp["segment"] for sp in mb["spans"]))
    assert span_images > 0        # some captioned images are long enough to span CP ranks
    # each rank's row holds at most its cap plus one padding token per span shard it carries
    for b in outs:
        for mb in bucket_rows(plan, outs, b):
            assert mb["input_ids"].numel() <= cap + len(mb["spans"])
            assert "cp_rank" not in mb                # CP buckets are already per rank: no further split


@pytest.mark.parametrize("mesh", [dict(pp=1, dp=2, cp=1, tp=1), dict(pp=2, dp=2, cp=1, tp=2),
                                  dict(pp=1, dp=1, cp=2, tp=2)], ids=["dp2", "pp2dp2tp2", "cp2tp2"])
@pytest.mark.parametrize("encoder", ["world", "backbone-world", "split", "dp-tp"])
def test_encoder_module_embeds_every_image_once(data, mesh, encoder):
    """The encoder plan: world-wide DP on the attached module or on the backbone mesh, with split
    entries (an image is embedded once, where its first piece sits), or buckets of two ranks."""
    tree = ol.ClientPlaceTree(**mesh)
    world = tree.world_size
    tree.attach("encoder", **({"dp": world // 2, "tp": 2} if encoder == "dp-tp" else {"dp": world}))

    def strategy(g):
        text = g.distribute("DP").cost(ol.attention_flops).balance("karmarkar_karp", microbatches=2)
        img = g.view("image")
        img = (img.distribute("DP", module="encoder") if encoder == "dp-tp" else
               img.distribute("WORLD", module=None if encoder == "backbone-world" else "encoder"))
        split = {"max_tokens": 100, "oversize": "split"} if encoder == "split" else {}
        enc = img.cost(ol.encoder_cost).balance("karmarkar_karp", microbatches=2, **split)
        return text.broadcast_at("TP").plan(encoder=enc)

    plan = make_plan(data, tree, strategy)
    outs = build_all(plan, DataConstructor(None, image_token_id=IMG), data["samples"])
    check_plan(plan, outs, data["samples"])
    enc = plan.modules["encoder"]
    assert (encoder == "split") == bool((enc.entries["npieces"] > 1).any())
    assert (encoder == "dp-tp") == (len(enc.buckets[0]) == 2)
    # every rank gets its encoder share exactly once, whatever its backbone delivery
    embedded, where = Counter(), {}
    seen_ranks = set()
    for b, out in outs.items():
        for r, o in out.items():
            assert o["delivery"] == plan.delivery(r)
            seen_ranks.add(r)
            part = o["encoder"]
            eb = enc.bucket_of(r)
            want = [str(it.key) for mb in enc.bucket_microbatches(eb) for it in mb if it.piece == it.shard == 0]
            assert part["image_keys"] == want and part["image_grid"].shape == (len(want), 2)
            for k, px, g in zip(part["image_keys"], part["pixels"], part["image_grid"].tolist()):
                rec = data["samples"][ol.SampleKey(k.split(":")[0], int(k.split(":")[1]))]
                assert torch.equal(px, rec["pixels"]) and tuple(g) == tuple(rec["grid"])
            if r == min(enc.buckets[eb]):
                embedded.update(part["image_keys"])
                where.update({k: r for k in part["image_keys"]})
    assert seen_ranks == set(range(tree.world_size))
    assert embedded == Counter(str(k) for k in data["samples"] if k.source == "caps")
    # backbone microbatches route each image to the rank that embeds it, and carry no pixels
    routed = 0
    for b in outs:
        for mb in bucket_rows(plan, outs, b):
            assert "pixels" not in mb
            for k, r in zip(mb.get("image_keys", []), mb.get("image_encoder_rank", torch.zeros(0)).tolist()):
                assert where[k] == r
                routed += 1
    assert routed == len(embedded)


def test_empty_microbatch_is_a_padding_row(data):
    mesh = ol.ClientPlaceTree(dp=2, cp=2)
    plan = ol.Planner(lambda g: g.distribute("DP").plan_raw(lambda gg: [[list(range(len(gg)))], [[], []]]),
                      mesh, global_batch=1).plan(data["buffers"])
    assert plan.n_microbatches == 2
    for seq_len in (None, 8192):
        outs = build_all(plan, DataConstructor(seq_len, image_token_id=IMG), data["samples"])
        check_plan(plan, outs, data["samples"], seq_len=seq_len)
        for r in plan.buckets[1]:
            for mb in outs[1][r]["microbatches"]:
                assert mb["sample_keys"] == [] and mb["spans"] == [] and not mb["loss_mask"].any()
                assert mb["input_ids"].numel() == (seq_len or 4) // 2 and (mb["segment_ids"] == -1).all()


def test_a_microbatch_of_empty_samples_is_a_padding_row_too(data):
    """A microbatch whose samples have no token (empty texts, no BOS/EOS) is as long as an empty one:
    2*cp padding tokens per row (1 without CP), never a row of length 0; its samples stay listed, each an
    empty entry."""
    empty = {ol.SampleKey("web", i): {"input_ids": torch.zeros(0, dtype=torch.int64)} for i in range(2)}
    buffers = [ol.BufferMeta.from_samples("web", [{"index": k.index, "tokens": 0} for k in empty])]
    for cp in (1, 2):
        mesh = ol.ClientPlaceTree(dp=1, cp=cp)
        plan = ol.Planner(lambda g: g.distribute("DP").plan_raw(lambda gg: [[[0, 1]]]), mesh,
                          global_batch=2).plan(buffers)
        row = 2 * cp if cp > 1 else 1
        for r, out in DataConstructor(None, PAD, IGNORE).build(plan, 0, empty).items():
            (mb,) = out["microbatches"]
            assert mb["sample_keys"] == ["web:0", "web:1"]
            assert mb["input_ids"].numel() == row // cp and (mb["segment_ids"] == -1).all()
            assert not mb["loss_mask"].any()
            assert mb["cu_seqlens_padded"].tolist() == [0, 0, 0, row] and mb["cu_seqlens"].tolist() == [0, 0, 0, 0]


def test_missing_sample_names_the_key_and_the_step(data):
    plan = make_plan(data, ol.ClientPlaceTree(dp=2), dp_strategy())
    key = plan.bucket_microbatches(1)[0][0].key
    samples = {k: v for k, v in data["samples"].items() if k != key}
    with pytest.raises(KeyError, match=rf"step 0: sample {key} .* bucket 1") as err:
        DataConstructor(None, image_token_id=IMG).build(plan, 1, samples)
    assert isinstance(err.value, MissingSampleError)
    assert key not in {it.key for mb in plan.bucket_microbatches(0) for it in mb}
    assert set(DataConstructor(None, image_token_id=IMG).build(plan, 0, samples)) == set(plan.buckets[0])


def test_bad_configuration_is_named(data):
    plan = make_plan(data, ol.ClientPlaceTree(dp=2, cp=2), dp_strategy(max_tokens=512, oversize="split"))
    with pytest.raises(ol.ConfigError, match=r"seq_len=510 must be a multiple of 2\*cp=4"):
        DataConstructor(510, image_token_id=IMG).build(plan, 0, data["samples"])
    with pytest.raises(ol.ConfigError, match="bucket 2 is outside 0..1"):
        DataConstructor(512, image_token_id=IMG).build(plan, 2, data["samples"])
    with pytest.raises(ol.OversizeSampleError, match=r"step 0: microbatch \d+ of bucket 0 holds \d+ tokens"):
        DataConstructor(64, image_token_id=IMG).build(plan, 0, data["samples"])
    # a constructor that does not count placeholders disagrees with the planned token counts
    with pytest.raises(ol.ConfigError, match="pass image_token_id"):
        for b in range(2):
            DataConstructor(None).build(plan, b, data["samples"])
    with pytest.raises(ol.ConfigError, match="seq_len must be None or an integer"):
        DataConstructor(0)


def _buffers(samples, image_token_id):
    by_source = defaultdict(list)
    for k, r in samples.items():
        by_source[k.source].append({"index": k.index, "tokens": sequence_length(r, image_token_id),
                                    "image_patches": r.get("image_patches", [])})
    return [ol.BufferMeta.from_samples(s, rows) for s, rows in by_source.items()]


def test_small_image_in_a_cp_span_goes_to_the_shards_holding_its_placeholders(data):
    long_text = data["samples"][ol.SampleKey("web", 36)]
    assert long_text["tokens"] > 300
    px = torch.arange(3 * 16 * 16, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(3, 16, 16)
    rec = {"pixels": px, "grid": (2, 2), "patches": 4, "image_patches": [4], **long_text}
    samples = {ol.SampleKey("doc", 0): rec, ol.SampleKey("web", 0): data["samples"][ol.SampleKey("web", 0)]}
    cap = (long_text["tokens"] + 4) // 2 + 8              # spans exactly two CP ranks, no pieces
    plan = ol.Planner(cp_strategy(cap), ol.ClientPlaceTree(cp=2), global_batch=2).plan(_buffers(samples, IMG))
    items = [it for b in range(2) for mb in plan.bucket_microbatches(b) for it in mb if it.key.source == "doc"]
    assert sorted((it.shard, it.nshards) for it in items) == [(0, 2), (1, 2)]
    outs = build_all(plan, DataConstructor(None, image_token_id=IMG), samples)
    check_plan(plan, outs, samples)
    holders = {int(mb["spans"][0]["shard"]): mb.get("image_keys", []) for b in outs for mb in outs[b][b]["microbatches"]
               if mb["spans"]}
    assert holders == {0: ["doc:0"], 1: []}      # placeholders 0..3 sit in chunk 0, held by shard 0
    # without placeholders the image rides with the span's first shard only
    plan = ol.Planner(cp_strategy(cap - 2), ol.ClientPlaceTree(cp=2), global_batch=2).plan(_buffers(samples, None))
    outs = build_all(plan, DataConstructor(None), samples)
    holders = {int(mb["spans"][0]["shard"]): mb.get("image_keys", []) for b in outs for mb in outs[b][b]["microbatches"]
               if mb["spans"]}
    assert holders == {0: ["doc:0"], 1: []}


def test_without_image_token_id_images_ride_along_without_positions(data):
    samples = data["samples"]
    cap = 12
    assert any(r["tokens"] > cap for k, r in samples.items() if k.source == "caps")
    plan = make_plan({**data, "buffers": _buffers(samples, None)}, ol.ClientPlaceTree(dp=2),
                     dp_strategy(cap, "split", method="greedy"))
    outs = build_all(plan, DataConstructor(cap), samples)
    got = Counter()
    for b in outs:
        for items, mb in zip(plan.bucket_microbatches(b), outs[b][b]["microbatches"]):
            cu = mb["cu_seqlens"].tolist()
            for j, it in enumerate(items):
                ids = samples[it.key]["input_ids"]
                a = it.piece * cap if it.npieces > 1 else 0
                assert torch.equal(mb["input_ids"][cu[j]:cu[j + 1]], ids[a:a + it.tokens])
            assert "image_positions" not in mb and IMG not in mb["input_ids"].tolist()
            for k, seg, px in zip(mb.get("image_keys", []), mb.get("image_segments", torch.zeros(0)).tolist(),
                                  mb.get("pixels", [])):
                assert items[int(seg)].piece == 0 and str(items[int(seg)].key) == k
                assert torch.equal(px, samples[items[int(seg)].key]["pixels"])
                got[k] += 1
    assert got == Counter(str(k) for k in samples if k.source == "caps")


# -- against pack + split_packed ----------------------------------------------------------------

def reference_rows(plan, bucket, samples, seq_len, image_token_id):
    """The bucket's packed rows as the public transforms give them: each item's backbone piece (a CP
    span shard: its zig-zag tokens, with the labels / loss_mask / position_ids of its whole sequence)
    packed by ``pack``, one sequence after another."""
    cp = plan.mesh.sizes.get("cp", 1) if plan.axis == "dp" else 1
    mult = 2 * cp if cp > 1 else 1
    rows = []
    for items in plan.bucket_microbatches(bucket):
        seqs, padded, overrides = [], [], {}
        for j, it in enumerate(items):
            rec = samples[it.key]
            n = rec["patches"] if "pixels" in rec and image_token_id is not None else 0
            full = torch.cat([torch.full((n,), IMG, dtype=torch.int64), rec["input_ids"]])
            a, b = piece_bounds(plan, it, full.numel())
            piece = full[a:b]
            if it.nshards == 1:
                seqs.append(piece)
                padded.append(-(-piece.numel() // mult) * mult)
                continue
            T, k = piece.numel(), it.nshards
            idx = ol.transforms.zigzag_indices(-(-T // (2 * k)) * 2 * k, k, it.shard)
            seqs.append(piece[idx[idx < T]])
            padded.append(idx.numel())
            labels = torch.cat([piece[1:], torch.full((idx.numel() * k - T + 1,), IGNORE, dtype=torch.int64)])
            overrides[j] = {"labels": labels[idx], "loss_mask": idx < T - 1, "position_ids": idx}
        row = ol.transforms.pack(seqs, seq_len if seq_len is not None or items else mult, PAD, IGNORE,
                                 pad_to_multiple=mult, sequence_multiple=mult, padded_lengths=padded)
        cu = row["cu_seqlens_padded"].tolist()
        for j, fields in overrides.items():
            for f, v in fields.items():
                row[f][cu[j]:cu[j + 1]] = v
        hit = row["labels"] == IMG            # an image placeholder is never a target
        row["labels"][hit] = IGNORE
        row["loss_mask"][hit] = False
        rows.append(row)
    return rows, cp


def random_plan(data, rng):
    """A plan drawn at random: distribute DP (cp 1, 2 or 4; pieces, truncation) or CP (spans), or a
    raw plan with empty microbatches; pp/tp replicas; placeholders counted or not."""
    image_token_id = rng.choice([IMG, None])
    samples = data["samples"]
    buffers = data["buffers"] if image_token_id is not None else _buffers(samples, None)
    kind = rng.choice(["dp", "dp", "cp", "raw"])
    cp = rng.choice([1, 2, 4] if kind != "cp" else [2, 4])
    tree = ol.ClientPlaceTree(pp=rng.choice([1, 2]), dp=rng.choice([1, 2]), cp=cp, tp=rng.choice([1, 2]))
    microbatches = rng.randint(1, 4)
    if kind == "dp":
        cap = rng.choice([None, 40, 96, 256])
        strategy = dp_strategy(cap, "error" if cap is None else rng.choice(["split", "truncate"]), microbatches,
                               rng.choice(["greedy", "karmarkar_karp"]))
    elif kind == "cp":
        strategy = cp_strategy(rng.choice([64, 128, 300]))
    else:
        def strategy(g):
            def fn(gg):
                buckets = [[[] for _ in range(microbatches)] for _ in gg.layout.buckets]
                slots = [mb for mbs in buckets for mb in mbs]
                live = rng.sample(slots, rng.randint(1, len(slots)))     # the others stay empty
                for row in range(len(gg)):
                    rng.choice(live).append(row)
                return buckets
            return g.distribute("DP").plan_raw(fn)
    plan = ol.Planner(strategy, tree, global_batch=len(samples)).plan(buffers)
    return plan, image_token_id


@pytest.mark.parametrize("seed", range(40))
def test_build_matches_pack_and_split_packed(data, seed):
    """Every client's microbatches equal ``pack`` (+ ``split_packed`` for the CP ranks of a DP bucket)
    of the planned pieces, field by field, in the same key order; pipeline stages share the stage-0
    tensors of their row."""
    rng = random.Random(seed)
    plan, image_token_id = random_plan(data, rng)
    samples = data["samples"]
    seq_len = None
    if rng.random() < 0.5:      # a fixed length that holds every row, with some trailing padding
        free = build_all(plan, DataConstructor(None, PAD, IGNORE, image_token_id), samples)
        longest = max(mb["cu_seqlens_padded"][-1].item() for out in free.values() for o in out.values()
                      for mb in o["microbatches"] or [])
        m = 2 * plan.mesh.sizes.get("cp", 1)
        seq_len = -(-longest // m) * m + m * rng.randint(0, 3)
    cons = DataConstructor(seq_len, PAD, IGNORE, image_token_id)
    for b in range(len(plan.buckets)):
        out = cons.build(plan, b, samples)
        rows, cp = reference_rows(plan, b, samples, seq_len, image_token_id)
        first_stage = {}
        for r in plan.buckets[b]:
            c = plan.mesh.coords(r)
            got = out[r]["microbatches"]
            if plan.delivery(r) == "none":
                assert got is None
                continue
            last = c.get("pp", 0) == plan.mesh.sizes.get("pp", 1) - 1
            for m, (mb, row) in enumerate(zip(got, rows, strict=True)):
                want = ol.transforms.split_packed(row, cp, c.get("cp", 0)) if cp > 1 else row
                if plan.delivery(r) == "metadata":
                    want = {k: v for k, v in want.items() if k != "input_ids" and (last or k not in
                                                                                     ("labels", "loss_mask"))}
                keys = [k for k in mb if k in want]
                assert keys == [k for k in want if k not in ("cp_rank", "cp_size", "token_index")] + \
                    (["cp_rank", "cp_size", "token_index"] if cp > 1 else [])
                assert cp == 1 or list(mb)[-3:] == ["cp_rank", "cp_size", "token_index"]
                assert set(mb) - set(want) <= {
                    "sample_keys", "spans", "image_keys", "image_grid", "image_segments", "image_positions",
                    "image_patch_offsets", "pixels"}
                for k, v in want.items():
                    assert mb[k].dtype == v.dtype and mb[k].shape == v.shape and torch.equal(mb[k], v), (r, m, k)
                stage0 = first_stage.setdefault((c.get("cp", 0), m), mb)
                for k in set(mb) & set(stage0) - {"sample_keys", "spans", "image_keys", "pixels"}:
                    assert mb[k] is stage0[k], k


def two_image_samples(data) -> dict:
    """Samples holding two of the captioned images each (the first's caption): backbone sequence = the
    first image's placeholders, the second's, then the caption, so a truncation may cut off the second."""
    caps = [r for k, r in sorted(data["samples"].items()) if k.source == "caps"]
    return {ol.SampleKey("duo", i): {"input_ids": a["input_ids"], "pixels": [a["pixels"], b["pixels"]],
                                     "grid": [a["grid"], b["grid"]], "image_patches": [a["patches"], b["patches"]]}
            for i, (a, b) in enumerate(zip(caps, caps[3:] + caps[:3]))}


@pytest.mark.parametrize("mesh", [dict(dp=2), dict(pp=2, dp=2, cp=2)], ids=["dp2", "pp2dp2cp2"])
@pytest.mark.parametrize("oversize", ["drop", "truncate"])
def test_encoder_embeds_exactly_the_images_the_backbone_rows_hold(data, mesh, oversize):
    """Under balance(max_tokens=, oversize="drop"|"truncate") the encoder embeds the images whose placeholders
    the backbone rows hold, each once: none of a dropped sample, none whose run the truncation cut off wholly
    (one kept in part is embedded whole; the rows take its first patches)."""
    cap = {"drop": 120, "truncate": 40}[oversize]
    duo = two_image_samples(data)
    samples = {**data["samples"], **duo}
    rows = [{"index": k.index, "tokens": sequence_length(r, IMG), "image_patches": r["image_patches"]}
            for k, r in duo.items()]
    buffers = data["buffers"] + [ol.BufferMeta.from_samples("duo", rows)]
    tree = ol.ClientPlaceTree(**mesh)

    def strategy(g):
        text = g.distribute("DP").cost(ol.attention_flops).balance("greedy", microbatches=2, max_tokens=cap,
                                                                      oversize=oversize)
        images = g.view("image").distribute("WORLD").cost(ol.encoder_cost).balance("greedy", microbatches=2)
        return text.plan(encoder=images)

    plan = ol.Planner(strategy, tree, global_batch=len(samples)).plan(buffers)
    enc = plan.modules["encoder"]
    outs = build_all(plan, DataConstructor(cap, image_token_id=IMG), samples)
    # what the backbone rows hold: image key -> (rank that embeds it, patch offset, placeholders)
    held = defaultdict(list)
    for b in outs:
        for mb in bucket_rows(plan, outs, b):
            none = torch.zeros(0, 2, dtype=torch.int64)        # a microbatch without images has no image fields
            for k, r, off, (start, n) in zip(mb.get("image_keys", []),
                                             mb.get("image_encoder_rank", none[:, 0]).tolist(),
                                             mb.get("image_patch_offsets", none[:, 0]).tolist(),
                                             mb.get("image_positions", none).tolist()):
                assert (mb["input_ids"][start:start + n] == IMG).all()
                held[k].append((r, off, n))
    # what the encoder embeds: image key -> the rank of its bucket that receives it first
    embedded = Counter()
    where = {}
    for out in outs.values():
        for r, o in out.items():
            eb = enc.bucket_of(r)
            if r == min(enc.buckets[eb]):
                embedded.update(o["encoder"]["image_keys"])
                where.update({k: r for k in o["encoder"]["image_keys"]})
                assert o["encoder"]["image_microbatch"].numel() == len(o["encoder"]["image_keys"])
    assert set(embedded) == set(held) and max(embedded.values()) == 1      # every held image embedded once
    assert all(where[k] == r for k, runs in held.items() for r, _, _ in runs)
    # the same, written out from the records: image i of a sample is held when its run starts before the cut
    dropped = {str(k) for k, r in samples.items() if sequence_length(r, IMG) > cap}
    assert dropped & {str(k) for k, r in samples.items() if "pixels" in r}
    want, partly = set(), 0
    for key, rec in samples.items():
        if "pixels" not in rec or (oversize == "drop" and str(key) in dropped):
            continue
        patches = rec.get("image_patches", [rec.get("patches")])
        start = 0
        for i, p in enumerate(patches):
            if start < cap:
                want.add(str(key) if len(patches) == 1 else f"{key}#{i}")
                partly += start + p > cap
            start += p
    assert set(embedded) == want and len(want) >= 6
    n_images = sum(len(r.get("image_patches", [1])) for r in samples.values() if "pixels" in r)
    if oversize == "drop":
        assert plan.stats["oversize"]["dropped"] == len(dropped)
        # the encoder plan leaves the dropped samples out, and is balanced over the rest
        assert {str(k) for k in enc.planned_keys()} == {str(k) for k in plan.planned_keys()
                                                        if "pixels" in samples[k]}
        assert enc.stats["samples"] == len(enc.records) == len(enc.planned_keys())
        assert all(str(k) not in dropped for k in enc.records.keys())
    else:
        assert plan.stats["oversize"]["truncated"] == len(dropped)
        assert partly and len(want) < n_images          # some runs kept in part, some cut off wholly
        assert all(off == 0 for runs in held.values() for _, off, _ in runs)

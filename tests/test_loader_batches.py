"""What a training loop receives from OverlordLoader, on real Parquet files: the documented batch
contract for every delivery kind (issue 11 item 13) and per-sequence context-parallel shards (item 12).

Expected chunk positions, shapes and padding values are written out here from the contract's
words (THD with CP: chunks r and 2*cp-1-r of every sequence), never computed by the code under test.
"""

from __future__ import annotations

import re
import typing
from collections import Counter
from pathlib import Path

import pytest
import torch

import torchdata_overlord as ol
from torchdata_overlord.batch import EncoderPart, Field, Span, fields
from torchdata_overlord.sim.corpus import build_demo_corpus
from torchdata_overlord.transforms import ImageText, Tokenize

README = Path(__file__).resolve().parent.parent / "README.md"
WEIGHTS = {"web": 0.4, "code": 0.25, "long": 0.15, "caps": 0.2}
PAD, IGNORE = 0, -100
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_demo_corpus(tmp_path_factory.mktemp("corpus"), scale="test", seed=0)


def sources(corpus):
    out = []
    for name in WEIGHTS:
        t = (ImageText(corpus.spm_model, image_field="image", text_field="text", patch=14, max_side=112)
             if name == "caps" else Tokenize(corpus.spm_model, field=corpus.text_fields[name]))
        out.append(ol.ParquetSource(name, corpus.sources[name], t, seed=0))
    return out


# module-level strategies: the rpc runtime pickles them
def dp_text(g):
    return (g.mix(WEIGHTS).distribute("DP").cost(ol.attention_flops)
            .balance("karmarkar_karp", microbatches=3, max_tokens=2048, oversize="split").broadcast_at("TP").plan())


def vlm(g):
    g = g.mix(WEIGHTS)
    img = g.view("image").distribute("DP", module="encoder").cost(ol.encoder_cost).balance("greedy")
    return (g.view("text").distribute("DP").cost(ol.attention_flops)
            .balance("greedy", microbatches=2, max_tokens=2048, oversize="split").broadcast_at("TP")
            .plan(encoder=img.broadcast_at("TP")))


def cp_spans(g):
    return (g.mix(WEIGHTS).distribute("CP").cost(ol.attention_flops)
            .balance("greedy", microbatches=2, max_tokens=512, level="lockstep", oversize="split").plan())


def run(corpus, strategy, mesh, steps, seq_len, **kw):
    with ol.OverlordLoader(sources(corpus), strategy, mesh, rank=None, global_batch=16, seq_len=seq_len,
                           image_token_id=corpus.image_token_id, prefetch=0, **kw) as loader:
        return [item for _, item in zip(range(steps), loader)]


# -- item 12: every CP rank an equal share of every sequence ------------------------------------

def chunks(cu_padded, cp, r):
    """Row positions CP rank r holds: chunks r and 2*cp-1-r of every entry."""
    out = []
    for a, b in zip(cu_padded, cu_padded[1:]):
        assert (b - a) % (2 * cp) == 0, f"entry [{a}, {b}) is not padded to a multiple of 2*cp={2 * cp}"
        c = (b - a) // (2 * cp)
        out += list(range(a + r * c, a + (r + 1) * c)) + list(range(a + (2 * cp - 1 - r) * c, a + (2 * cp - r) * c))
    return out


@pytest.mark.parametrize("seq_len", [2048, None], ids=["seq_len=2048", "padfree"])
def test_cp_ranks_get_an_equal_share_of_every_sequence(corpus, seq_len):
    """Regression: the whole padded row was zig-zagged, so a CP rank could get only padding (loss_mask
    sum 0) while the other got every real token, and padding was a sequence of its own."""
    mesh = ol.ClientPlaceTree(dp=2, cp=2)
    cp = 2
    starved = checked = images = 0
    for step, item in enumerate(run(corpus, dp_text, mesh, 3, seq_len)):
        for dp in range(2):
            clients = [item[mesh.rank(dp=dp, cp=r)] for r in range(cp)]
            assert all(c["delivery"] == "data" and c["step"] == step for c in clients)
            for mbs in zip(*(c["microbatches"] for c in clients)):
                cu, cu_p = mbs[0]["cu_seqlens"].tolist(), mbs[0]["cu_seqlens_padded"].tolist()
                n = cu_p[-1]
                if seq_len is not None:
                    assert n == seq_len
                real = [b - a for a, b in zip(cu, cu[1:])]
                keys = mbs[0]["sample_keys"]
                assert len(real) in (len(keys), len(keys) + 1) and (len(real) == len(keys) or real[-1] == 0)
                assert int(mbs[0]["max_seqlen"]) == max(real, default=0)     # the padding is no sequence
                row = {f: [None] * n for f in ("input_ids", "labels", "loss_mask", "segment_ids", "position_ids")}
                for r, mb in enumerate(mbs):
                    assert mb["token_index"].tolist() == chunks(cu_p, cp, r)
                    assert mb["input_ids"].numel() == n // cp
                    for f in row:
                        for at, v in zip(mb["token_index"].tolist(), mb[f].tolist()):
                            row[f][at] = v
                    starved += int(not mb["loss_mask"].any())
                # per sequence: real tokens split evenly (at most 2*cp-1 apart), all of them present once
                for j, length in enumerate(real[:len(keys)]):
                    held = [int((mb["segment_ids"] == j).sum()) for mb in mbs]
                    assert sum(held) == length and max(held) - min(held) <= 2 * cp - 1, (step, j, held)
                    a = cu_p[j]
                    assert row["segment_ids"][a:a + length] == [j] * length
                    assert row["position_ids"][a:cu_p[j + 1]] == list(range(cu_p[j + 1] - a))
                    # the next token, never an image placeholder
                    want = [IGNORE if t == corpus.image_token_id else t for t in row["input_ids"][a + 1:a + length]]
                    assert row["labels"][a:a + length - 1] == want
                    assert row["loss_mask"][a:a + length - 1] == [t != IGNORE for t in want]
                    assert not row["loss_mask"][a + length - 1]
                    images += corpus.image_token_id in row["input_ids"][a:a + length]
                    checked += 1
                pad = [i for i, s in enumerate(row["segment_ids"]) if s < 0]
                assert len(pad) == n - sum(real)
                assert {row["input_ids"][i] for i in pad} <= {PAD} and {row["labels"][i] for i in pad} <= {IGNORE}
                assert not any(row["loss_mask"][i] for i in pad)
    assert checked > 20 and starved == 0 and images > 0


# -- item 13: the batch contract ----------------------------------------------------------------

def _symbols(mb, tokens):
    keys = mb["sample_keys"]
    entries = mb["cu_seqlens"].numel() - 1
    assert entries in (len(keys), len(keys) + 1)
    return {"T": tokens, "E+1": entries + 1, "I": len(mb.get("image_keys", []))}


def check(contract: type, obj: dict, symbols: dict, pad_values: dict | None = None, where: str = ""):
    """obj has every required key of the contract, nothing undocumented, each of the documented
    type, dtype and shape; token fields hold their documented value on padding."""
    spec = fields(contract)
    assert set(obj) <= set(spec), f"{where}: undocumented keys {set(obj) - set(spec)}"
    assert contract.__required_keys__ <= set(obj), f"{where}: missing {contract.__required_keys__ - set(obj)}"
    for key, value in obj.items():
        f: Field = spec[key]
        if value is None:
            assert "None" in f.when, f"{where}.{key}: None is not documented"
            continue
        assert isinstance(value, f.type) and not (f.type is int and isinstance(value, bool)), (where, key, type(value))
        elems = value if f.type is list and f.dtype is not None else [value] if f.type is torch.Tensor else []
        for t in elems:
            assert isinstance(t, torch.Tensor) and t.dtype == f.dtype, (where, key, t.dtype, f.dtype)
            assert t.dim() == len(f.shape), (where, key, tuple(t.shape), f.shape)
            for size, sym in zip(t.shape, f.shape):
                assert size == sym if isinstance(sym, int) else sym not in symbols or size == symbols[sym], \
                    (where, key, tuple(t.shape), f.shape, symbols)
        if pad_values is not None and f.shape == ("T",) and f.pad not in (None, "counting on"):
            pad = obj["segment_ids"] < 0
            want = pad_values.get(f.pad, f.pad)
            assert (value[pad] == want).all(), (where, key, want)


def check_microbatch(mb, delivery, last_stage, tokens, row_cp, where):
    check(ol.Microbatch, mb, _symbols(mb, tokens), {"pad_id": PAD}, where)
    assert ("input_ids" in mb) == (delivery == "data")
    assert ("labels" in mb) == ("loss_mask" in mb) == (delivery == "data" or last_stage)
    assert ("cp_rank" in mb) == ("cp_size" in mb) == ("token_index" in mb) == (row_cp > 1)
    if row_cp > 1:
        assert int(mb["cp_size"]) == row_cp and mb["token_index"].tolist() == \
            chunks(mb["cu_seqlens_padded"].tolist(), row_cp, int(mb["cp_rank"]))
    images = len(mb.get("image_keys", []))
    for k in ("image_grid", "image_segments", "image_positions", "image_patch_offsets"):
        assert (k in mb) == bool(images), (where, k)
    for i, sp in enumerate(mb["spans"]):
        check(Span, sp, {"N": sp["length"]}, where=f"{where}.spans[{i}]")
        assert sp["token_index"].numel() == sp["length"]


def test_every_delivery_kind_matches_the_documented_contract(corpus):
    seq_len = 2048
    kinds, encoder_parts = Counter(), Counter()

    # VLM on pp=2, dp=2, cp=2, tp=2, the encoder in DP x TP over all ranks: data, metadata, none, encoder parts
    mesh = ol.ClientPlaceTree(pp=2, dp=2, cp=2, tp=2)
    mesh.attach("encoder", dp=mesh.world_size // 2, tp=2)
    for step, item in enumerate(run(corpus, vlm, mesh, 2, seq_len)):
        assert sorted(item) == list(range(mesh.world_size))          # rank=None: {rank: Batch} for every rank
        for rank, batch in item.items():
            c, where = mesh.coords(rank), f"step {step} rank {rank}"
            check(ol.Batch, batch, {}, where=where)
            assert batch["step"] == step and "encoder" in batch
            want = "none" if c["tp"] else "metadata" if c["pp"] else "data"
            assert batch["delivery"] == want
            kinds[want] += 1
            if want == "none":
                assert batch["microbatches"] is None
            for m, mb in enumerate(batch["microbatches"] or []):
                check_microbatch(mb, want, c["pp"] == 1, seq_len // 2, 2, f"{where} mb {m}")
                assert "pixels" not in mb                           # the encoder module embeds them
                if mb.get("image_keys"):
                    assert mb["image_encoder_rank"].shape == (len(mb["image_keys"]),)
            part = batch["encoder"]
            encoder_parts[part is not None] += 1
            if part is not None:
                check(EncoderPart, part, {"I": len(part["image_keys"])}, where=f"{where} encoder")
    assert set(kinds) == {"data", "metadata", "none"} and encoder_parts[True] and encoder_parts[False]

    # no encoder module: pixels ride in data microbatches; pp=1
    mesh = ol.ClientPlaceTree(dp=2, cp=2)
    pixels = 0
    for item in run(corpus, dp_text, mesh, 2, seq_len):
        for rank, batch in item.items():
            check(ol.Batch, batch, {}, where=f"rank {rank}")
            assert batch["encoder"] is None and batch["delivery"] == "data"
            for mb in batch["microbatches"]:
                check_microbatch(mb, "data", True, seq_len // 2, 2, f"rank {rank}")
                assert ("pixels" in mb) == bool(mb.get("image_keys"))
                pixels += len(mb.get("pixels", []))
    assert pixels

    # distribute("CP"): each rank's own row, long sequences spanning CP ranks; no CP split of rows
    spans = 0
    for item in run(corpus, cp_spans, mesh, 2, None):
        for rank, batch in item.items():
            check(ol.Batch, batch, {}, where=f"rank {rank}")
            for mb in batch["microbatches"]:
                check_microbatch(mb, "data", True, mb["position_ids"].numel(), 1, f"rank {rank}")
                spans += len(mb["spans"])
    assert spans


def test_readme_documents_every_key_of_the_contract():
    text = README.read_text()
    section = text[text.index("## What each step yields"):]
    section = section[:section.index("\n## ", 1)]
    documented = set(re.findall(r"`(\w+)`", section))
    for contract in (ol.Batch, ol.Microbatch, Span, EncoderPart):
        missing = set(fields(contract)) - documented
        assert not missing, f"README's batch section does not mention {sorted(missing)} of {contract.__name__}"
    assert typing.get_type_hints(ol.Microbatch)          # the TypedDicts resolve for type checkers too


def one_web(g):
    return g.mix({"web": 1.0}).distribute("DP").balance("greedy", microbatches=1).plan()


def test_a_text_holding_the_image_placeholder_literally_is_named(corpus, tmp_path):
    """A text with the placeholder piece in it ('<image>', a user-defined symbol of the tokenizer) tokenizes to
    image_token_id with no image behind it; with image_token_id given, the loader refuses that row, naming the
    file and row, instead of packing a placeholder a model would fill with another sample's image features."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"plain text number {i}" for i in range(12)]
    texts[5] = "a caption that says <image> where no image is"
    pq.write_table(pa.table({"text": texts}), tmp_path / "web.parquet", row_group_size=4)
    src = [ol.ParquetSource("web", str(tmp_path / "web.parquet"), Tokenize(corpus.spm_model, field="text"),
                            shuffle=False)]
    assert corpus.image_token_id in Tokenize(corpus.spm_model, field="text")({"text": texts[5]})["input_ids"].tolist()
    with pytest.raises(ol.OverlordError, match=rf"source 'web': sample 5 \(.*web\.parquet row 5\) has the image "
                                               rf"placeholder id {corpus.image_token_id} in its text"):
        with ol.OverlordLoader(src, one_web, ol.ClientPlaceTree(dp=1), rank=0, global_batch=4, seq_len=None,
                               image_token_id=corpus.image_token_id, prefetch=0) as loader:
            for _ in zip(range(3), loader):     # rows 4-7 come with the first refill
                pass
    # a text-only job (no image_token_id) has no placeholder: the same row is plain text there
    with ol.OverlordLoader(src, one_web, ol.ClientPlaceTree(dp=1), rank=0, global_batch=12, seq_len=None,
                           prefetch=0) as loader:
        assert len(next(iter(loader))["microbatches"][0]["sample_keys"]) == 12

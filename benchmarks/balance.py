"""Balance (paper 7.3, Figs. 3 and 13): what cost balancing buys a lockstep training step.

Three synthetic workloads, metadata only (``SimulatedLoaders`` buffers, refilled between steps):

* ``captions``: coyo-like image-caption pairs. Caption lengths are lognormal (mu 2.44, sigma
  0.817), fitted to the paper's coyo700M figures: ~98.2% of captions <= 64 tokens, the longest
  1.62% hold ~9.3% of the text tokens (the library's ``"captions"`` distribution gives 94% <= 64,
  so it is not used). One image per sample, 16 px patches, longer side lognormal around 320 px
  (64..1024), aspect 1..2.5: skewed patch counts.
* ``image_text``: NaViT-like, the library's ``"image_text"`` distribution: 1-3 images of 14 px
  patches at native resolution (up to ~44k patches a sample), captions around 30 tokens.
* ``long``: heavy-tailed long-context text, the library's ``"long"`` distribution (Pareto 1.1 from
  1k to 128k tokens): the longest 1% of documents hold ~70% of the sum of squared lengths.
* ``pytext``: real text plus a Pareto tail. The documents are the modules of this interpreter's
  standard library (``sysconfig``'s stdlib folder, ``*.py`` outside test folders and
  site-packages, ~730 files, ~12 MB on 3.11), tokenized by a sentencepiece BPE model (vocab 8k)
  trained at run time on their lines (no network, nothing downloaded; the lengths are cached in
  the temp folder by Python and sentencepiece version). A sample is a module drawn at random
  (median ~1.9k tokens, up to ~160k), or with probability ``PYTEXT_TAIL`` (2%) a Pareto 1.1 length
  from 8k to 128k tokens: real short/medium text with a synthetic long-document tail.

For the two VLM workloads a sample's backbone sequence is its image placeholders (one per patch,
as the Data Constructor builds it) followed by its caption, so ``tokens = text + patches``.

Every configuration: context length ``ctx`` in {4k, 8k, 16k, 32k} tokens per rank and microbatch,
DP in {8, 64, 512}, 8 microbatches. The VLM meshes are ``dp=DP`` (the encoder attached in
world-wide DP); the long-context mesh is ``dp=DP, cp=4`` (4*DP ranks), as long-context jobs run.
The global batch fills 8 microbatches of every rank to ``FILL`` (80%) of ``ctx`` on average.
Strategies, all planned by ``ol.Planner`` on the same sampled batch at every step:

* ``vanilla``: ``balance("arrival")``, the mixed batch cut in arrival order (equal counts per rank,
  a microbatch opened when the next sample does not fit), every rank encoding its own images;
* ``backbone-<method>``: ``distribute("DP").cost(attention_flops).balance(method, 8, max_tokens)``;
* ``hybrid-<method>``: the backbone as above plus the images balanced on their own by
  ``EncoderCost`` over all ranks (``distribute("DP", module="encoder")``), VLM workloads;
* ``cp-<method>``: ``distribute("CP")``: DP x CP ranks as uniform consumers, a sequence spans CP
  ranks only when it does not fit one rank's ``ctx`` (long workload);
* ``lockstep-kk``: the backbone as ``backbone-kk`` with ``balance(..., level="lockstep")``: every
  (rank, microbatch) bin pooled, for jobs whose every microbatch ends in a synchronisation (FSDP):
  a lower lockstep cost, paid with less even per-rank totals.

``method`` is each built-in balancer, ``greedy`` and ``karmarkar_karp`` (``kk``). Documents longer
than a bin are split (``oversize="split"``). With ``distribute("DP")`` on the cp=4 mesh every
sequence is zig-zag sharded over its DP group's 4 CP ranks (cap 4 x ctx per group).

Figures, each the mean over ``--steps`` steps:

* per-rank max/mean of the backbone cost (``plan.stats["max_over_mean"]``), and of the encoder;
* lockstep/bound: sum over microbatch index of the max over ranks of the backbone cost, over the
  plan's lower bound on it (``plan.stats["lockstep_over_bound"]``; ``plane/balancing/bound.py``: the
  largest of max(largest item, mean per rank), the rows that items too large to share a bin force,
  and what those rows cannot hold within their tokens);
* simulated step time and speedup over vanilla (ratio of summed step times), attention-FLOPs
  cost model: backbone ``AttentionFlops(hidden=4096)`` x 32 layers, encoder ``EncoderCost(hidden=1536)``
  x 40 layers (a ViT-1B-like encoder beside a 7B-like backbone). A step is the encoder phase
  (max over ranks of each rank's images; vanilla and backbone: the images of the rank's own
  samples, the first piece of a split sample holding them) then the backbone microbatches in
  lockstep: ``T = 40 * max_r E_r + 32 * sum_m max_r B[m, r]``; step/mean is T over the
  per-rank mean of the same work (1.0 = no rank ever waits);
* a measured speedup on a subset (DP 8 ranks, ctx 8k: ``dp=8`` for VLM, ``dp=2, cp=4`` for long):
  every rank's microbatches run through one pre-LN transformer block (attention + 4x MLP) on the
  CPU, one thread, ``scaled_dot_product_attention`` over each packed segment, forward only. Token
  counts and hidden sizes are both divided by ``MEASURE_SCALE`` (16: backbone d=256, 4 heads;
  encoder d=96, 2 heads), which keeps each segment's attention/linear FLOPs ratio the same as
  the full-size model's. Causal attention is run as dense attention of the segment's queries
  over half as many keys (the same FLOPs; the CPU kernel barely skips masked blocks); a sequence
  sharded over k CP ranks runs, on each, its zig-zag shard of 2*ceil(L/2k) queries over k*ceil(L/2k)
  keys (ring-attention communication is not modelled). Each (rank, microbatch) is timed (min of
  ``--repeats``); step = ``40 * max_r t_enc[r] + 32 * sum_m max_r t[m, r]``, ranks of one CP group
  with identical work timed once. Hybrid plans' backbone equals backbone balancing's, so its
  backbone times are reused and only its encoder is run.

Prints the tables, writes ``benchmarks/results/balance.json`` and ``balance.png`` (per-rank step
cost of one step, before/after balancing, and speedup against context length). Exits 1 only if a
configuration failed to run.

    python benchmarks/balance.py
    python benchmarks/balance.py --quick --out /tmp/balance.json     # CI smoke
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import zlib  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from functools import lru_cache  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
import torchdata_overlord as ol  # noqa: E402
from torchdata_overlord.sim import SimulatedLoaders  # noqa: E402
from torchdata_overlord.sim.workloads import DISTRIBUTIONS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CONTEXTS = (4096, 8192, 16384, 32768)
DPS = (8, 64, 512)
MICROBATCHES = 8
FILL = 0.8                      # mean fill of a rank's 8 microbatches of ctx tokens
METHODS = {"greedy": "greedy", "kk": "karmarkar_karp"}
BACKBONE = ol.AttentionFlops(hidden=4096)
ENCODER = ol.EncoderCost(hidden=1536)
LAYERS = {"backbone": 32, "encoder": 40}
LONG_CP = 4
MEASURE_SCALE = 16
MEASURE = {"dp": 8, "ctx": 8192}
CHUNK = 1024


# -- workloads ---------------------------------------------------------------------------------
def coyo_captions(rng, n):
    """Coyo-like pairs: lognormal captions (98% <= 64 tokens), one image of skewed 16 px patch count."""
    text = np.clip(np.round(rng.lognormal(2.44, 0.817, n)), 2, 1024).astype(np.int64)
    long_side = np.clip(rng.lognormal(np.log(320), 0.45, n), 64, 1024)
    aspect = np.clip(rng.lognormal(0.0, 0.3, n), 1.0, 2.5)
    per = (np.ceil(long_side / 16) * np.ceil(long_side / aspect / 16)).astype(np.int64)
    return text, per[:, None]


PYTEXT_TAIL = 0.02           # share of pytext samples drawn from the Pareto tail


@lru_cache(maxsize=1)
def stdlib_lengths() -> np.ndarray:
    """Token counts of the standard library's modules under a sentencepiece BPE model trained on them."""
    import io
    import sysconfig
    import tempfile

    import sentencepiece as spm

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    cache = Path(tempfile.gettempdir()) / (f"overlord_pytext_{sys.version_info[0]}{sys.version_info[1]}_"
                                           f"{spm.__version__}_{len(files)}.npy")
    if cache.exists():
        return np.load(cache)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    lines = [line for t in texts[::7] for line in t.splitlines() if line.strip()][:200_000]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=8000,
                                   model_type="bpe", character_coverage=1.0, hard_vocab_limit=False, num_threads=1,
                                   minloglevel=2, input_sentence_size=200_000, shuffle_input_sentence=False)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    lengths = np.array([max(len(x), 1) for x in sp.encode(texts)], np.int64)
    tmp = cache.with_suffix(f".{os.getpid()}.npy")
    np.save(tmp, lengths)
    os.replace(tmp, cache)
    return lengths


def pytext(rng, n):
    """A real module's token count, or (``PYTEXT_TAIL`` of samples) a Pareto 1.1 length from 8k to 128k."""
    real = stdlib_lengths()
    text = np.clip(real[rng.integers(0, len(real), n)], 16, 131072)
    tail = rng.random(n) < PYTEXT_TAIL
    text[tail] = np.clip(8192 * (rng.pareto(1.1, int(tail.sum())) + 1), 8192, 131072).astype(np.int64)
    return text, None


@dataclass(frozen=True)
class Source:
    """A deterministic synthetic source (sample i's sizes depend on (seed, name, i) only), reporting
    backbone tokens = text + image placeholders; ``per_image`` recovers any sample's image sizes."""

    name: str
    gen: Callable
    seed: int = 0

    @lru_cache(maxsize=64)
    def _chunk(self, c: int):
        text, per = self.gen(np.random.default_rng([self.seed, zlib.crc32(self.name.encode()), c]), CHUNK)
        return text, per

    def _rows(self, start: int, n: int):
        chunks = [self._chunk(c) for c in range(start // CHUNK, (start + n - 1) // CHUNK + 1)] if n else []
        lo = start - (start // CHUNK) * CHUNK
        text = np.concatenate([c[0] for c in chunks])[lo:lo + n] if chunks else np.zeros(0, np.int64)
        per = None if not chunks or chunks[0][1] is None else np.concatenate([c[1] for c in chunks])[lo:lo + n]
        return text, per

    def samples(self, start: int, n: int) -> ol.BufferMeta:
        text, per = self._rows(start, n)
        index = np.arange(start, start + n)
        if per is None:
            return ol.BufferMeta(self.name, index, text)
        return ol.BufferMeta(self.name, index, text + per.sum(1), num_images=(per > 0).sum(1), patches=per.sum(1),
                             patches_sq=(per.astype(np.float64) ** 2).sum(1))

    def per_image(self, index) -> list[list[int]]:
        """Patch count of every image of each sample in ``index``."""
        out = []
        for i in np.asarray(index, np.int64).tolist():
            per = self._chunk(i // CHUNK)[1]
            out.append([] if per is None else [int(p) for p in per[i % CHUNK] if p > 0])
        return out


@dataclass(frozen=True)
class Workload:
    name: str
    source: Source
    images: bool
    cp: int
    description: str

    def mesh(self, dp: int) -> ol.ClientPlaceTree:
        mesh = ol.ClientPlaceTree(dp=dp, cp=self.cp)
        if self.images:
            mesh.attach("encoder", dp=mesh.world_size)
        return mesh

    def strategies(self) -> list[tuple[str, str, str]]:
        kinds = ["backbone", "hybrid"] if self.images else ["backbone", "cp"]
        return ([("vanilla", "vanilla", "arrival")] + [(f"{k}-{short}", k, m) for k in kinds for short, m in METHODS.items()]
                + [("lockstep-kk", "lockstep", "karmarkar_karp")])


WORKLOADS = {
    "captions": Workload("captions", Source("captions", coyo_captions), True, 1,
                         "coyo-like captions (lognormal text, 98% <= 64 tokens) + one image, 16 px patches"),
    "image_text": Workload("image_text", Source("image_text", DISTRIBUTIONS["image_text"]), True, 1,
                           "NaViT-like: 1-3 native-resolution images (14 px patches, skewed counts) + ~30-token captions"),
    "long": Workload("long", Source("long", DISTRIBUTIONS["long"]), False, LONG_CP,
                     "heavy-tailed long-context documents (Pareto 1.1, 1k..128k tokens)"),
    "pytext": Workload("pytext", Source("pytext", pytext), False, LONG_CP,
                       "real text: stdlib modules tokenized by a run-time sentencepiece BPE, + 2% Pareto 1.1 tail "
                       "(8k..128k tokens)"),
}


def shape(w: Workload, n: int = 200_000) -> dict:
    """The measured shape of a workload's size distribution (the figures the issue states)."""
    text, per = w.source._rows(0, n)
    out = {"samples": n}
    if per is None:
        t = np.sort(text)[::-1].astype(np.float64)
        sq = t ** 2
        out.update(mean_tokens=float(t.mean()), median_tokens=float(np.median(t)), max_tokens=int(t[0]),
                   top_1pct_share_of_sum_sq=float(sq[:n // 100].sum() / sq.sum()),
                   top_0_1pct_share_of_sum_sq=float(sq[:n // 1000].sum() / sq.sum()),
                   share_of_docs_over_32k=float((t > 32768).mean()))
        return out
    t = np.sort(text)[::-1]
    k = int(round(0.0162 * n))
    patches = per.sum(1)
    ps = np.sort(patches)[::-1]
    out.update(text_le_64=float((text <= 64).mean()), text_top_1_62pct_share=float(t[:k].sum() / t.sum()),
               text_mean=float(text.mean()), text_median=float(np.median(text)), text_max=int(t[0]),
               images_per_sample=float((per > 0).sum(1).mean()), patches_mean=float(patches.mean()),
               patches_median=float(np.median(patches)), patches_p99=float(np.percentile(patches, 99)),
               patches_max=int(ps[0]), patches_top_1_62pct_share=float(ps[:k].sum() / ps.sum()),
               backbone_tokens_mean=float((text + patches).mean()))
    return out


# -- strategies --------------------------------------------------------------------------------
def make_strategy(w: Workload, kind: str, method: str, ctx: int):
    src = w.source.name

    def strategy(g: ol.DGraph) -> ol.Plan:
        g = g.mix({src: 1.0})
        if kind == "cp":
            return (g.distribute("CP").cost(BACKBONE)
                    .balance(method, microbatches=MICROBATCHES, max_tokens=ctx, oversize="split").plan())
        text = (g.distribute("DP").cost(BACKBONE)
                .balance(method, microbatches=MICROBATCHES, max_tokens=ctx * w.cp, oversize="split",
                         level="lockstep" if kind == "lockstep" else "both"))
        if kind == "hybrid":
            images = g.view("image").distribute("DP", module="encoder").cost(ENCODER).balance(method, microbatches=1)
            return text.plan(encoder=images)
        return text.plan()
    return strategy


# -- per-rank costs and the simulated step --------------------------------------------------------
def per_rank(plan: ol.Plan, per_bucket: np.ndarray) -> np.ndarray:
    """Spread ``(..., buckets)`` values over ranks: each rank of a bucket gets an equal share."""
    out = np.zeros(per_bucket.shape[:-1] + (plan.mesh.world_size,))
    for b, ranks in enumerate(plan.buckets):
        out[..., list(ranks)] = per_bucket[..., b:b + 1] / len(ranks)
    return out


def encoder_per_rank(plan: ol.Plan, kind: str) -> np.ndarray | None:
    """Encoder cost per rank: the hybrid plan's encoder module, else each rank's own samples' images."""
    if kind == "hybrid":
        enc = plan.module("encoder")
        return per_rank(enc, enc.bin_costs().sum(0))
    if not plan.records.patches.any():
        return None
    e = plan.entries
    first = e["piece"] == 0
    costs = ENCODER(plan.records)[e["row"][first]]
    return per_rank(plan, np.bincount(e["bucket"][first], weights=costs, minlength=len(plan.buckets)))


def step_time(backbone: np.ndarray, encoder: np.ndarray | None) -> tuple[float, float]:
    """(lockstep step time, per-rank mean of the same work), layer-weighted FLOPs."""
    t = LAYERS["backbone"] * float(backbone.max(1).sum())
    mean = LAYERS["backbone"] * float(backbone.sum()) / backbone.shape[1]
    if encoder is not None:
        t += LAYERS["encoder"] * float(encoder.max())
        mean += LAYERS["encoder"] * float(encoder.sum()) / len(encoder)
    return t, mean


def analyse(plan: ol.Plan, kind: str) -> tuple[dict, np.ndarray, np.ndarray | None]:
    s = plan.stats
    backbone = per_rank(plan, plan.bin_costs())                  # (microbatches, ranks)
    encoder = encoder_per_rank(plan, kind)
    t, mean = step_time(backbone, encoder)
    e = plan.entries
    tok = e["tokens"].astype(np.float64)
    sharded = float(tok[e["nshards"] > 1].sum() / tok.sum()) if plan.axis == "cp" else (
        1.0 if max(len(b) for b in plan.buckets) > 1 else 0.0)
    out = {"max_over_mean": s["max_over_mean"], "lockstep_over_bound": s["lockstep_over_bound"],
           "microbatches": plan.n_microbatches, "step_flops": t, "step_over_mean": t / mean if mean else 1.0,
           "split": s["oversize"]["split"], "cp_sharded_token_fraction": sharded,
           "max_bin_tokens": s["max_bin_tokens"]}
    if encoder is not None:
        out["encoder_max_over_mean"] = float(encoder.max() / encoder.mean()) if encoder.mean() > 0 else 1.0
    return out, backbone, encoder


def global_batch(w: Workload, dp: int, ctx: int, mean_tokens: float) -> int:
    return max(1, int(round(FILL * dp * w.cp * MICROBATCHES * ctx / mean_tokens)))


def run_config(w: Workload, dp: int, ctx: int, steps: int, mean_tokens: float, keep: bool = False) -> dict:
    """Plan ``steps`` steps with every strategy on the same sampled batches; the figures' means."""
    mesh = w.mesh(dp)
    gb = global_batch(w, dp, ctx, mean_tokens)
    loaders = SimulatedLoaders([w.source], buffer_size=gb)
    strategies = w.strategies()
    planners = {label: ol.Planner(make_strategy(w, kind, method, ctx), mesh, gb, seed=0)
                for label, kind, method in strategies}
    acc = {label: [] for label, _, _ in strategies}
    plan_s = {label: 0.0 for label, _, _ in strategies}
    kept = None
    for step in range(steps):
        bufs = loaders.buffers()
        plans = {}
        for label, _, _ in strategies:
            t0 = time.perf_counter()
            plans[label] = planners[label].plan(bufs)
            plan_s[label] += time.perf_counter() - t0
        ref = np.sort(plans["vanilla"].records.index)
        for label, kind, _ in strategies:
            p = plans[label]
            if not np.array_equal(np.sort(p.records.index), ref):
                raise RuntimeError(f"step {step}: strategy {label} planned another sampled set than vanilla")
            e = p.entries
            first = np.bincount(e["row"][(e["piece"] == 0) & (e["shard"] == 0)], minlength=len(p.records))
            if (first != 1).any():
                raise RuntimeError(f"step {step}: strategy {label} lost or duplicated samples")
            fig, backbone, encoder = analyse(p, kind)
            acc[label].append(fig)
            if keep and step == 0:
                kept = kept or {}
                kept[label] = {"backbone": backbone, "encoder": encoder, "plan": p}
        loaders.consume(plans["vanilla"])
    base = sum(f["step_flops"] for f in acc["vanilla"])
    out = {}
    for label, kind, method in strategies:
        figs = acc[label]
        row = {"kind": kind, "method": method,
               **{k: float(np.mean([f[k] for f in figs])) for k in figs[0] if k not in ("step_flops", "max_bin_tokens")},
               "max_bin_tokens": int(max(f["max_bin_tokens"] for f in figs)),
               "token_cap": ctx if kind == "cp" else ctx * w.cp,
               "step_flops": float(np.mean([f["step_flops"] for f in figs])),
               "sim_speedup": base / sum(f["step_flops"] for f in figs), "plan_s": plan_s[label] / steps}
        out[label] = row
    res = {"workload": w.name, "dp": dp, "cp": w.cp, "world": mesh.world_size, "ctx": ctx, "global_batch": gb,
           "steps": steps, "strategies": out}
    return (res, kept) if keep else res


# -- measured: a small transformer block on the CPU -------------------------------------------------
class Block:
    """One pre-LN transformer block (attention + 4x GELU MLP), forward only, over packed segments."""

    def __init__(self, d: int, heads: int, seed: int = 0):
        import torch
        g = torch.Generator().manual_seed(seed)
        self.d, self.h = d, heads
        self.w = {k: torch.randn(*shape, generator=g) / shape[0] ** 0.5 for k, shape in
                  {"qkv": (d, 3 * d), "o": (d, d), "fc1": (d, 4 * d), "fc2": (4 * d, d)}.items()}

    def __call__(self, segments: list[tuple[int, int]]) -> None:
        """``segments``: (queries, keys) per packed segment; keys beyond the queries reuse them cyclically."""
        import torch
        import torch.nn.functional as F
        d, h = self.d, self.h
        T = sum(q for q, _ in segments)
        x = torch.randn(T, d)
        y = F.layer_norm(x, (d,)) @ self.w["qkv"]
        q, k, v = y.split(d, dim=1)
        outs, off = [], 0
        for nq, nk in segments:
            qs = q[off:off + nq].view(nq, h, d // h).transpose(0, 1)
            ks, vs = k[off:off + nq], v[off:off + nq]
            if nk != nq:
                idx = torch.arange(nk) % nq
                ks, vs = ks[idx], vs[idx]
            ks = ks.reshape(nk, h, d // h).transpose(0, 1)
            vs = vs.reshape(nk, h, d // h).transpose(0, 1)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1).reshape(nq, d))
            off += nq
        x = x + torch.cat(outs) @ self.w["o"]
        x = x + F.gelu(F.layer_norm(x, (d,)) @ self.w["fc1"]) @ self.w["fc2"]


def backbone_segments(tokens: list[int], shards: list[int]) -> list[tuple[int, int]]:
    """Causal segments of scaled length L over k ranks: 2*ceil(L/2k) queries over k*ceil(L/2k) keys."""
    segs = []
    for t, k in zip(tokens, shards):
        L = max(1, round(t / MEASURE_SCALE))
        c = -(-L // (2 * k))
        segs.append((2 * c, k * c))
    return segs


def timed(block: Block, segments: list[tuple[int, int]], repeats: int) -> float:
    import torch
    if not segments:
        return 0.0
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            block(segments)
            best = min(best, time.perf_counter() - t0)
    return best


def measure_backbone(plan: ol.Plan, block: Block, repeats: int) -> np.ndarray:
    """Seconds per (microbatch, rank); ranks of a bucket with identical work (CP shards) timed once."""
    t = np.zeros((plan.n_microbatches, plan.mesh.world_size))
    for b, ranks in enumerate(plan.buckets):
        k = len(ranks) if plan.axis == "dp" else None
        for m, items in enumerate(plan.bucket_microbatches(b)):
            shards = [k if k is not None else it.nshards for it in items]
            t[m, list(ranks)] = timed(block, backbone_segments([it.tokens for it in items], shards), repeats)
    return t


def measure_encoder(plan: ol.Plan, kind: str, w: Workload, block: Block, repeats: int) -> np.ndarray:
    """Seconds of each rank's images (bidirectional attention per image)."""
    src = w.source
    R = plan.mesh.world_size
    t = np.zeros(R)
    if kind == "hybrid":
        enc = plan.module("encoder")
        for b, ranks in enumerate(enc.buckets):
            items = [it for mb in enc.bucket_microbatches(b) for it in mb]
            per = [p for ps in src.per_image([it.index for it in items]) for p in ps]
            segs = [(max(1, round(p / MEASURE_SCALE)),) * 2 for p in per]
            t[list(ranks)] = timed(block, segs, repeats)
        return t
    for b, ranks in enumerate(plan.buckets):
        items = [it for mb in plan.bucket_microbatches(b) for it in mb if it.piece == 0]
        per = [p for ps in src.per_image([it.index for it in items]) for p in ps]
        segs = [(max(1, round(p / MEASURE_SCALE)),) * 2 for p in per]
        t[list(ranks)] = timed(block, segs, repeats)
    return t


def run_measured(w: Workload, steps: int, repeats: int, mean_tokens: float, labels: list[str] | None) -> dict:
    """Plan like ``run_config`` on 8 ranks at ctx 8k, run every rank's work through the block, time it."""
    import torch
    torch.set_num_threads(1)
    dp = MEASURE["dp"] // w.cp
    ctx = MEASURE["ctx"]
    mesh = w.mesh(dp)
    gb = global_batch(w, dp, ctx, mean_tokens)
    loaders = SimulatedLoaders([w.source], buffer_size=gb)
    strategies = [s for s in w.strategies() if labels is None or s[0] in labels or s[0] == "vanilla"]
    planners = {label: ol.Planner(make_strategy(w, kind, method, ctx), mesh, gb, seed=0)
                for label, kind, method in strategies}
    bb_block = Block(BACKBONE.hidden // MEASURE_SCALE, 4)
    enc_block = Block(ENCODER.hidden // MEASURE_SCALE, 2, seed=1)
    bb_block([(64, 32)])                                         # warm up the kernels
    enc_block([(16, 16)])
    meas = {label: [] for label, _, _ in strategies}
    sim = {label: [] for label, _, _ in strategies}
    reused = {}
    for _ in range(steps):
        bufs = loaders.buffers()
        plans = {label: planners[label].plan(bufs) for label, _, _ in strategies}
        bb_times = {}
        for label, kind, method in strategies:
            p = plans[label]
            twin = f"backbone-{label.split('-')[1]}" if kind == "hybrid" else None
            if twin in bb_times and all(np.array_equal(p.entries[c], plans[twin].entries[c])
                                        for c in ("row", "bucket", "mb", "tokens")):
                t_bb = bb_times[twin]
                reused[label] = twin
            else:
                t_bb = measure_backbone(p, bb_block, repeats)
            bb_times[label] = t_bb
            t_enc = measure_encoder(p, kind, w, enc_block, repeats) if w.images else None
            meas[label].append(step_time(t_bb, t_enc)[0])
            sim[label].append(step_time(per_rank(p, p.bin_costs()), encoder_per_rank(p, kind))[0])
        loaders.consume(plans["vanilla"])
    rows = {}
    for label, kind, method in strategies:
        rows[label] = {"kind": kind, "method": method, "step_s": float(np.mean(meas[label])),
                       "speedup": sum(meas["vanilla"]) / sum(meas[label]),
                       "sim_speedup": sum(sim["vanilla"]) / sum(sim[label]),
                       "backbone_reused_from": reused.get(label)}
    return {"workload": w.name, "dp": dp, "cp": w.cp, "world": mesh.world_size, "ctx": ctx, "global_batch": gb,
            "steps": steps, "repeats": repeats, "strategies": rows}


# -- output ----------------------------------------------------------------------------------------
def best_label(strats: dict) -> str:
    return max((k for k in strats if k != "vanilla"), key=lambda k: strats[k]["sim_speedup"])


def print_tables(rows: list[dict]) -> None:
    for w in WORKLOADS.values():
        mine = [r for r in rows if r["workload"] == w.name]
        if not mine:
            continue
        labels = [s[0] for s in w.strategies()]
        print(f"\n{w.name}: {w.description}; mesh dp=DP" + (f" x cp={w.cp}" if w.cp > 1 else "")
              + "\n  each cell: backbone per-rank max/mean | lockstep/bound | simulated speedup over vanilla"
              + (" | encoder max/mean" if w.images else ""))
        head = f"{'DP':>4} {'ctx':>6} {'batch':>7} |" + "|".join(f"{lab:^{27 if w.images else 21}}" for lab in labels)
        print(head)
        for r in mine:
            cells = []
            for lab in labels:
                s = r["strategies"][lab]
                cell = f"{s['max_over_mean']:5.2f} {s['lockstep_over_bound']:5.2f} {s['sim_speedup']:5.2f}x"
                if w.images:
                    cell += f" {s['encoder_max_over_mean']:5.2f}"
                cells.append(f" {cell} ")
            print(f"{r['dp']:>4} {r['ctx'] // 1024:>5}k {r['global_batch']:>7} |" + "|".join(cells))


def summarise(rows: list[dict], measured: list[dict]) -> dict:
    """The best strategy's simulated speedup, averaged like the paper's Fig. 13 text."""
    out = {"by_context": {}, "by_workload": {}, "measured": {}}
    for ctx in sorted({r["ctx"] for r in rows}):
        sp = [r["strategies"][best_label(r["strategies"])]["sim_speedup"] for r in rows if r["ctx"] == ctx]
        out["by_context"][str(ctx)] = {"mean_best_sim_speedup": float(np.mean(sp)), "max": float(np.max(sp))}
    for w in WORKLOADS:
        mine = [r for r in rows if r["workload"] == w]
        if not mine:
            continue
        by = {}
        for lab in mine[0]["strategies"]:
            sp = [r["strategies"][lab]["sim_speedup"] for r in mine]
            by[lab] = {"mean_sim_speedup": float(np.mean(sp)), "max_sim_speedup": float(np.max(sp)),
                       "mean_max_over_mean": float(np.mean([r["strategies"][lab]["max_over_mean"] for r in mine])),
                       "mean_lockstep_over_bound": float(np.mean([r["strategies"][lab]["lockstep_over_bound"]
                                                                  for r in mine]))}
        out["by_workload"][w] = by
    # Karmarkar-Karp against greedy on the same batches: lockstep/bound ratio per (workload, DP, ctx, kind)
    pairs = []
    for r in rows:
        for lab, s in r["strategies"].items():
            if s["method"] == "karmarkar_karp" and f"{s['kind']}-greedy" in r["strategies"]:
                g = r["strategies"][f"{s['kind']}-greedy"]
                pairs.append({"workload": r["workload"], "dp": r["dp"], "ctx": r["ctx"], "kind": s["kind"],
                              "kk_lockstep_over_bound": s["lockstep_over_bound"],
                              "greedy_lockstep_over_bound": g["lockstep_over_bound"],
                              "kk_over_greedy": s["lockstep_over_bound"] / g["lockstep_over_bound"],
                              "kk_max_over_mean": s["max_over_mean"], "greedy_max_over_mean": g["max_over_mean"]})
    worst = max(pairs, key=lambda q: q["kk_over_greedy"]) if pairs else None
    out["kk_vs_greedy"] = {"pairs": pairs, "worst": worst}
    for m in measured:
        b = max((k for k in m["strategies"] if k != "vanilla"), key=lambda k: m["strategies"][k]["speedup"])
        out["measured"][m["workload"]] = {"best": b, "speedup": m["strategies"][b]["speedup"],
                                          "sim_speedup": m["strategies"][b]["sim_speedup"]}
    return out


def plot(path: Path, snapshots: dict, rows: list[dict], measured: list[dict], dp_curves: tuple) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker.NullFormatter below)

    fig, axes = plt.subplots(2, 3, figsize=(20, 8.5))
    for ax, (name, snap) in zip(axes.flat, snapshots.items()):
        after = snap["after"]
        x, top = None, 0.0
        for off, label, color in ((-0.2, "vanilla", "#d62728"), (0.2, after, "#1f77b4")):
            s = snap["strategies"][label]
            bb = LAYERS["backbone"] * s["backbone"].sum(0) / 1e15
            enc = (LAYERS["encoder"] * s["encoder"] / 1e15) if s["encoder"] is not None else np.zeros_like(bb)
            x = np.arange(len(bb))
            ax.bar(x + off, bb, 0.4, color=color, label=f"{label}: backbone")
            if enc.any():
                ax.bar(x + off, enc, 0.4, bottom=bb, color=color, alpha=0.45, hatch="//", label=f"{label}: encoder")
            step = step_time(s["backbone"], s["encoder"])[0] / 1e15
            ax.axhline(step, color=color, ls="--", lw=1.2, label=f"{label}: lockstep step time")
            top = max(top, step, float((bb + enc).max()))
        ax.set_ylim(0, top * 1.3)
        ax.set(title=f"{name}: per-rank cost of one step (DP {snap['dp']}"
               + (f" x CP {snap['cp']}" if snap["cp"] > 1 else "") + f", ctx {snap['ctx'] // 1024}k)",
               xlabel="rank", ylabel="PFLOPs per step (layer-weighted)")
        if x is not None and len(x) <= 16:
            ax.set_xticks(x)
        ax.legend(fontsize=7, ncol=3, loc="upper center")
    for ax in axes.flat[len(snapshots):-1]:
        ax.axis("off")
    ax = axes.flat[-1]
    colors = {"captions": "#2ca02c", "image_text": "#9467bd", "long": "#ff7f0e", "pytext": "#8c564b"}
    for dp, style in zip(dp_curves, ("o-", "s--", "^:")):
        for w in WORKLOADS:
            mine = sorted((r for r in rows if r["workload"] == w and r["dp"] == dp), key=lambda r: r["ctx"])
            if mine:
                ax.plot([r["ctx"] // 1024 for r in mine],
                        [r["strategies"][best_label(r["strategies"])]["sim_speedup"] for r in mine],
                        style, color=colors.get(w), label=f"{w}, DP {dp} (best strategy, simulated)")
    for m in measured:
        b = max((k for k in m["strategies"] if k != "vanilla"), key=lambda k: m["strategies"][k]["speedup"])
        ax.plot([m["ctx"] // 1024], [m["strategies"][b]["speedup"]], "*", ms=14, color=colors.get(m["workload"]),
                label=f"{m['workload']} measured ({b}, {m['world']} ranks)")
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set(title="step-time speedup over vanilla (stars: measured on the CPU)",
           xlabel="context length (tokens)", ylabel="speedup", xticks=[4, 8, 16, 32], xticklabels=["4k", "8k", "16k", "32k"])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few configurations and steps (CI smoke)")
    ap.add_argument("--out", type=Path, default=RESULTS / "balance.json")
    ap.add_argument("--steps", type=int, default=None, help="steps per simulated configuration (default 4, quick 2)")
    ap.add_argument("--measure-steps", type=int, default=None, help="steps per measured configuration (default 3, quick 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timings per (rank, microbatch), min kept (default 3, quick 2)")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    load_start = round(os.getloadavg()[0], 2)
    steps = args.steps or (2 if args.quick else 4)
    msteps = args.measure_steps or (1 if args.quick else 3)
    repeats = args.repeats or (2 if args.quick else 3)
    contexts = (4096, 32768) if args.quick else CONTEXTS
    dps = (8, 64) if args.quick else DPS
    measure_labels = ["backbone-kk", "hybrid-kk", "cp-kk"] if args.quick else None
    errors: dict[str, str] = {}

    shapes = {name: shape(w) for name, w in WORKLOADS.items()}
    mean_tokens = {name: s.get("backbone_tokens_mean", s.get("mean_tokens")) for name, s in shapes.items()}
    print("workload shapes (first 200k samples):")
    for name, s in shapes.items():
        print(f"  {name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items()))

    rows, snapshots = [], {}
    snap_dp, snap_ctx = MEASURE["dp"], (4096 if args.quick else MEASURE["ctx"])
    for name, w in WORKLOADS.items():
        for dp in dps:
            for ctx in contexts:
                key = f"{name}/dp{dp}/ctx{ctx}"
                t0 = time.perf_counter()
                try:
                    want = dp == snap_dp and ctx == snap_ctx
                    res = run_config(w, dp, ctx, steps, mean_tokens[name], keep=want)
                    if want:
                        res, kept = res
                        snapshots[name] = {"dp": dp, "cp": w.cp, "ctx": ctx, "after": best_label(res["strategies"]),
                                           "strategies": kept}
                    res["seconds"] = time.perf_counter() - t0
                    rows.append(res)
                except Exception as e:   # noqa: BLE001 (recorded; the exit status says a run failed)
                    errors[key] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                print(f"  {key}: {'failed: ' + errors[key][:200] if key in errors else 'done'} "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
    print_tables(rows)

    measured = []
    print(f"\nmeasured on the CPU ({MEASURE['dp']} ranks, ctx {MEASURE['ctx'] // 1024}k, tokens and hidden sizes / "
          f"{MEASURE_SCALE}, {msteps} step(s), min of {repeats} timing(s) per microbatch):")
    for name, w in WORKLOADS.items():
        t0 = time.perf_counter()
        try:
            m = run_measured(w, msteps, repeats, mean_tokens[name], measure_labels)
            measured.append(m)
            cells = "  ".join(f"{lab} {s['step_s'] * 1e3:.0f} ms {s['speedup']:.2f}x (sim {s['sim_speedup']:.2f}x)"
                              for lab, s in m["strategies"].items())
            print(f"  {name} (dp {m['dp']}, cp {m['cp']}, batch {m['global_batch']}): {cells} "
                  f"[{time.perf_counter() - t0:.1f} s]", flush=True)
        except Exception as e:   # noqa: BLE001
            errors[f"measured/{name}"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            print(f"  {name}: failed: {errors[f'measured/{name}'][:200]}")

    summary = summarise(rows, measured)
    print("\nbest strategy's simulated speedup over vanilla, by context (mean over workloads and DP sizes):")
    print("  " + "  ".join(f"{int(c) // 1024}k {v['mean_best_sim_speedup']:.2f}x (max {v['max']:.2f}x)"
                           for c, v in summary["by_context"].items()))
    for w, by in summary["by_workload"].items():
        print(f"  {w}: " + "  ".join(f"{lab} {v['mean_sim_speedup']:.2f}x" for lab, v in by.items()))
    worst = summary["kk_vs_greedy"]["worst"]
    if worst:
        print(f"karmarkar_karp vs greedy, lockstep/bound: worst {worst['kk_over_greedy']:.4f}x greedy's "
              f"({worst['workload']} {worst['kind']} dp {worst['dp']} ctx {worst['ctx'] // 1024}k: "
              f"{worst['kk_lockstep_over_bound']:.3f} vs {worst['greedy_lockstep_over_bound']:.3f})")
        for q in summary["kk_vs_greedy"]["pairs"]:
            if q["kind"] == "cp" and q["dp"] == 64:
                print(f"  {q['workload']} cp dp 64 ctx {q['ctx'] // 1024}k: kk {q['kk_lockstep_over_bound']:.3f} "
                      f"greedy {q['greedy_lockstep_over_bound']:.3f} ({q['kk_over_greedy']:.4f}x)")

    plot_path = args.out.with_suffix(".png")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        plot(plot_path, {k: snapshots[k] for k in WORKLOADS if k in snapshots}, rows, measured, (dps[0], dps[-1]))
        print(f"wrote {plot_path}")
    except Exception as e:   # noqa: BLE001
        errors["plot"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()

    payload = {
        "benchmark": "balance", "quick": args.quick,
        "config": {"contexts": list(contexts), "dps": list(dps), "microbatches": MICROBATCHES, "fill": FILL,
                   "steps": steps, "methods": METHODS, "backbone_cost": repr(BACKBONE), "encoder_cost": repr(ENCODER),
                   "layers": LAYERS, "long_cp": LONG_CP, "oversize": "split",
                   "step_time": "layers_enc * max_r E_r + layers_bb * sum_m max_r B[m, r] (FLOPs); speedup = "
                                "sum of vanilla step times / sum of the strategy's"},
        "workloads": {name: {"description": w.description, "images": w.images, "cp": w.cp,
                             "strategies": [s[0] for s in w.strategies()], "shape": shapes[name],
                             "mean_backbone_tokens": mean_tokens[name]} for name, w in WORKLOADS.items()},
        "simulated": rows,
        "measured": {"config": {**MEASURE, "ranks": MEASURE["dp"], "scale": MEASURE_SCALE,
                                "backbone_block": {"d": BACKBONE.hidden // MEASURE_SCALE, "heads": 4},
                                "encoder_block": {"d": ENCODER.hidden // MEASURE_SCALE, "heads": 2},
                                "steps": msteps, "repeats": repeats, "threads": 1,
                                "note": f"token counts and hidden sizes divided by {MEASURE_SCALE}; forward only; "
                                        "causal attention as dense attention over half the keys; CP shards without "
                                        "communication"},
                     "rows": measured},
        "summary": summary, "plot": str(plot_path), "errors": errors,
    }
    write_results(args.out, payload, started=started, load_start=load_start)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

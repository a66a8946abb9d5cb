"""Mixture-driven scaling (issue 13, paper 5.2): a curriculum moves the mixture from a cheap text source
to an expensive image source; autoscaling against a static placement sized for the start and a static
placement sized for the worst case (the paper's over-provisioning baseline).

Data (real files, written once under a cache folder and reused while the configuration matches its
manifest): ``text``, web-like prose (Zipfian pseudo-English from :mod:`torchdata_overlord.sim.corpus`,
lognormal lengths around ~1,500 tokens) tokenized by ``Tokenize`` with a sentencepiece model trained on
the same text, 20 row groups; ``image``, captioned JPEGs drawn with pillow, sides 512-2048 px (median
~1,024: photos as high-resolution image-caption sets hold them), that ``ImageText`` decodes
(torchvision) and resizes (antialiased) to at most 224 px in whole 14 px patches, 48 row groups of 16,
so the source splits into several data-parallel loader actors. The image is the expensive source: its
read and transform cost about six times the text's per sample (the profiles, measured before the runs
and journaled beside the corpus, are in the JSON). Smaller JPEGs (256-512 px) decode
in ~1 ms here, less than the runtime's own per-sample cost, and a placement could not matter.

Strategy (:class:`Curriculum`, module level: it pickles to the role processes): ``mix(Linear({"text":
0.9, "image": 0.1}, {"text": 0.1, "image": 0.9}, steps=ramp))``, then ``hold`` more steps at the end
weights; distribute over DP=2, attention-FLOPs cost, greedy balance into 2 microbatches. Images enter
the sequence as ``patches`` copies of the ``<image>`` token.

Configurations, all ``OverlordLoader(runtime="rpc", prefetch=2, rank=None)`` with placements from
``auto_partition(profiles, weights, cores=--cores, ..., w_actor=1)`` (every worker block an actor of
its own, so a source's share shows as its number of data-parallel loader actors, as in
``tests/test_autoscaling.py``):

* ``autoscale``: the placement sized for the start weights and ``autoscale=AutoScaler(interval=5,
  window=10, patience=2)``: every 5 steps the Planner re-partitions (same profiles and budget) on the
  sources' shares of the last 10 steps and reshards a source whose actor count changed for 2 intervals
  running (the new actors start, load the merged state and catch up while the old ones serve; the old
  retire once the new are at most a step behind: :mod:`torchdata_overlord.runtime.reshard`);
* ``static_start``: the same placement, ``autoscale=False``;
* ``static_worst``: a placement sized for the end weights (image-heavy), ``autoscale=False``.

The budget, ``--cores 4``: after the Planner's and the two constructors' estimated shares the loaders
get 3 worker blocks, so the start placement gives the text 2 actors and the image 1, the worst-case
placement the image 3 and the text 1 (inline), and the autoscaler has room to move actors (on a
2-core budget the partition has a single block and the image never gains an actor). Every placement
uses 4 role processes. This machine has 2 cores, shared with other jobs: the configurations differ in
how many transform threads each source has, so in how the CPU the machine gives is split between
the sources, not in how much CPU there is.

The trainer: each step ``next()`` (timed: the trainer's wait for data), then a simulated model step of a
fixed ``--model-ms`` measured from ``next()``'s return, during which the trainer hashes the step (every
tensor of every rank's batch, blake2b, to check that the configurations produce identical batches) and
then sleeps until the step's end. A sleep, not a busy loop: a GPU's step leaves the host's CPU to the
data plane, and a busy loop would take one of the 2 cores from it. A run that keeps up runs at global
batch / model step samples/s and every wait shows as a lower rate. Every ``stats_every`` steps a
thread of the trainer's asks the Planner for each source's loader actors (its ``roles()``, where
``stats()["loader_parts"]`` comes from: a full ``stats()`` asks every role and holds the loader's lock
meanwhile, so the producer could not submit). Global batch 24 and a 400 ms model step (60 samples/s):
at the start mixture well under a core of this machine's work, which every placement feeds; at the end
mixture the image needs a good part of a core of reading and decoding, what the single image thread of
the start placement can give while it gets a core to itself, where three image threads have headroom
(and a larger share of a contended machine). The model step was 250 ms (96 samples/s) until the
reshard became non-blocking: at that load, on this shared 2-core machine, even the worst-case
placement stalled (17 and 38 stall steps in its two rounds), so no stall of the autoscaling run could
be told from the machine's; 400 ms leaves the data plane the headroom a placement that keeps up has
(short runs at 400 ms: a few waits of 1-4 ms in every configuration, the machine's noise).

Measured per run (each run its own process: RPC starts once per process and each run starts from the
same footprint): samples/s over the run, over the ramp, over the held end mixture and per window of
``window`` steps; stall steps (``next()`` waited more than 1 ms; target 0 with prefetch 2) and the steps
whose batch was not yet built when ``next()`` was called; mean/p99/max wait; CPU-seconds of the
whole process tree (utime + stime from ``/proc/<pid>/stat`` of the trainer, the fork server, the
resource tracker and every role process, each labelled with its roles; from before the loader to the
last step, and over the steps after warm-up); the sum of anonymous PSS (``Pss_Anon + Pss_Shmem``, as
``memory.py``) over the tree every ``--interval`` s, minus the trainer's before the loader: peak, steady
(median after warm-up) and over the held end mixture; the loader actors per source at every step
(exact, from the placement and ``stats()["planner"]["reshards"]``; sampled as above, and
``stats()["loader_parts"]`` at the end must equal the last sample); the reshards (the step after which
each was decided and the first step its new actors served, the seconds between and those the switch
blocked the Planner, and the longest wait within two steps of the switch and from the decision on) and
the autoscaler's decisions. The rounds interleave the configurations
(a, b, c, then c, b, a), so machine noise shows; the load average is recorded.

Prints a table, writes ``benchmarks/results/autoscaling.json`` and ``autoscaling.png``; exits non-zero if
a run failed, left a process behind or the configurations' batches differ, never because a figure
disappointed.

    python benchmarks/autoscaling.py                 # 2 rounds of 3 runs of 210 steps, ~12 minutes
    python benchmarks/autoscaling.py --quick --out /tmp/autoscaling.json     # smoke size
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")          # one intra-op thread in the trainer and every role

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import building, process_tree, reap, write_results  # noqa: E402

import torchdata_overlord as ol  # noqa: E402
from torchdata_overlord.sim.fault_run import digest  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
CORPUS_VERSION = 1
START, END = {"text": 0.9, "image": 0.1}, {"text": 0.1, "image": 0.9}
MESH = {"dp": 2}
MICROBATCHES, MAX_TOKENS = 2, 16384
PATCH, MAX_SIDE = 14, 224
STALL_MS = 1.0
CONFIGS = {"autoscale": "autoscaling (sized for the start + AutoScaler)",
           "static_start": "static, sized for the start",
           "static_worst": "static, sized for the worst case (end weights)"}
SIZES = {
    "full": {"corpus": {"text": {"rows": 4000, "files": 2, "row_group_rows": 200, "median_tokens": 1500},
                        "image": {"rows": 768, "files": 4, "row_group_rows": 16,
                                  "side": {"min": 512, "median": 1024, "max": 2048}}},
             "ramp": 150, "hold": 60, "warmup": 10, "rounds": 2, "global_batch": 24, "model_ms": 400,
             "window": 10, "stats_every": 10, "scaler": {"interval": 5, "window": 10, "patience": 2}},
    "quick": {"corpus": {"text": {"rows": 400, "files": 1, "row_group_rows": 50, "median_tokens": 1500},
                         "image": {"rows": 96, "files": 2, "row_group_rows": 8,
                                   "side": {"min": 512, "median": 1024, "max": 2048}}},
              "ramp": 16, "hold": 44, "warmup": 3, "rounds": 1, "global_batch": 16, "model_ms": 50,
              "window": 4, "stats_every": 4, "scaler": {"interval": 2, "window": 4, "patience": 1}},
}


class Curriculum:
    """Text to images over ``ramp`` steps (then the end weights), distribute over DP, greedy balance.
    Module level, so it pickles to the role processes."""

    def __init__(self, ramp: int):
        self.ramp = int(ramp)

    def __call__(self, g):
        return (g.mix(ol.Linear(START, END, steps=self.ramp)).distribute("DP").cost(ol.attention_flops)
                .balance("greedy", microbatches=MICROBATCHES, max_tokens=MAX_TOKENS, oversize="split").plan())


def image_weight(step: int, ramp: int) -> float:
    return ol.Linear(START, END, steps=ramp).weights(step)["image"]


# ------------------------------------------------------------------------------ the corpus

def build_corpus(root: Path, spec: dict, seed: int = 0) -> dict:
    """The two sources in real Parquet files under ``root`` and a sentencepiece model trained on the
    text (reused while ``spec`` matches the manifest); the manifest."""
    import numpy as np

    from torchdata_overlord.sim import corpus as C

    config = {"version": CORPUS_VERSION, "seed": seed, **spec}
    try:
        manifest = json.loads((root / "manifest.json").read_text())
        if manifest["config"] == config and all((root / f["path"]).is_file() for s in manifest["sources"].values()
                                                for f in s["files"]):
            return {**manifest, "root": str(root)}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if root.exists():
        foreign = [p.name for p in root.iterdir() if p.name not in {"manifest.json", "tokenizer.model",
                                                                     "tokenizer.vocab", "web", "caps", "profiles"}]
        if foreign:
            raise RuntimeError(f"{root} holds files this benchmark did not write ({foreign[:3]}); pass another --root")
    t0 = time.perf_counter()
    with building(root) as tmp:
        rng = np.random.default_rng([seed, 13])
        t, im = spec["text"], spec["image"]
        tokens = np.clip(rng.lognormal(np.log(t["median_tokens"]), 0.6, t["rows"]), 64, 6000)
        texts = C._prose(rng, np.maximum(1, tokens / C._TOKENS_PER_WORD).astype(np.int64), paragraphs=True)
        n = im["rows"]
        caption_tokens = np.clip(rng.lognormal(np.log(16), 0.5, n), 3, 96)
        captions = C._prose(rng, np.maximum(1, caption_tokens / C._TOKENS_PER_WORD).astype(np.int64),
                            paragraphs=False, sentence_words=20.0, final_stop=False)
        s = im["side"]
        side = rng.lognormal(np.log(s["median"]), 0.25, n)
        aspect = np.exp(rng.normal(0.0, 0.3, n))
        widths = np.clip(np.round(side * np.sqrt(aspect)), s["min"], s["max"]).astype(np.int64)
        heights = np.clip(np.round(side / np.sqrt(aspect)), s["min"], s["max"]).astype(np.int64)
        images = C._gen_images(rng, widths, heights, rng.integers(75, 96, n))
        sources = {
            # the corpus module's writer: folders named after its sources of the same kind (web, caps)
            "text": C._write_source(tmp, "web", {"id": [f"text-{i:06d}" for i in range(len(texts))], "text": texts},
                                    t),
            "image": C._write_source(tmp, "caps", {"id": [f"image-{i:06d}" for i in range(n)], "image": images,
                                                    "text": captions, "width": widths.astype(np.int32),
                                                    "height": heights.astype(np.int32)}, im)}
        lines = [ln for doc in texts[:1500] + captions for ln in doc.split("\n") if ln.strip()]
        C._train_spm(tmp / "tokenizer", lines, 2000)
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(tmp / "tokenizer.model"))
        manifest = {"config": config, "sources": sources, "spm": "tokenizer.model",
                    "image_token_id": sp.piece_to_id(C.IMAGE_TOKEN),
                    "image_bytes_mean": round(float(np.mean([len(b) for b in images])), 0),
                    "image_side_px": {"median": float(np.median(np.maximum(widths, heights))),
                                      "min": int(min(widths.min(), heights.min())),
                                      "max": int(max(widths.max(), heights.max()))},
                    "text_tokens_median_target": t["median_tokens"],
                    "build_s": round(time.perf_counter() - t0, 1)}
        (tmp / "manifest.json").write_text(json.dumps(manifest))
    print(f"corpus: text {t['rows']} docs, image {n} JPEGs ({sources['image']['row_groups']} row groups) written to "
          f"{root} in {manifest['build_s']} s", flush=True)
    return {**manifest, "root": str(root)}


def make_sources(corpus: dict, seed: int = 0) -> list:
    root = Path(corpus["root"])
    spm = str(root / corpus["spm"])
    files = {name: [str(root / f["path"]) for f in s["files"]] for name, s in corpus["sources"].items()}
    return [ol.ParquetSource("text", files["text"], ol.Tokenize(spm, field="text"), seed=seed),
            ol.ParquetSource("image", files["image"], ol.ImageText(spm, image_field="image", text_field="text",
                                                                 patch=PATCH, max_side=MAX_SIDE), seed=seed)]


def placements(corpus: dict, cores: float, global_batch: int) -> tuple[dict, dict, dict]:
    """The sources' profiles and the placements sized for the start and for the end weights, on the same
    budget. The profiles are journaled beside the corpus: the journal keeps one entry per source name,
    and the quick and full corpora name their sources alike."""
    from torchdata_overlord.scaling import ProfileJournal, auto_partition, profile_sources

    profiles = profile_sources(make_sources(corpus), ProfileJournal(Path(corpus["root"]) / "profiles"))
    kw = dict(cores=cores, memory_bytes=None, constructors=MESH["dp"], global_batch=global_batch, w_actor=1)
    start, worst = auto_partition(profiles, START, **kw), auto_partition(profiles, END, **kw)
    return {n: p.to_dict() for n, p in profiles.items()}, start.to_dict(), worst.to_dict()


# ------------------------------------------------------------------------------ measuring (child process)

def tree_cpu(pid: int) -> dict[int, float]:
    """CPU-seconds (user + system) of ``pid`` and each descendant."""
    from torchdata_overlord.runtime.procstats import process_cpu_seconds

    got = {p: process_cpu_seconds(p) for p in process_tree(pid)}
    return {p: c for p, c in got.items() if c is not None}


def anon_mib(pid: int) -> float | None:
    from torchdata_overlord.runtime.procstats import smaps_rollup

    got = smaps_rollup(pid)
    return got.get("Pss_Anon", 0.0) + got.get("Pss_Shmem", 0.0) if got else None


class Sampler(threading.Thread):
    """Every ``interval`` s: the step the trainer is at, the sum of anonymous PSS over the process tree
    and its CPU-seconds so far."""

    def __init__(self, interval: float):
        super().__init__(name="pss-sampler", daemon=True)
        self.interval, self.step, self.rows, self.pids = interval, -1, [], set()
        self._done = threading.Event()
        self.t0 = time.perf_counter()

    def sweep(self) -> None:
        me = os.getpid()
        pids = process_tree(me)
        self.pids.update(pids)
        pss = [anon_mib(p) for p in pids]
        cpu = tree_cpu(me)
        self.rows.append({"t": round(time.perf_counter() - self.t0, 3), "step": self.step,
                          "pss_mib": round(sum(x for x in pss if x is not None), 1),
                          "cpu_s": round(sum(cpu.values()), 2), "processes": len(pids)})

    def run(self) -> None:
        while not self._done.is_set():
            self.sweep()
            self._done.wait(self.interval)

    def finish(self) -> None:
        if not self._done.is_set():
            self._done.set()
            self.join(timeout=30)
            self.sweep()


def samples_of(item: dict) -> int:
    keys = set()
    for out in item.values():
        for mb in out["microbatches"] or ():
            keys.update(mb["sample_keys"])
    return len(keys)


def stats(loader, learned: list) -> dict:
    """``loader.stats()``, working around a library bug: after a reshard in ``runtime="rpc"`` the trainer's
    transport is never told on which worker the new loader actors live (the Planner's ``roles()["where"]``
    lists recovery's replacements only), so ``stats()`` fails with ``ConfigError: no actor named
    'loader:<source>#<n>'``. Then the new actors' workers are taken from the Planner's reshard records and
    taught to the transport, and ``stats()`` asked again; ``learned`` counts how often it was needed."""
    from torchdata_overlord.errors import ConfigError

    try:
        return loader.stats()
    except ConfigError as e:
        if "no actor named" not in str(e):
            raise
        job = loader._job
        info = job._ask_planner(lambda p: p.stats())
        names = info["roles"]["loaders"]
        where = {names[k]: w for r in info["reshards"] for k, w in (r.get("where") or {}).items()
                 if k in names and w is not None}
        job.transport.learn(where)
        learned.append(sorted(where))
        return loader.stats()


def ask_parts(loader, step: int) -> dict:
    """Each source's loader actors now: what ``stats()["loader_parts"]`` reads (the Planner's ``roles()``),
    asked alone, off the trainer's thread: a full ``stats()`` asks every role and holds the loader's
    lock meanwhile, so the producer could not submit."""
    q0 = time.perf_counter()
    got = loader._job._ask_planner(lambda p: p.roles())["parts"]
    return {"step": step, "parts": dict(got), "ms": round(1e3 * (time.perf_counter() - q0), 1)}


def run_child(cfg: dict) -> dict:
    """One configuration: the trainer loop of the module docstring; what it measured."""
    import torch

    from torchdata_overlord.scaling import AutoScaler, Placement

    torch.set_num_threads(1)
    if cfg.get("log"):
        import logging
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(message)s")
    me = os.getpid()
    before_pss, cpu_before = anon_mib(me), tree_cpu(me)
    sampler = Sampler(cfg["interval"])
    placement = Placement.from_dict(cfg["placement"])
    scale = AutoScaler(**cfg["scaler"]) if cfg["autoscale"] else False
    steps, model_s = cfg["ramp"] + cfg["hold"], cfg["model_ms"] / 1e3
    waits, ready, ends, samples, digests, parts, overrun, learned, work = [], [], [], [], [], [], [], [], []
    from concurrent.futures import ThreadPoolExecutor

    asker = ThreadPoolExecutor(1, thread_name_prefix="parts-sampler")
    sampler.start()
    t_start = time.perf_counter()
    loader = ol.OverlordLoader(make_sources(cfg["corpus"], cfg["seed"]), Curriculum(cfg["ramp"]),
                               ol.ClientPlaceTree(**MESH), rank=None, global_batch=cfg["global_batch"], seq_len=None,
                               seed=cfg["seed"], runtime="rpc", prefetch=2, placement=placement, autoscale=scale,
                               image_token_id=cfg["corpus"]["image_token_id"], timeout=120, startup_timeout=120)
    try:
        with loader:
            t_built = time.perf_counter()
            it = iter(loader)
            cpu_warm = None
            for step in range(steps):
                sampler.step = step
                if step == cfg["warmup"]:
                    cpu_warm = tree_cpu(me)
                head = list(loader._ahead)[:1]
                ready.append(bool(head) and head[0].done())
                w0 = time.perf_counter()
                item = next(it)
                t1 = time.perf_counter()
                waits.append(t1 - w0)
                ends.append(t1 - t_start)
                h = hashlib.blake2b(digest_size=16)
                digest(item, h)
                digests.append(h.hexdigest())
                samples.append(samples_of(item))
                del item
                if step % cfg["stats_every"] == 0 or step == steps - 1:
                    parts.append(asker.submit(ask_parts, loader, step))
                work.append(time.perf_counter() - t1)
                left = t1 + model_s - time.perf_counter()
                overrun.append(left < 0)
                if left > 0:
                    time.sleep(left)
            cpu_end = tree_cpu(me)
            parts = [f.result(120) for f in parts]
            q0 = time.perf_counter()
            final = stats(loader, learned)
            stats_ms = round(1e3 * (time.perf_counter() - q0), 1)
            # stats() reports the parts roles() does: the last sample's, or, when a reshard the Planner made
            # for a step past the run switched since (it plans ahead), those of an ask after it
            after = ask_parts(loader, steps)["parts"]
            assert final["loader_parts"] in (parts[-1]["parts"], after), (final["loader_parts"], parts[-1], after)
            roles = {a: int(p) for a, p in final["roles"].items()}
        sampler.finish()
    finally:
        asker.shutdown(wait=True, cancel_futures=True)
        sampler.finish()
    total_cpu = sum(c - cpu_before.get(p, 0.0) for p, c in cpu_end.items())
    window_cpu = sum(c - cpu_warm.get(p, 0.0) for p, c in cpu_end.items())
    per_process = {str(p): round(c - cpu_before.get(p, 0.0), 2) for p, c in cpu_end.items()}
    planner = final["planner"]
    return {"config": cfg["name"], "round": cfg["round"], "steps": steps, "warmup": cfg["warmup"], "trainer_pid": me,
            "construct_s": round(t_built - t_start, 2), "waits_ms": [round(1e3 * w, 3) for w in waits],
            "ready": ready, "ends_s": [round(e, 4) for e in ends], "samples": samples, "digests": digests,
            "overrun_steps": int(sum(overrun[cfg["warmup"]:])), "parts_sampled": parts,
            "trainer_work_ms": {"mean": round(1e3 * statistics.fmean(work), 2), "max": round(1e3 * max(work), 1)},
            "reshards": planner.get("reshards", []), "stats_workaround": len(learned),
            "final_stats_ms": stats_ms,
            "decisions": (planner.get("autoscaler") or {}).get("decisions", []),
            "cpu_s": {"total": round(total_cpu, 2), "measured_steps": round(window_cpu, 2),
                      "per_process": per_process},
            "trainer_before_mib": round(before_pss or 0.0, 1), "sweeps": sampler.rows, "roles": roles,
            "pids_seen": sorted(sampler.pids | set(cpu_end)), "placement": placement.render()}


def child(cfg: dict, timeout: float) -> dict:
    """Run one configuration in a fresh process; its result, after checking every process it saw is gone."""
    with tempfile.TemporaryDirectory(prefix="overlord-autoscale-") as tmp:
        (Path(tmp) / "cfg.json").write_text(json.dumps(cfg))
        out = Path(tmp) / "out.json"
        proc = subprocess.run([sys.executable, __file__, "--child", str(Path(tmp) / "cfg.json"), str(out)],
                              capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
        if cfg.get("log"):
            Path(cfg["log"]).write_text(proc.stderr)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{cfg['name']} run failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
        rep = json.loads(out.read_text())
    left = rep["left_behind"] = reap(rep["pids_seen"])
    if left:
        raise RuntimeError(f"{cfg['name']} run left processes behind: {left} (killed)")
    return rep


# ------------------------------------------------------------------------------ summaries (parent)

def actors_by_step(placement: dict, reshards: list[dict], steps: int) -> dict[str, list[int]]:
    """Each source's loader actors serving each step: the placement's, changed from each successful
    reshard's step (the first step the new actors serve)."""
    out = {}
    for s, sp in placement["sources"].items():
        k, row = sp["actors"], []
        changes = {r["step"]: r["to"] for r in reshards if r["source"] == s and r.get("ok")}
        for step in range(steps):
            k = changes.get(step, k)
            row.append(k)
        out[s] = row
    return out


def summarize(rep: dict, cfg: dict, placement: dict) -> dict:
    w, win, B = rep["warmup"], cfg["window"], cfg["global_batch"]
    waits, ends, samples = rep["waits_ms"], rep["ends_s"], rep["samples"]
    meas = waits[w:]
    rate = []
    for a in range(w, rep["steps"], win):
        b = min(a + win, rep["steps"])
        dt = ends[b - 1] - ends[a - 1]
        rate.append({"step": a, "to": b, "samples_per_s": round(sum(samples[a:b]) / dt, 1) if dt > 0 else None,
                     "image_weight": round(image_weight((a + b - 1) / 2, cfg["ramp"]), 3),
                     "stalls": sum(x > STALL_MS for x in waits[a:b])})
    sweeps = rep["sweeps"]
    base = rep["trainer_before_mib"]
    pss = [s["pss_mib"] - base for s in sweeps]
    steady = [s["pss_mib"] - base for s in sweeps if s["step"] >= w] or pss
    hold = [s["pss_mib"] - base for s in sweeps if s["step"] >= cfg["ramp"]] or steady
    dur = ends[-1] - ends[w - 1]
    stalled = [i for i in range(w, rep["steps"]) if waits[i] > STALL_MS]
    ramp = min(cfg["ramp"], rep["steps"] - 1)

    def rate_between(a: int, b: int) -> float:          # steps a..b-1 (each step's time from the end of the last)
        return round(sum(samples[a:b]) / (ends[b - 1] - ends[a - 1]), 1)

    return {"samples_per_s": round(sum(samples[w:]) / dur, 1),
            "samples_per_s_ramp": rate_between(w, ramp), "samples_per_s_hold": rate_between(ramp, rep["steps"]),
            "target_samples_per_s": round(B / (cfg["model_ms"] / 1e3), 1),
            "seconds": round(dur, 2), "construct_s": rep["construct_s"],
            "stall_steps": len(stalled), "stall_steps_ramp": sum(i < cfg["ramp"] for i in stalled),
            "stall_steps_hold": sum(i >= cfg["ramp"] for i in stalled),
            "not_ready_steps": sum(not r for r in rep["ready"][w:]),
            "not_ready_stall_steps": sum(1 for i in stalled if not rep["ready"][i]),
            "wait_mean_ms": round(statistics.fmean(meas), 3),
            "wait_p99_ms": round(sorted(meas)[min(len(meas) - 1, int(0.99 * len(meas)))], 3),
            "wait_max_ms": round(max(meas), 1), "wait_total_s": round(sum(meas) / 1e3, 2),
            "overrun_steps": rep["overrun_steps"], "trainer_work_ms": rep["trainer_work_ms"],
            "cpu_s": rep["cpu_s"]["total"], "cpu_s_measured_steps": rep["cpu_s"]["measured_steps"],
            "cpu_ms_per_sample": round(1e3 * rep["cpu_s"]["measured_steps"] / max(sum(samples[w:]), 1), 3),
            "pss_mib": {"peak": round(max(pss), 1), "steady": round(statistics.median(steady), 1),
                        "hold": round(statistics.median(hold), 1)},
            "rate": rate, "actors": actors_by_step(placement, rep["reshards"], rep["steps"]),
            "reshards": [{**x, "longest_wait_near_ms": max(waits[max(0, x["step"] - 2):x["step"] + 3]),
                          # from the decision to two steps after the switch (the new actors serve from "step")
                          "longest_wait_since_decision_ms": max(waits[x["decision_step"] + 1:x["step"] + 3] or [0.0])}
                         for x in rep["reshards"]],
            "decisions": rep["decisions"], "parts_sampled": rep["parts_sampled"],
            "stats_workaround": rep["stats_workaround"], "pids_seen": rep["pids_seen"],
            "processes": len(set(rep["roles"].values())), "waits_ms": waits, "ready": rep["ready"],
            "sweeps": sweeps, "cpu_by_process": cpu_by_process(rep)}


def cpu_by_process(rep: dict) -> list[dict]:
    """CPU-seconds of each process of the run, with the roles it hosted at the end (the trainer, the
    role processes, and helpers: the fork server and multiprocessing's resource tracker)."""
    hosted: dict[int, list[str]] = {}
    for role, pid in rep["roles"].items():
        hosted.setdefault(pid, []).append(role)
    trainer = rep["trainer_pid"]
    return [{"pid": int(p), "cpu_s": c, "what": "trainer" if int(p) == trainer else
             ", ".join(sorted(hosted.get(int(p), []))) or "helper"}
            for p, c in sorted(rep["cpu_s"]["per_process"].items(), key=lambda kv: -kv[1])]


def observations(results: dict, place: dict) -> list[str]:
    """Facts worth a line beside the table: role processes left without an actor, several loader
    actors of one source in one process, and how often ``stats()`` needed the workaround."""
    out = []
    for name, runs in results.items():
        for r in runs:
            hosts = [p["what"] for p in r["cpu_by_process"] if p["what"] not in ("trainer", "helper")]
            empty = place[name]["processes"] - len(hosts)
            shared = [w for w in hosts if sum(a.startswith("loader:image") for a in w.split(", ")) > 1]
            if empty > 0 or shared:
                out.append(f"{name}, round {r['round']}: at the end {empty} of the {place[name]['processes']} role "
                           f"processes host{'s' if empty == 1 else ''} no actor"
                           + (f"; one hosts {shared[0]}" if shared else "") + ".")
            if r["stats_workaround"]:
                out.append(f"{name}, round {r['round']}: loader.stats() after a reshard failed (no actor named "
                           f"'loader:<source>#<n>' in the trainer's transport) {r['stats_workaround']} time(s); the "
                           f"benchmark taught the transport the new actors' workers from the Planner's reshard "
                           f"records and asked again.")
    return out


def compare_streams(reps: list[dict]) -> dict:
    """Whether every run produced the same batches at every step (their digests)."""
    ref = reps[0]["digests"]
    diffs = {}
    for r in reps[1:]:
        bad = [i for i, (a, b) in enumerate(zip(ref, r["digests"])) if a != b]
        if bad or len(r["digests"]) != len(ref):
            diffs[f"{r['config']}#{r['round']}"] = bad[:5] or [min(len(ref), len(r["digests"]))]
    h = hashlib.blake2b(digest_size=16)
    for d in ref:
        h.update(d.encode())
    return {"identical": not diffs, "runs_compared": len(reps), "steps": len(ref), "stream_digest": h.hexdigest(),
            "first_differences": diffs, "reference": f"{reps[0]['config']}#{reps[0]['round']}"}


def mean_of(runs: list[dict], key) -> float:
    return round(statistics.fmean(key(r) for r in runs), 2)


def print_table(results: dict, cfg: dict) -> None:
    print(f"\nglobal batch {cfg['global_batch']}, model step {cfg['model_ms']:.0f} ms (target "
          f"{cfg['global_batch'] / cfg['model_ms'] * 1e3:.0f} samples/s), {cfg['ramp']} ramp + {cfg['hold']} held "
          f"steps, figures after {cfg['warmup']} warm-up steps; one line per run")
    print(f"{'configuration':>14} {'rd':>2} {'samples/s':>9} {'(hold)':>6} {'stalls':>6} {'(hold)':>6} {'not rdy':>7} "
          f"{'wait mean':>9} {'max':>7} {'CPU-s':>7} {'CPU ms/smp':>10} {'PSS peak':>8} {'steady':>7} {'hold':>7} "
          f"{'image actors':>12} {'reshards':>8}")
    for name, runs in results.items():
        for r in runs:
            im = r["actors"]["image"]
            print(f"{name:>14} {r['round']:>2} {r['samples_per_s']:>9.1f} {r['samples_per_s_hold']:>6.1f} "
                  f"{r['stall_steps']:>6} {r['stall_steps_hold']:>6} {r['not_ready_steps']:>7} "
                  f"{r['wait_mean_ms']:>8.1f}m "
                  f"{r['wait_max_ms']:>6.0f}m {r['cpu_s']:>7.1f} {r['cpu_ms_per_sample']:>10.2f} "
                  f"{r['pss_mib']['peak']:>8.0f} {r['pss_mib']['steady']:>7.0f} {r['pss_mib']['hold']:>7.0f} "
                  f"{im[0]:>5} -> {im[-1]:<4} {len(r['reshards']):>8}")


def plot(path: Path, results: dict, cfg: dict) -> None:
    """Top: samples/s per window of steps (each run; the image weight on a second axis); middle: each
    step's wait in ``next()``; bottom: the image source's loader actors over steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"autoscale": "tab:green", "static_start": "tab:red", "static_worst": "tab:blue"}
    styles = ["-", "--", ":"]
    fig, (ax, wx, bx) = plt.subplots(3, 1, figsize=(11, 9.5), sharex=True,
                                     gridspec_kw={"height_ratios": [3, 1.6, 1.2]})
    steps, bound = cfg["ramp"] + cfg["hold"], cfg["global_batch"] / cfg["model_ms"] * 1e3
    for name, runs in results.items():
        for i, r in enumerate(runs):
            xs = [(w["step"] + w["to"] - 1) / 2 for w in r["rate"]]
            ax.plot(xs, [w["samples_per_s"] for w in r["rate"]], styles[i % 3], color=colours[name], marker="o", ms=3,
                    label=f"{CONFIGS[name]}, round {r['round']}: {r['samples_per_s']:.0f} samples/s, "
                          f"{r['stall_steps']} stall steps")
            wx.plot(range(steps), [max(w, 1e-2) for w in r["waits_ms"]], ".", color=colours[name], ms=3, alpha=0.6)
            bx.step(range(steps), r["actors"]["image"], styles[i % 3], where="post", color=colours[name],
                    label=f"{name}, round {r['round']}")
    ax.axhline(bound, color="grey", lw=0.8, ls="--")
    ax.text(0, bound, " global batch / model step", va="bottom", fontsize=8, color="grey")
    for x in (ax, wx, bx):
        x.axvline(cfg["ramp"], color="grey", lw=0.6)
        x.axvspan(0, cfg["warmup"], color="grey", alpha=0.08)
        x.grid(True, lw=0.3)
    ax.set(ylabel=f"samples/s (windows of {cfg['window']} steps)", ylim=(0, 1.15 * bound))
    ax.set_title(f"curriculum text -> image over {cfg['ramp']} steps, then held {cfg['hold']}; global batch "
                 f"{cfg['global_batch']}, model step {cfg['model_ms']:.0f} ms, prefetch 2, partition budget "
                 f"{cfg['cores']:g} cores (shaded: warm-up)", fontsize=10)
    tw = ax.twinx()
    tw.plot(range(steps), [image_weight(s, cfg["ramp"]) for s in range(steps)], color="black", lw=1, alpha=0.5)
    tw.set(ylabel="image weight (black line)", ylim=(0, 1.15))
    ax.legend(fontsize=7, loc="lower left")
    wx.axhline(STALL_MS, color="black", lw=0.6, ls=":")
    wx.set(yscale="log", ylabel="next() wait (ms)")
    bx.set(xlabel="step", ylabel="image loader actors")
    bx.set_yticks(range(1, 1 + max(max(r["actors"]["image"]) for runs in results.values() for r in runs)))
    bx.legend(fontsize=7, loc="upper left", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke size: small corpus, few steps, one round")
    ap.add_argument("--out", type=Path, default=RESULTS / "autoscaling.json")
    ap.add_argument("--root", type=Path, default=None, help="corpus folder (default: beside the demo corpus cache)")
    ap.add_argument("--cores", type=float, default=4.0, help="the partition's CPU budget (every configuration)")
    ap.add_argument("--model-ms", type=float, default=None, help="the simulated model step")
    ap.add_argument("--global-batch", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--ramp", type=int, default=None, help="steps of the curriculum's ramp")
    ap.add_argument("--hold", type=int, default=None, help="steps at the end weights after the ramp")
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), help="run just these configurations")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between PSS/CPU sweeps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", action="store_true", help="keep each run's log (INFO) beside --out")
    ap.add_argument("--child", nargs=2, metavar=("CFG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        rep = run_child(json.loads(Path(args.child[0]).read_text()))
        Path(args.child[1]).write_text(json.dumps(rep))
        return 0

    from torchdata_overlord.sim.corpus import default_corpus_root

    size = "quick" if args.quick else "full"
    cfg = {k: v for k, v in SIZES[size].items() if k != "corpus"}
    cfg.update(cores=args.cores, model_ms=args.model_ms or cfg["model_ms"],
               global_batch=args.global_batch or cfg["global_batch"], rounds=args.rounds or cfg["rounds"],
               ramp=args.ramp or cfg["ramp"], hold=cfg["hold"] if args.hold is None else args.hold,
               interval=args.interval, seed=args.seed, stall_ms=STALL_MS, mesh=MESH, microbatches=MICROBATCHES,
               max_tokens=MAX_TOKENS, patch=PATCH, max_side=MAX_SIDE, start=START, end=END)
    root = args.root or default_corpus_root().parent / f"autoscaling-corpus-{size}"
    t_all, load_start = time.perf_counter(), round(os.getloadavg()[0], 2)
    corpus = build_corpus(Path(root).expanduser().absolute(), SIZES[size]["corpus"], args.seed)
    profiles, start, worst = placements(corpus, args.cores, cfg["global_batch"])
    place = {"autoscale": start, "static_start": start, "static_worst": worst}
    from torchdata_overlord.scaling import Placement
    print(f"profiles: " + ", ".join(f"{n} {1e3 * p['transform_s']:.2f} ms transform + {1e3 * p['read_s']:.3f} ms "
                                    f"read per sample, {p['units']} row groups" for n, p in profiles.items()))
    print("placement sized for the start:\n" + Placement.from_dict(start).render())
    print("placement sized for the worst case:\n" + Placement.from_dict(worst).render(), flush=True)
    order = args.only or list(CONFIGS)
    runs = [(name, rnd + 1) for rnd in range(cfg["rounds"]) for name in (order if rnd % 2 == 0 else order[::-1])]
    raw, results, errors = [], {name: [] for name in order}, {}
    for name, rnd in runs:
        t0 = time.perf_counter()
        c = {**cfg, "name": name, "round": rnd, "corpus": corpus, "placement": place[name],
             "autoscale": name == "autoscale",
             "log": str(args.out.with_name(f"{args.out.stem}-{name}-{rnd}.log")) if args.log else None}
        try:
            rep = child(c, timeout=300 if args.quick else 900)
            raw.append(rep)
            s = summarize(rep, cfg, place[name])
            results[name].append({"round": rnd, **s})
            print(f"  {name} round {rnd}: {s['samples_per_s']:.1f} samples/s, {s['stall_steps']} stall steps, "
                  f"{s['cpu_s']:.1f} CPU-s, image actors {s['actors']['image'][0]} -> {s['actors']['image'][-1]}, "
                  f"{len(s['reshards'])} reshards ({time.perf_counter() - t0:.0f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 (recorded; the exit status says a run failed)
            errors[f"{name}#{rnd}"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    streams = compare_streams(raw) if raw else {"identical": False}
    if raw and not streams["identical"]:
        errors["streams"] = f"the configurations' batches differ: {streams['first_differences']}"
    print_table(results, cfg)
    print(f"\nidentical batches in all {streams.get('runs_compared', 0)} runs: {streams['identical']}"
          + (f" (stream digest {streams['stream_digest']})" if streams["identical"] else
             f": {streams.get('first_differences')}"))
    summary = {name: {"samples_per_s": mean_of(rs, lambda r: r["samples_per_s"]),
                      "stall_steps": mean_of(rs, lambda r: r["stall_steps"]),
                      "wait_mean_ms": mean_of(rs, lambda r: r["wait_mean_ms"]),
                      "cpu_s": mean_of(rs, lambda r: r["cpu_s"]),
                      "pss_peak_mib": mean_of(rs, lambda r: r["pss_mib"]["peak"]),
                      "pss_steady_mib": mean_of(rs, lambda r: r["pss_mib"]["steady"]),
                      "image_actors_end": rs[0]["actors"]["image"][-1]}
               for name, rs in results.items() if rs}
    plot_path = args.out.with_suffix(".png")
    if all(results.values()):
        plot(plot_path, results, cfg)
        print(f"plot: {plot_path}")
    out = {"benchmark": "autoscaling", "quick": args.quick, "config": cfg, "labels": CONFIGS,
           "corpus": {k: v for k, v in corpus.items() if k != "sources"} | {
               "row_groups": {n: s["row_groups"] for n, s in corpus["sources"].items()},
               "rows": {n: s["rows"] for n, s in corpus["sources"].items()}},
           "profiles": profiles, "placements": {"start": start, "worst": worst},
           "placement_text": {"start": Placement.from_dict(start).render(),
                              "worst": Placement.from_dict(worst).render()},
           "order": [f"{n}#{r}" for n, r in runs], "results": results, "summary": summary,
           "identical_batches": streams, "notes": observations(results, place), "errors": errors,
           "plot": str(plot_path) if all(results.values()) else None}
    write_results(args.out, out, started=t_all, load_start=load_start)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

"""One OverlordLoader(runtime="rpc") job with injected failures, in its own process (RPC starts once
per process); writes what the trainer saw: a digest of every step's batches for every rank, how long
each ``next()`` waited, stall counts, the recovery events, the loader's state at a chosen step, and
each role process's CPU time and memory. The fault tests and ``benchmarks/fault_recovery.py`` run it.

    python -m torchdata_overlord.sim.fault_run CONFIG.json OUT.json

CONFIG: corpus root, number of sources (2: web+caps; 10: partitions of the four corpus sources),
steps, prefetch, trainer work per step (matmuls, not sleeps), spares, call timeout, ``n_workers`` or
``placement`` (a :class:`~torchdata_overlord.scaling.Placement`'s ``to_dict()``; neither: the default,
``"auto"``), and ``faults``:
``[{"step": k, "kill"|"freeze"|"corrupt": [roles or checkpoint keys], "spare": [spare indices], "thaw": true}]``
applied right after the trainer consumed step k (step -1: before the first step, the roles up) (``thaw``: every process
frozen so far continues; ``skip_missing``: a kill of a role that serves
nowhere at that moment is reported, not an error); ``roles_at[k]`` is every role's pid just before.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import torch

import torchdata_overlord as ol
from torchdata_overlord.runtime import faults
from torchdata_overlord.runtime.procstats import process_cpu_seconds
from torchdata_overlord.runtime.transport import ActorDied
from torchdata_overlord.scaling import Placement
from torchdata_overlord.sim.corpus import build_demo_corpus
from torchdata_overlord.sources import ParquetSource
from torchdata_overlord.transforms import ImageText, Tokenize

class Strategy:
    """Equal mixture of the named sources, balanced over DP (module level: it pickles)."""

    def __init__(self, names):
        self.names = list(names)

    def __call__(self, g):
        return (g.mix(ol.Constant({n: 1.0 for n in self.names})).distribute("DP").cost(ol.attention_flops)
                .balance("greedy", microbatches=2, max_tokens=4096, oversize="split"))


def source_names(n: int) -> list[str]:
    """The names of an ``n``-source run's sources (their loaders are ``loader:<name>``)."""
    return ["web", "caps"] if n == 2 else [f"s{i}" for i in range(n)]


def make_sources(corpus, n: int) -> list:
    def one(name, kind, seed):
        if kind == "caps":
            t = ImageText(corpus.spm_model, image_field="image", text_field="text", patch=14, max_side=112)
        else:
            t = Tokenize(corpus.spm_model, field=corpus.text_fields[kind])
        return ParquetSource(name, corpus.sources[kind], t, seed=seed)
    names = source_names(n)
    if n == 2:
        return [one(name, name, 0) for name in names]           # web and caps themselves
    kinds = ["web", "code", "long", "caps"]
    return [one(name, kinds[i % 4], i) for i, name in enumerate(names)]


def digest(x, h=None):
    """sha256 over every tensor's bytes, shape and dtype and every scalar, in a fixed order."""
    top = h is None
    h = h or hashlib.sha256()
    if isinstance(x, torch.Tensor):
        h.update(f"T{x.dtype}{tuple(x.shape)}".encode())
        h.update(x.detach().contiguous().reshape(-1).numpy().tobytes())
    elif isinstance(x, dict):
        for k in sorted(x, key=str):
            h.update(f"K{k}".encode())
            digest(x[k], h)
    elif isinstance(x, (list, tuple)):
        h.update(f"L{len(x)}".encode())
        for v in x:
            digest(v, h)
    else:
        h.update(f"V{x!r}".encode())
    return h.hexdigest() if top else None


def work(n: int) -> None:
    a = torch.ones(192, 192)
    for _ in range(n):
        a = torch.tanh(a @ a / 192)


def kill(loader, step: int, roles: list, spares: list, skip_missing: bool) -> list[dict]:
    """SIGKILL ``roles`` and spare processes ``spares`` at once (every pid found before any dies); the
    events. ``skip_missing``: a role that serves nowhere now (a shadow being re-created, a role whose
    process already died unnoticed) or a spare already dead is reported as skipped instead of failing."""
    found, events = [], []
    for role in roles:
        try:
            found.append((role, faults.role_pid(loader, role)))
        except (ol.ConfigError, ActorDied) as e:
            if not skip_missing:
                raise
            events.append({"step": step, "skipped": role, "why": f"{type(e).__name__}: {e}"[:200]})
    for role, pid in found:
        os.kill(pid, signal.SIGKILL)
        events.append({"step": step, "killed": role, "pid": pid})
    for i in spares:
        try:
            events.append({"step": step, "killed": f"spare {i}", "pid": faults.kill_spare(loader, i)})
        except ProcessLookupError as e:
            if not skip_missing:
                raise
            events.append({"step": step, "skipped": f"spare {i}", "why": f"already dead ({e})"})
    return events


def main(cfg_path: str, out_path: str) -> None:
    cfg = json.load(open(cfg_path))
    torch.set_num_threads(1)
    corpus = build_demo_corpus(cfg["root"], scale="test", seed=0)
    ft = ol.FaultTolerance(checkpoint_dir=cfg["ckpt"], shadows=cfg.get("shadows", True),
                           snapshot_every=cfg.get("snapshot_every", 5), call_timeout=cfg.get("call_timeout", 10),
                           recovery_timeout=cfg.get("recovery_timeout", 60))
    out = {"digests": [], "events": [], "error": None, "roles_at": {}}
    by_step = {f["step"]: f for f in cfg.get("faults", [])}
    sources = make_sources(corpus, cfg["sources"])
    loader = ol.OverlordLoader(sources, Strategy([s.name for s in sources]), ol.ClientPlaceTree(dp=2), rank=None,
                               global_batch=cfg.get("global_batch", 8), seq_len=None,
                               image_token_id=corpus.image_token_id, runtime="rpc", prefetch=cfg.get("prefetch", 2),
                               spares=cfg.get("spares", 2), fault_tolerance=ft, timeout=120,
                               n_workers=cfg.get("n_workers"),
                               placement=Placement.from_dict(cfg["placement"]) if cfg.get("placement") else "auto")
    frozen = []
    t0 = time.monotonic()
    try:
        with loader:
            early = by_step.get(-1, {})
            if early.get("kill"):                # before the first step: the Planner has no request yet
                out["events"] += kill(loader, -1, early["kill"], [], cfg.get("skip_missing"))
            for step, batch in zip(range(cfg["steps"]), loader):
                out["digests"].append(digest(batch))
                work(cfg.get("work", 0))
                f = by_step.get(step)
                if f:
                    out["roles_at"][str(step)] = loader.stats()["roles"]
                    for key in f.get("corrupt", []):
                        out["events"].append({"step": step, "corrupted": key,
                                              "version": faults.corrupt_newest(cfg["ckpt"], key)})
                    if f.get("kill") or f.get("spare"):
                        out["events"] += kill(loader, step, f.get("kill", []), f.get("spare", []), cfg.get("skip_missing"))
                    if f.get("thaw"):            # the frozen processes wake up (their roles replaced by now)
                        for pid in frozen:
                            faults.thaw(pid)
                            out["events"].append({"step": step, "thawed": pid})
                    for role in f.get("freeze", []):
                        pid = faults.freeze_role(loader, role)
                        frozen.append(pid)
                        out["events"].append({"step": step, "frozen": role, "pid": pid})
                if cfg.get("state_at") == step:
                    out["state"] = loader.state_dict()
            stats = loader.stats()
            out["stalls"] = stats["stalls"]
            out["fetch_wait"] = stats["fetch_wait"]
            out["waits_ms"] = [round(1000 * w, 3) for w in loader._waits]
            out["cpu_s"] = {str(pid): process_cpu_seconds(pid) for pid in set(stats["roles"].values())}
            out["recoveries"] = stats["planner"]["recoveries"]
            out["client_faults"] = stats["client"]["faults"]
            out["roles"] = stats["roles"]
            out["role_recovery"] = stats.get("role_recovery")
            out["spares"] = stats["spares"]
            out["processes"] = {str(k): v for k, v in stats["processes"].items()}
            out["placement"] = stats["placement"]
    except Exception as e:                       # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        for pid in frozen:                       # let a frozen worker see its parent's exit and go
            try:
                faults.thaw(pid)
            except ProcessLookupError:
                pass
    out["seconds"] = time.monotonic() - t0
    out["pid"] = os.getpid()
    json.dump(out, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

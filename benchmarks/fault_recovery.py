"""Uninterrupted feeding under failures (issue 5, the shape of the paper's Fig. 16).

Every run is ``torchdata_overlord.sim.fault_run`` in its own process: ``OverlordLoader(runtime="rpc",
rank=None)`` over the test-scale demo corpus with ``FaultTolerance`` (checkpoints, shadows), one
process per role plus spares, and a trainer that does ~``--work-ms`` of matmuls per step (as a GPU
step would, on this 2-core machine) between ``next()`` calls. Per step we record how long ``next()``
waited. Scenarios:

* ``planner_p2`` / ``planner_p4``: the Planner killed (SIGKILL) every 15 steps from step 5, prefetch 2
  vs 4: each kill makes the trainer's client start a new Planner on a spare, which restores from the
  checkpoint store and rewinds the roles;
* ``loaders_p2``: 10 sources (2 with ``--quick``, where the 2-source failure-free run is its reference too),
  half of their loaders killed at once at step 35: shadows are promoted;
* ``shadows_on`` / ``shadows_off``: no failures, as many sources: the memory (PSS) and CPU time of the
  shadow processes against all role processes.

For each failure run: stall steps (``next()`` waited for a step a failure held up), the longest wait,
each recovery's time, and whether the stream equals the failure-free run (digests of every batch).
Prints a table, writes ``benchmarks/results/fault_recovery.json`` and ``fault_recovery.png``.

    python benchmarks/fault_recovery.py
    python benchmarks/fault_recovery.py --quick --out /tmp/f.json     # CI smoke
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent


def run(cfg: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="overlord-fault-") as tmp:
        cfg = {**cfg, "ckpt": str(Path(tmp) / "ckpt")}
        (Path(tmp) / "cfg.json").write_text(json.dumps(cfg))
        out = Path(tmp) / "out.json"
        proc = subprocess.run([sys.executable, "-m", "torchdata_overlord.sim.fault_run", str(Path(tmp) / "cfg.json"),
                               str(out)], capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"run failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
        rep = json.loads(out.read_text())
    if rep["error"]:
        raise RuntimeError(f"run reported: {rep['error']}")
    return rep


def calibrate_work(ms: float) -> int:
    """Matmul rounds of ``fault_run.work`` that take about ``ms`` on this machine (one thread)."""
    import torch

    from torchdata_overlord.sim.fault_run import work
    torch.set_num_threads(1)
    work(5)
    t0 = time.perf_counter()
    work(50)
    per = (time.perf_counter() - t0) / 50
    return max(1, round(ms / 1000 / per))


def summarise(rep: dict, kill_steps: list[int], reference: list[str] | None) -> dict:
    waits = rep["waits_ms"]
    warm = waits[3:] if len(waits) > 3 else waits
    quiet = sorted(w for i, w in enumerate(waits) if i >= 3 and not any(k < i <= k + 3 for k in kill_steps))
    recoveries = rep["recoveries"] + [{"kind": "client", **r} for r in rep["client_faults"]["recoveries"]]
    return {"steps": len(waits), "waits_ms": waits, "stall_steps": rep["stalls"],
            "max_wait_ms": max(warm) if warm else None,
            "median_wait_ms_away_from_failures": quiet[len(quiet) // 2] if quiet else None,
            "recoveries": recoveries, "reissued_requests": rep["client_faults"]["reissued"],
            "same_stream_as_no_failure": None if reference is None else rep["digests"] == reference,
            "kill_steps": kill_steps, "seconds": rep["seconds"]}


def shadow_cost(rep: dict) -> dict:
    roles, procs, cpu = rep["roles"], rep["processes"], rep["cpu_s"]
    shadow_pids = {str(p) for a, p in roles.items() if a.startswith("shadow:")}
    role_pids = {str(p) for p in roles.values()}
    pss = {p: (procs.get(p) or {}).get("pss_mib") or 0.0 for p in role_pids}
    return {"role_processes": len(role_pids), "shadow_processes": len(shadow_pids),
            "pss_all_roles_mib": round(sum(pss.values()), 1),
            "pss_shadows_mib": round(sum(pss[p] for p in shadow_pids), 1),
            "pss_without_shadows_mib": round(sum(v for p, v in pss.items() if p not in shadow_pids), 1),
            "cpu_all_roles_s": round(sum(cpu.get(p) or 0 for p in role_pids), 2),
            "cpu_shadows_s": round(sum(cpu.get(p) or 0 for p in shadow_pids), 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few steps (CI smoke)")
    ap.add_argument("--out", type=Path, default=RESULTS / "fault_recovery.json")
    ap.add_argument("--root", type=Path, default=None, help="test-scale corpus directory (default: the shared cache)")
    ap.add_argument("--work-ms", type=float, default=60.0, help="the trainer's own work per step")
    args = ap.parse_args(argv)

    from torchdata_overlord.sim.corpus import build_demo_corpus, default_corpus_root
    from torchdata_overlord.sim.fault_run import source_names
    root = args.root or default_corpus_root().parent / "demo-corpus-test"
    build_demo_corpus(root, scale="test", seed=0)
    t_all = time.perf_counter()
    steps = 16 if args.quick else 100
    many = 2 if args.quick else 10          # sources of the many-source scenarios (each loader a process)
    every, first = (8, 4) if args.quick else (15, 5)
    planner_kills = list(range(first, steps - 2, every))
    loader_kill = 8 if args.quick else 35
    work = calibrate_work(5.0 if args.quick else args.work_ms)
    base = {"root": str(root), "steps": steps, "work": work, "call_timeout": 10, "snapshot_every": 5}
    scenarios = {
        "no_failure_2": (dict(base, sources=2, spares=1, prefetch=2), []),
        "planner_p2": (dict(base, sources=2, spares=len(planner_kills) + 1, prefetch=2,
                            faults=[{"step": k, "kill": ["planner"]} for k in planner_kills]), planner_kills),
        "planner_p4": (dict(base, sources=2, spares=len(planner_kills) + 1, prefetch=4,
                            faults=[{"step": k, "kill": ["planner"]} for k in planner_kills]), planner_kills),
    }
    # the many-source reference (with --quick, many == 2: the run above)
    scenarios.setdefault(f"no_failure_{many}", (dict(base, sources=many, spares=1, prefetch=2), []))
    scenarios |= {
        "loaders_p2": (dict(base, sources=many, spares=many // 2 + 1, prefetch=2,
                            faults=[{"step": loader_kill,
                                     "kill": [f"loader:{n}" for n in source_names(many)[:many // 2]]}]),
                       [loader_kill]),
        "shadows_off": (dict(base, sources=many, spares=0, prefetch=2, shadows=False, steps=min(steps, 30)), []),
    }
    for cfg, _ in scenarios.values():      # one process per role, as above (the default placement packs them)
        cfg["n_workers"] = 1 + cfg["sources"] + 2 + (cfg["sources"] if cfg.get("shadows", True) else 0)
    print(f"trainer work {args.work_ms if not args.quick else 5:.0f} ms per step ({work} matmul rounds); {steps} steps; "
          f"Planner killed at steps {planner_kills}; {many // 2} of {many} loaders killed at step {loader_kill}", flush=True)
    reps, errors = {}, {}
    for name, (cfg, _) in scenarios.items():
        t0 = time.perf_counter()
        try:
            reps[name] = run(cfg, timeout=300 if args.quick else 900)
        except Exception as e:   # noqa: BLE001 (recorded; the exit status says a run failed)
            errors[name] = f"{type(e).__name__}: {e}"
        print(f"  {name}: {'failed: ' + errors[name][:300] if name in errors else 'done'} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)

    results = {}
    for name, (cfg, kills) in scenarios.items():
        if name not in reps or name.startswith(("no_failure", "shadows")):
            continue
        ref = reps.get(f"no_failure_{many}" if cfg["sources"] == many else "no_failure_2")
        results[name] = summarise(reps[name], kills, ref["digests"] if ref else None)
    costs = {}
    if f"no_failure_{many}" in reps:
        costs["shadows_on"] = shadow_cost(reps[f"no_failure_{many}"])
    if "shadows_off" in reps:
        costs["shadows_off"] = shadow_cost(reps["shadows_off"])

    print(f"\n{'scenario':>12} {'prefetch':>8} {'same stream':>11} {'stall steps':>11} {'max wait ms':>11} "
          f"{'median ms':>9}  recoveries (s)")
    for name, r in results.items():
        rec = ", ".join(f"{e['kind']} {e['seconds']:.2f}" for e in r["recoveries"])
        print(f"{name:>12} {scenarios[name][0]['prefetch']:>8} {str(r['same_stream_as_no_failure']):>11} "
              f"{r['stall_steps']:>11} {r['max_wait_ms']:>11.1f} {r['median_wait_ms_away_from_failures']:>9.2f}  {rec}")
    for name, c in costs.items():
        print(f"  {name}: {c['role_processes']} role processes, PSS {c['pss_all_roles_mib']} MiB "
              f"({c['pss_shadows_mib']} MiB in {c['shadow_processes']} shadows, {c['pss_without_shadows_mib']} MiB "
              f"without), CPU {c['cpu_all_roles_s']} s ({c['cpu_shadows_s']} s in shadows)")
    plot_path = args.out.with_suffix(".png")
    if results:
        plot(plot_path, results, scenarios)
        print(f"plot: {plot_path}")
    out = {"benchmark": "fault_recovery", "quick": args.quick, "config": {
        "steps": steps, "work_ms": 5.0 if args.quick else args.work_ms, "work_rounds": work,
        "planner_kills": planner_kills, "loader_kill_step": loader_kill, "global_batch": 8, "mesh": {"dp": 2},
        "sources_many": many,
        "call_timeout_s": 10, "snapshot_every": 5, "scale": "test"},
        "scenarios": {k: {kk: vv for kk, vv in v[0].items() if kk != "root"} for k, v in scenarios.items()},
        "results": results, "shadow_cost": costs, "errors": errors, "plot": str(plot_path)}
    write_results(args.out, out, started=t_all)
    return 1 if errors else 0


def plot(path: Path, results: dict, scenarios: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    many = scenarios["loaders_p2"][0]["sources"]
    for ax, names, title in ((axes[0], ["planner_p2", "planner_p4"], "Planner killed repeatedly"),
                             (axes[1], ["loaders_p2"], f"{many // 2} of {many} loaders killed at once")):
        for name in names:
            if name in results:
                r = results[name]
                ax.plot(range(len(r["waits_ms"])), r["waits_ms"], label=f"prefetch {scenarios[name][0]['prefetch']}")
                for k in r["kill_steps"]:
                    ax.axvline(k, color="grey", lw=0.6, ls=":")
        ax.set(title=title, xlabel="step", ylabel="next() wait (ms)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

"""Every benchmark in one command: ``python -m benchmarks`` (from the repository root).

Runs each script in its own process, one after another (they measure: never in parallel), then
regenerates the README's results block from ``benchmarks/results/*.json``. ``--quick`` runs each
script's CI smoke size and writes its JSON under a temporary folder instead (the README keeps the
full figures). Exits non-zero if any script failed; ``--only`` picks scripts by name.

    python -m benchmarks                # every figure (~60 minutes on 2 cores)
    python -m benchmarks --quick        # smoke: does everything still run?
    python -m benchmarks --only balance mixing_accuracy
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ["plan_speed", "balance", "mixing_accuracy", "e2e_throughput", "runtimes", "transport", "fault_recovery",
           "memory", "autoscaling", "startup", "elastic"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="each script's smoke size; results to a temporary folder")
    ap.add_argument("--only", nargs="+", choices=SCRIPTS, help="run just these scripts")
    args = ap.parse_args(argv)
    scripts = args.only or SCRIPTS
    out_dir = Path(tempfile.mkdtemp(prefix="overlord-bench-")) if args.quick else None
    failed, t_all = [], time.perf_counter()
    for name in scripts:
        cmd = [sys.executable, str(HERE / f"{name}.py")]
        if args.quick:
            cmd += ["--quick", "--out", str(out_dir / f"{name}.json")]
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=str(HERE.parent)).returncode
        print(f"=== {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    if not args.quick:
        subprocess.run([sys.executable, str(HERE / "report.py")], cwd=str(HERE.parent), check=False)
    print(f"\n{len(scripts) - len(failed)}/{len(scripts)} benchmarks ran in {time.perf_counter() - t_all:.0f} s"
          + (f"; failed: {failed}" if failed else "") + (f"; results in {out_dir}" if out_dir else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

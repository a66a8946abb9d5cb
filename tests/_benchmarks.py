"""Running a benchmark script's ``--quick`` smoke pass, as the benchmark smoke tests all do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_quick(script: str, out: Path, *extra: str, timeout: float) -> tuple[dict, subprocess.CompletedProcess]:
    """``python benchmarks/<script>.py --quick --out <out> <extra>``: must exit 0; its JSON and the run."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--quick", "--out", str(out),
                           *extra], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(Path(out).read_text()), proc

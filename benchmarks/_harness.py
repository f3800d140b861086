"""Running one measurement in a subprocess, and writing CSV files."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def measure(spec: dict[str, Any], *, timeout: float, log: bool = True) -> dict[str, Any]:
    """Run ``spec`` once in a fresh process: its row with ``time_s``,
    ``peak_extra_mib``, ``runs_s`` and ``error`` (empty when it ran).
    ``benchmarks.logprobs.merge_runs`` keeps the best of several."""
    time_s = peak = float("nan")
    error = ""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks._worker", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=env,
        )
    except subprocess.TimeoutExpired:
        error = f"timeout after {timeout:.0f} s"
    else:
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            error = f"exit {proc.returncode}: {tail[0][:200]}"
        else:
            result = json.loads(lines[-1])
            time_s, peak = result["time_s"], result["peak_extra_mib"]
    row = dict(spec)
    row.update(time_s=time_s, peak_extra_mib=peak, runs_s="" if error else f"{time_s:.3f}", error=error)
    if log:
        status = error or f"{time_s:.2f} s, {peak:.0f} MiB extra"
        shape = f"{spec.get('tokens')}x{spec.get('hidden')}x{spec.get('vocab')} {spec.get('dtype')}"
        print(f"  {spec['method']:<22} {shape:<22} {status}", flush=True)
    return row


def write_csv(rows: Sequence[dict[str, Any]], path: Path, columns: Iterable[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = list(columns)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _fmt(row.get(c, "")) for c in cols})


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.4g}"
    return value


def ratio(a: float, b: float) -> float:
    if not (a == a and b == b) or b == 0:
        return float("nan")
    return a / b

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


def run_worker(args: Sequence[str], *, timeout: float) -> tuple[dict[str, Any] | None, str]:
    """``python -m <args>`` in a fresh process, from the project's root: its last JSON
    line of stdout, or ``None`` and why not (a timeout, an exit status, no output)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout:.0f} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"exit {proc.returncode}: {tail[0][:200]}"
    return json.loads(lines[-1]), ""


def measure(spec: dict[str, Any], *, timeout: float, log: bool = True) -> dict[str, Any]:
    """Run ``spec`` once in a fresh process: its row with ``time_s``,
    ``peak_extra_mib``, ``runs_s`` and ``error`` (empty when it ran).
    ``benchmarks.logprobs.merge_runs`` keeps the best of several."""
    result, error = run_worker(["benchmarks._worker", json.dumps(spec)], timeout=timeout)
    time_s = peak = float("nan")
    if result is not None:
        time_s, peak = result["time_s"], result["peak_extra_mib"]
    row = dict(spec)
    row.update(
        time_s=time_s, peak_extra_mib=peak, runs_s="" if error else f"{time_s:.3f}", error=error
    )
    if log:
        status = error or f"{time_s:.2f} s, {peak:.0f} MiB extra"
        shape = f"{spec.get('tokens')}x{spec.get('hidden')}x{spec.get('vocab')} {spec.get('dtype')}"
        print(f"  {spec['method']:<22} {shape:<22} {status}", flush=True)
    return row


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, write (110 dpi, the folder made) and close ``fig``."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


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

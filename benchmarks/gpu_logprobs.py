"""Selected-token logprobs (+ entropy) forward + backward on a GPU: every method in one
process per size, after warm-up (Triton's compilation excluded), timed with CUDA
events, the median of ``--runs`` (>= 5), the peak from ``max_memory_allocated``, and
the error of ``dh`` and ``dW`` against float64 on a subset of rows beside each time.

    python -m benchmarks.gpu_logprobs                 # the sizes of issue 9, on CUDA
    python -m benchmarks.gpu_logprobs --quick --device cpu   # a tiny smoke run on a CPU

``scripts/gpu_bench.sh`` is the one prepared command for a GPU machine without a
package index: it installs the wheels ``scripts/gpu_wheels.sh`` put in ``.whl/``
and runs this. Methods (those that cannot run are reported with the reason):

- ``naive``: bf16 GEMM, fp32 logits, logsumexp, gather, softmax (``[n, V]`` tensors).
- ``verl``: veRL 0.9.1's pure-torch ``FusedLinearForPPO`` (``torch_functional.py``).
- ``verl-triton``: veRL 0.9.1's Triton ``linear_cross_entropy`` (logprobs + entropy):
  ``verl/utils/kernel/{kernels,linear_cross_entropy}.py`` loaded by path from the
  wheel, as a package of their own, with a stand-in for the four helpers they import
  from ``verl.utils.device``. Never vendored.
- ``ours-torch`` / ``ours-triton``: ``linear_logprobs(..., with_entropy=True)``
  with ``backend="torch"`` (tiles per device) and ``backend="triton"``.
- logprobs only: ``liger`` (Liger-Kernel's fused linear cross entropy), ``cce``
  (Cut Cross-Entropy), ``ours-ce-torch``, ``ours-ce-triton``.
- ``floor3`` / ``floor4``: bare GEMMs in the input dtype (logits, dh, dW; plus the
  recomputed logits): the time no method can beat.

Cotangents are ones on the logprobs and on the entropy (``(x * ones).sum()``, so
that a backward that wants contiguous cotangents gets them). Writes
``gpu_logprobs.csv``, ``gpu_logprobs.json`` and ``gpu_logprobs.md`` (the table and
the targets of issue 9, met or not) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ._harness import ROOT, write_csv
from .methods import cce, floor3, floor4, liger, naive, verl

__all__ = ["METHODS", "SIZES", "main"]

SIZES: list[dict[str, Any]] = [
    {"tokens": 8192, "hidden": 4096, "vocab": 151936, "dtype": "bf16"},
    {"tokens": 8192, "hidden": 1024, "vocab": 65536, "dtype": "bf16"},
    {"tokens": 8192, "hidden": 1024, "vocab": 65536, "dtype": "fp32"},
    {"tokens": 32768, "hidden": 4096, "vocab": 151936, "dtype": "bf16"},
]
QUICK_SIZES: list[dict[str, Any]] = [{"tokens": 96, "hidden": 48, "vocab": 1000, "dtype": "fp32"}]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VERL_WHEEL_ENV = "HOOKSPEC_VERL_WHEEL"
"""Path of the veRL 0.9.1 wheel (``scripts/gpu_wheels.sh`` downloads it to ``.whl/``)."""

Result = tuple[torch.Tensor, torch.Tensor | None]


def _ours(backend: str, entropy: bool) -> Callable[..., Result]:
    from torch_impl.processors import linear_logprobs

    def run(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
        r = linear_logprobs(h, w, y, with_entropy=entropy, backend=backend)  # type: ignore[arg-type]
        return r.logprobs, r.entropy

    return run


_VERL_TRITON: Any = None


def _verl_triton_module() -> Any:
    """veRL's ``linear_cross_entropy`` loaded from the wheel by path (see the module docstring)."""
    global _VERL_TRITON
    if _VERL_TRITON is not None:
        return _VERL_TRITON
    wheel = os.environ.get(VERL_WHEEL_ENV, "")
    if not wheel or not Path(wheel).exists():
        raise RuntimeError(f"veRL wheel not found: set {VERL_WHEEL_ENV} (scripts/gpu_bench.sh does)")
    target = Path(os.environ.get("TMPDIR", "/tmp")) / "hookspec-verl-kernel"
    with zipfile.ZipFile(wheel) as zf:
        for name in ("kernels.py", "linear_cross_entropy.py"):
            data = zf.read(f"verl/utils/kernel/{name}")
            target.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(data)
    device = types.ModuleType("verl.utils.device")  # the four helpers the two files import
    device.is_cuda_available = torch.cuda.is_available()  # type: ignore[attr-defined]
    device.get_device_capability = lambda device_id=0: torch.cuda.get_device_capability(device_id)  # type: ignore[attr-defined]
    device.get_device_name = lambda: "cuda"  # type: ignore[attr-defined]
    device.get_torch_device = lambda: torch.cuda  # type: ignore[attr-defined]
    for name in ("verl", "verl.utils"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["verl.utils.device"] = device
    package = types.ModuleType("hookspec_bench_verl_kernel")
    package.__path__ = [str(target)]  # type: ignore[attr-defined]
    sys.modules[package.__name__] = package
    spec = importlib.util.spec_from_file_location(
        f"{package.__name__}.linear_cross_entropy", target / "linear_cross_entropy.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    importlib.import_module(f"{package.__name__}.kernels")  # what its forward imports: fail here, not timed
    _VERL_TRITON = module
    return module


def verl_triton(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Result:
    logprobs, entropy = _verl_triton_module().linear_cross_entropy(h, w, y, 1.0, "none")
    return logprobs, entropy


METHODS: dict[str, tuple[Callable[..., Result], bool]] = {
    # name: (fn, computes the entropy)
    "naive": (naive, True),
    "verl": (verl, True),
    "verl-triton": (verl_triton, True),
    "ours-torch": (_ours("torch", True), True),
    "ours-triton": (_ours("triton", True), True),
    "liger": (liger, False),
    "cce": (cce, False),
    "ours-ce-torch": (_ours("torch", False), False),
    "ours-ce-triton": (_ours("triton", False), False),
    "floor3": (floor3, False),
    "floor4": (floor4, False),
}
GPU_ONLY = ("verl-triton", "liger", "cce", "ours-triton", "ours-ce-triton")


# ---------------------------------------------------------------- float64 reference on row subsets


def reference(
    h: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    *,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``dh[rows]`` and ``dW[cols]`` of ``sum(lp) (+ sum(entropy))``::

    p = softmax(z);  d lp / dz = onehot(y) - p;  d H / dz = -p * (log p + H)
    """
    w64 = w.double()
    n = h.shape[0]
    dw = torch.zeros(len(cols), h.shape[1], dtype=torch.float64, device=h.device)
    dh = None
    step = max(1, (1 << 27) // max(1, w.shape[0]))  # 1 GiB of fp64 logits per chunk
    for i0 in range(0, n, step):
        hc = h[i0 : i0 + step].double()
        z = hc @ w64.T
        logp = z.log_softmax(-1)
        p = logp.exp()
        dz = torch.zeros_like(z).scatter_(1, y[i0 : i0 + step, None], 1.0) - p
        if entropy:
            ent = -(p * logp).sum(-1, keepdim=True)
            dz -= p * (logp + ent)
        dw += dz[:, cols].T @ hc
        sel = (rows >= i0) & (rows < i0 + hc.shape[0])
        if bool(sel.any()):
            part = dz[rows[sel] - i0] @ w64
            dh = part if dh is None else torch.cat([dh, part])
        del z, logp, p, dz
    assert dh is not None
    return dh, dw


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))


# ---------------------------------------------------------------- one size, every method, one process


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_once(
    fn: Callable[..., Result], h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, device: str
) -> float:
    h.grad = w.grad = None
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        t0 = time.perf_counter()
    lp, ent = fn(h, w, y)
    if lp.requires_grad:
        loss = (lp * torch.ones_like(lp)).sum()
        if ent is not None:
            loss = loss + (ent * torch.ones_like(ent)).sum()
        loss.backward()
    if device == "cuda":
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end)) / 1e3
    return time.perf_counter() - t0


def run_size(
    size: dict[str, Any], methods: list[str], *, device: str, runs: int, warmup: int
) -> list[dict[str, Any]]:
    dtype = DTYPES[size["dtype"]]
    n, hid, v = size["tokens"], size["hidden"], size["vocab"]
    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(n, hid, device=device, generator=g) * 1.0).to(dtype).requires_grad_()
    w = (torch.randn(v, hid, device=device, generator=g) * hid**-0.5).to(dtype).requires_grad_()
    y = torch.randint(0, v, (n,), device=device, generator=g)
    rows = torch.linspace(0, n - 1, min(n, 128), device=device).long().unique()
    cols = torch.cat([y[:64], torch.linspace(0, v - 1, 64, device=device).long()]).unique()
    refs: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    for name in methods:
        fn, with_entropy = METHODS[name]
        row: dict[str, Any] = dict(size, method=name, device=device, error="")
        if device != "cuda" and name in GPU_ONLY and not name.startswith("ours"):
            row["error"] = "needs CUDA"
            out.append(row)
            print(json.dumps(row), flush=True)
            continue
        try:
            for _ in range(warmup):
                _time_once(fn, h, w, y, device)
            _sync(device)
            base = torch.cuda.memory_allocated() if device == "cuda" else 0
            times, peaks = [], []
            for _ in range(runs):
                h.grad = w.grad = None
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                times.append(_time_once(fn, h, w, y, device))
                if device == "cuda":
                    peaks.append(torch.cuda.max_memory_allocated() - base)
            row.update(
                time_ms=1e3 * statistics.median(times),
                min_ms=1e3 * min(times),
                runs=len(times),
                peak_extra_gb=(max(peaks) / 1e9) if peaks else float("nan"),
            )
            if not name.startswith("floor"):
                if with_entropy not in refs:
                    refs[with_entropy] = reference(
                        h.detach(), w.detach(), y, rows, cols, entropy=with_entropy
                    )
                dh_ref, dw_ref = refs[with_entropy]
                assert h.grad is not None and w.grad is not None
                row.update(dh_rel_err=_rel(h.grad[rows], dh_ref), dw_rel_err=_rel(w.grad[cols], dw_ref))
        except torch.cuda.OutOfMemoryError:
            row["error"] = "out of memory"
        except Exception as exc:  # reported in the table: a method that cannot run here
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        finally:
            h.grad = w.grad = None
            if device == "cuda":
                torch.cuda.empty_cache()
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


# ---------------------------------------------------------------- the report


COLUMNS = [
    "tokens", "hidden", "vocab", "dtype", "method", "time_ms", "min_ms", "runs", "peak_extra_gb",
    "dh_rel_err", "dw_rel_err", "error",
]  # fmt: skip


def _get(rows: list[dict[str, Any]], size: dict[str, Any], method: str, key: str) -> float:
    for r in rows:
        if r["method"] == method and all(r[k] == size[k] for k in ("tokens", "hidden", "vocab", "dtype")):
            value = r.get(key)
            return float(value) if isinstance(value, (int, float)) else float("nan")
    return float("nan")


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 9's targets at 8192 x 4096 x 151936 bf16, as ratios measured in this run."""
    size = SIZES[0]
    t = {m: _get(rows, size, m, "time_ms") for m in METHODS}
    p = {m: _get(rows, size, m, "peak_extra_gb") for m in METHODS}
    e = {m: _get(rows, size, m, "dh_rel_err") for m in METHODS}

    def check(ok: float, text: str) -> str:
        verdict = "not measured" if math.isnan(ok) else ("met" if ok else "NOT met")
        return f"- {text}: **{verdict}**"

    def le(a: float, b: float) -> float:
        return float("nan") if math.isnan(a) or math.isnan(b) else float(a <= b)

    return [
        check(le(t["ours-triton"], 0.75 * t["verl-triton"]),
              f"logprobs + entropy within 0.75x veRL's Triton kernel: ours {t['ours-triton']:.1f} ms, "
              f"veRL Triton {t['verl-triton']:.1f} ms"),
        check(le(t["ours-ce-triton"], t["cce"]),
              f"logprobs only no slower than CCE: ours {t['ours-ce-triton']:.1f} ms, CCE {t['cce']:.1f} ms"),
        check(le(p["ours-triton"], p["verl-triton"]),
              f"peak (logprobs + entropy) <= veRL Triton's: {p['ours-triton']:.2f} GB "
              f"vs {p['verl-triton']:.2f} GB"),
        check(le(p["ours-ce-triton"], 1.1 * p["cce"]),
              f"peak (logprobs only) <= 1.1x CCE's: {p['ours-ce-triton']:.2f} GB vs {p['cce']:.2f} GB"),
        check(le(e["ours-triton"], e["naive"]),
              f"dh error no worse than naive bf16: {e['ours-triton']:.2e} vs {e['naive']:.2e}"),
    ]  # fmt: skip


def _cell(r: dict[str, Any], key: str, fmt: str) -> str:
    v = r.get(key)
    return format(v, fmt) if isinstance(v, float) and not math.isnan(v) else ""


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        "| size | method | time ms (median) | peak extra GB | dh rel err | dW rel err | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = f"{r['tokens']}x{r['hidden']}x{r['vocab']} {r['dtype']}"
        lines.append(
            f"| {shape} | {r['method']} | {_cell(r, 'time_ms', '.1f')} | "
            f"{_cell(r, 'peak_extra_gb', '.2f')} | "
            f"{_cell(r, 'dh_rel_err', '.1e')} | {_cell(r, 'dw_rel_err', '.1e')} | {r.get('error', '')} |"
        )
    return "\n".join([*lines, "", "Targets (8192 x 4096 x 151936 bf16):", *targets(rows), ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="one tiny size (a smoke run)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=58.0, help="seconds per size (its own process)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or (args.runs < 5 and not args.quick):
        ap.error(f"unknown methods {unknown}" if unknown else "--runs must be >= 5")
    if args.worker:
        run_size(json.loads(args.worker), methods, device=args.device, runs=args.runs, warmup=args.warmup)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: use --device cpu for a smoke run; GPU figures are not measured here")
    rows: list[dict[str, Any]] = []
    for size in QUICK_SIZES if args.quick else SIZES:
        cmd = [sys.executable, "-m", "benchmarks.gpu_logprobs", "--worker", json.dumps(size),
               "--device", args.device, "--methods", ",".join(methods), "--runs", str(args.runs),
               "--warmup", str(args.warmup), *(["--quick"] if args.quick else [])]  # fmt: skip
        print(f"== {size}", flush=True)
        got: list[dict[str, Any]] = []
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            got = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
                got.append(dict(size, method="(process)", error=f"exit {proc.returncode}: {tail}"))
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            got = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
            got.append(dict(size, method="(process)", error=f"timeout after {args.timeout:.0f} s"))
        for r in got:
            print(
                f"  {r['method']:<15} {r.get('time_ms', float('nan')):9.2f} ms  {r.get('error', '')}",
                flush=True,
            )
        rows += got
    card = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    header = (f"Measured {dt.date.today().isoformat()} on {card}, torch {torch.__version__}, "
              f"median of {args.runs} after {args.warmup} warm-ups")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "gpu_logprobs.csv", COLUMNS)
    (args.out / "gpu_logprobs.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    report = markdown(rows, header)
    (args.out / "gpu_logprobs.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

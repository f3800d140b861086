"""Top-k logprobs and distillation, forward + backward: time and peak extra memory of
ours against the materialised-logits path, measured in the same run, each method in
its own process, best of ``--repeats``; ratios ours / materialised.

    python -m benchmarks.distill            # 1024 tokens, hidden 512 (teacher 768), V 32768, fp32
    python -m benchmarks.distill --quick    # small sizes, seconds (smoke test)

Methods (``--quick`` or not):

- ``topk-ours`` / ``topk-materialised``: the 16 largest logprobs per token and their
  ids, the backward of a random cotangent on the values
  (``linear_topk_logprobs`` against ``log_softmax(h @ W.T)`` and ``torch.topk``);
- ``sparse-{renormalize,bucket}-{ours,materialised}``: forward KL to a top-16
  teacher (``distillation_loss`` with a ``SparseTeacher`` against the student's
  full logits gathered at the teacher's ids);
- ``dense-{forward-kl,jsd}-{ours,materialised}``: the full-vocabulary divergence to
  a dense teacher (``DenseTeacher``: its hidden states and weight) against both
  logits materialised.

Liger-Kernel's fused linear JSD: not measured on a CPU (its kernels need a GPU).
GPU rows: not measured here.

Writes ``benchmarks/results/distill.csv`` and prints a markdown table of the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ._harness import ROOT, run_worker
from ._worker import status_kib

FULL = {"tokens": 1024, "hidden": 512, "teacher_hidden": 768, "vocab": 32768, "k": 16}
QUICK = {"tokens": 128, "hidden": 64, "teacher_hidden": 96, "vocab": 2048, "k": 8}
PAIRS = (
    "topk",
    "sparse-renormalize",
    "sparse-bucket",
    "dense-forward-kl",
    "dense-jsd",
)
COLUMNS = ["pair", "method", "tokens", "hidden", "vocab", "k", "time_s", "peak_extra_mib", "error"]


# --------------------------------------------------------------- one measurement (a worker process)


def _inputs(spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    n, hid, th, v, k = (
        spec["tokens"],
        spec["hidden"],
        spec["teacher_hidden"],
        spec["vocab"],
        spec["k"],
    )
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hid, generator=g).requires_grad_()
    w = (torch.randn(v, hid, generator=g) * hid**-0.5).requires_grad_()
    t_h = torch.randn(n, th, generator=g)
    t_w = torch.randn(v, th, generator=g) * th**-0.5
    t_lp = (t_h @ t_w.T).log_softmax(-1)
    top = torch.topk(t_lp, k, dim=-1)
    return {
        "h": h,
        "w": w,
        "t_h": t_h,
        "t_w": t_w,
        "ids": top.indices,
        "lp": top.values,
        "cot": torch.randn(n, k, generator=g),
    }


def _context(x: dict[str, torch.Tensor], teacher: Any) -> Any:
    from hookspec import OutputContext, VocabShard

    v = x["w"].shape[0]
    return OutputContext(
        hidden_states=x["h"][:, None, :],
        vocab_weight=x["w"],
        vocab=VocabShard(0, v, v),
        context=teacher,
    )


def _config(pair: str) -> Any:
    from hookspec import DistillDivergence, TeacherTail
    from torch_impl.processors import DistillConfig

    if pair.startswith("sparse"):
        return DistillConfig(tail=TeacherTail(pair.removeprefix("sparse-")))
    return DistillConfig(divergence=DistillDivergence(pair.removeprefix("dense-")))


def _ours(pair: str, x: dict[str, torch.Tensor]) -> torch.Tensor:
    from torch_impl.processors import (
        DenseTeacher,
        SparseTeacher,
        distillation_loss,
        linear_topk_logprobs,
    )

    if pair == "topk":
        r = linear_topk_logprobs(x["h"], x["w"], k=x["cot"].shape[1])
        return (r.logprobs * x["cot"]).sum()
    if pair.startswith("sparse"):
        teacher: Any = SparseTeacher(ids=x["ids"][None], logprobs=x["lp"][None])
    else:
        teacher = DenseTeacher(hidden_states=x["t_h"][:, None, :], weight=x["t_w"])
    return distillation_loss(_config(pair))(  # type: ignore[no-any-return]
        _context(x, teacher)
    )["loss"]


def _materialised(pair: str, x: dict[str, torch.Tensor]) -> torch.Tensor:
    lq = (x["h"] @ x["w"].T).log_softmax(-1)  # [n, V]
    if pair == "topk":
        return (torch.topk(lq, x["cot"].shape[1], dim=-1).values * x["cot"]).sum()
    if pair.startswith("sparse"):
        lq_ids, lp = lq.gather(-1, x["ids"]), x["lp"]
        if pair == "sparse-renormalize":
            log_p, log_q = lp.log_softmax(-1), lq_ids.log_softmax(-1)
        else:
            log_p = torch.cat([lp, (1 - lp.exp().sum(-1)).clamp_min(0).log()[:, None]], -1)
            log_q = torch.cat(
                [lq_ids, (1 - lq_ids.exp().sum(-1)).clamp_min(1e-30).log()[:, None]], -1
            )
        return (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    with torch.no_grad():
        lp = (x["t_h"] @ x["t_w"].T).log_softmax(-1)
    if pair == "dense-forward-kl":
        return (lp.exp() * (lp - lq)).sum(-1).mean()
    log_m = torch.logaddexp(math.log(0.5) + lp, math.log(0.5) + lq)
    return (
        0.5 * (lp.exp() * (lp - log_m)).sum(-1) + 0.5 * (lq.exp() * (lq - log_m)).sum(-1)
    ).mean()


def worker(spec: dict[str, Any]) -> dict[str, float]:
    """One forward + backward in this process: wall time and peak RSS above the inputs."""
    torch.set_num_threads(int(spec.get("threads") or torch.get_num_threads()))
    import hookspec  # noqa: F401  (imports before the clock starts)
    import torch_impl.processors  # noqa: F401

    x = _inputs(spec)
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set
    except OSError:
        pass
    base = status_kib("VmRSS")
    t0 = time.perf_counter()
    fn = _ours if spec["method"] == "ours" else _materialised
    loss = fn(spec["pair"], x)
    loss.backward()
    elapsed = time.perf_counter() - t0
    peak = status_kib("VmHWM")
    return {"time_s": elapsed, "peak_extra_mib": (peak - base) / 1024, "loss": float(loss)}


# ---------------------------------------------------------------- the run


def _measure(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    row = dict(spec, time_s=math.nan, peak_extra_mib=math.nan, error="")
    result, row["error"] = run_worker(
        ["benchmarks.distill", "--worker", json.dumps(spec)], timeout=timeout
    )
    row.update(result or {})
    return row


def _best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if not r["error"]]
    if not ok:
        return rows[-1]
    best = min(ok, key=lambda r: r["time_s"])
    return dict(best, peak_extra_mib=min(r["peak_extra_mib"] for r in ok))


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.distill", description=__doc__.splitlines()[0]
    )
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    p.add_argument("--repeats", type=int, default=2, help="runs per method; the best is kept")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads in each worker (0: torch's default)"
    )
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "distill.csv")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    shape = QUICK if args.quick else FULL
    print(f"# {datetime.date.today()} on {_machine()}; {shape}, fp32, CPU", flush=True)
    rows = []
    for pair in PAIRS:
        for method in ("materialised", "ours"):
            spec = dict(shape, pair=pair, method=method, threads=args.threads)
            row = _best([_measure(spec, args.timeout) for _ in range(args.repeats)])
            rows.append(row)
            status = row["error"] or f"{row['time_s']:.3f} s, {row['peak_extra_mib']:.0f} MiB extra"
            print(f"  {pair:<20} {method:<13} {status}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        f.write(",".join(COLUMNS) + "\n")
        for r in rows:
            f.write(",".join(str(r.get(c, "")) for c in COLUMNS) + "\n")
    print("\n| pair | time ours / materialised | peak extra memory ours / materialised |")
    print("| --- | --- | --- |")
    for pair in PAIRS:
        mat, ours = (
            next(r for r in rows if r["pair"] == pair and r["method"] == m)
            for m in ("materialised", "ours")
        )
        t = ours["time_s"] / mat["time_s"] if not (ours["error"] or mat["error"]) else math.nan
        mem = (
            ours["peak_extra_mib"] / mat["peak_extra_mib"]
            if not (ours["error"] or mat["error"])
            else math.nan
        )
        print(
            f"| {pair} | {t:.2f} ({ours['time_s']:.2f} s / {mat['time_s']:.2f} s) "
            f"| {mem:.3f} ({ours['peak_extra_mib']:.0f} / {mat['peak_extra_mib']:.0f} MiB) |"
        )
    print("| Liger fused linear JSD | not measured on a CPU: Liger's kernels need a GPU | |")
    print("| GPU rows | not measured | |")
    print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

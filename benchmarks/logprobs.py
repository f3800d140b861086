"""Logprobs + entropy, and the PPO loss, forward + backward: time and peak extra memory
of ours against the naive path and veRL's ``FusedLinearForPPO``, measured in the
same run, each method in its own process, best of ``--repeats``.

    python -m benchmarks.logprobs            # 8192 tokens, hidden 1024, V 65536,
                                             #   fp32 and bf16, + sweep
    python -m benchmarks.logprobs --quick    # small sizes, seconds (smoke test)

bf16 on a CPU: ATen's bf16 GEMM with a non-transposed right operand (the
``dlogits @ W`` of every backward) runs at well under 1 GFLOP/s on CPUs without
bf16 instructions (66 s for a 17 GFLOP product on the 2-core AVX2 machine here),
so the naive path and veRL, which multiply in bf16, would take hours at the full
size. There the bf16 baseline is ``naive-upcast`` (the naive path on inputs cast to
fp32, the dtype ours multiplies in on a CPU), and every method, naive bf16 and
veRL included, is also measured at ``BF16_SMALL`` (section ``bf16-small``).

Writes ``benchmarks/results/logprobs.csv``, ``logprobs_summary.md`` (the targets,
met or not) and ``logprobs.png``. ``scripts/bench.sh`` fetches veRL's file and runs
this and ``benchmarks.hook_overhead``.
"""

from __future__ import annotations

import argparse
import math
import platform
from pathlib import Path
from typing import Any

import torch

from ._harness import load_average, measure, pyplot, ratio, save_figure, write_csv
from .methods import LOGPROB_METHODS, POLICY_METHODS, available

FULL = {"tokens": 8192, "hidden": 1024, "vocab": 65536}
QUICK = {"tokens": 1024, "hidden": 256, "vocab": 8192}
BF16_SMALL = {"tokens": 1024, "hidden": 1024, "vocab": 8192}
BF16_GEMM_METHODS = (
    "naive",
    "verl",
    "policy-naive",
)  # multiply in bf16: hours at full size on a CPU
SWEEP = {
    "tokens": [2048, 4096, 8192],
    "at_vocab": 32768,
    "vocab": [16384, 65536, 131072],
    "at_tokens": 2048,
}
QUICK_SWEEP = {"tokens": [256, 1024], "at_vocab": 4096, "vocab": [2048, 8192], "at_tokens": 256}

TARGETS = {  # the CPU targets (ratios against baselines measured in the same run)
    "mem_vs_naive": 0.05,
    "time_vs_naive": 0.8,
    "time_vs_verl": 1.0,
    "policy_vs_naive": 1.05,
}

COLUMNS = [
    "section", "device", "dtype", "tokens", "hidden", "vocab", "method", "time_s", "peak_extra_mib",
    "baseline", "time_vs_naive", "mem_vs_naive", "time_vs_verl", "runs_s", "load_avg", "error",
]  # fmt: skip


def _methods(device: str, floors: bool) -> tuple[list[str], dict[str, str]]:
    names = ["naive", "naive-upcast", "verl", "ours", "policy-naive-upcast"]
    if floors:
        names += ["floor3", "floor4"]
    names += ["liger", "cce", "ours-ce"] if device == "cuda" else []
    names = list(dict.fromkeys(names + list(POLICY_METHODS)))
    skipped = {}
    runnable = []
    for name in names:
        ok, why = available(name, device)
        (runnable.append(name) if ok else skipped.__setitem__(name, why))
    return runnable, skipped


def _case(
    section: str,
    shape: dict[str, int],
    dtype: str,
    device: str,
    methods: list[str],
    args: argparse.Namespace,
    *,
    skip: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    print(f"{section}: {shape} {dtype} on {device}", flush=True)
    names = [
        m for m in methods if m not in skip and not (m.endswith("naive-upcast") and dtype == "fp32")
    ]
    specs = [dict(shape, method=m, dtype=dtype, device=device) for m in names]
    # Rounds of every method in turn, so that a burst of load elsewhere on the
    # machine hits every method alike; best of the rounds.
    rounds = [[measure(spec, timeout=args.timeout) for spec in specs] for _ in range(args.repeats)]
    rows = [merge_runs([r[i] for r in rounds]) for i in range(len(specs))]
    for row in rows:
        row.update(section=section, load_avg=round(load_average(), 2))
    return add_ratios(rows)


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The best (smallest) time and peak memory of several single runs of one spec."""
    ok = [r for r in runs if not r.get("error")]
    row = dict(runs[0])
    row.update(
        time_s=min((r["time_s"] for r in ok), default=float("nan")),
        peak_extra_mib=min((r["peak_extra_mib"] for r in ok), default=float("nan")),
        runs_s=" ".join(r["runs_s"] for r in ok),
        error="; ".join(r["error"] for r in runs if r.get("error")),
    )
    return row


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ratios of the rows of one case to its naive path (``naive``, else
    ``naive-upcast``; the ``policy-`` ones for policy methods) and to veRL."""
    by = {r["method"]: r for r in rows}
    for r in rows:
        policy = r["method"].startswith("policy")
        names = ("policy-naive", "policy-naive-upcast") if policy else ("naive", "naive-upcast")
        base = next((by[n] for n in names if n in by), None)
        if base is not None:
            r["baseline"] = base["method"]
            r["time_vs_naive"] = ratio(r["time_s"], base["time_s"])
            r["mem_vs_naive"] = ratio(r["peak_extra_mib"], base["peak_extra_mib"])
        if "verl" in by and r["method"] in LOGPROB_METHODS:
            r["time_vs_verl"] = ratio(r["time_s"], by["verl"]["time_s"])
    return rows


def _summary(
    rows: list[dict[str, Any]], device: str, skipped: dict[str, str], args: argparse.Namespace
) -> str:
    tables = [r for r in rows if r["section"] in ("main", "bf16-small")]
    loads = [r["load_avg"] for r in rows if r.get("load_avg") == r.get("load_avg")] or [
        float("nan")
    ]
    lines = [
        f"Measured on {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, device {device}; "
        f"best of {args.repeats} runs, each in its own process; "
        f"load average {min(loads):.1f} to {max(loads):.1f}. Ratios are to the naive path of "
        "the same case (`baseline`), measured in the same run.",
        "",
        "| case | method | time (s) | peak extra (MiB) | time / naive | memory / naive "
        "| time / veRL |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in tables:
        case = f"{r['dtype']} {r['tokens']}x{r['hidden']}x{r['vocab']}"
        lines.append(
            f"| {case} | {r['method']} | {r['time_s']:.2f} | {r['peak_extra_mib']:.0f} | "
            f"{_r(r.get('time_vs_naive'))} | {_r(r.get('mem_vs_naive'))} "
            f"| {_r(r.get('time_vs_verl'))} |"
        )
    lines += ["", "| target (CPU) | case | measured | met |", "|---|---|---|---|"]
    cases = dict.fromkeys((r["section"], r["dtype"]) for r in tables)
    for section, dtype in cases:
        by = {r["method"]: r for r in tables if r["section"] == section and r["dtype"] == dtype}
        ours = by.get("ours", {})
        base = ours.get("baseline", "naive")
        fused = by.get("policy-ours-fused", {})
        checks = [
            (
                f"peak extra memory <= 5% of {base}",
                ours.get("mem_vs_naive"),
                TARGETS["mem_vs_naive"],
            ),
            (
                f"logprobs+entropy fwd+bwd <= {TARGETS['time_vs_naive']}x {base}",
                ours.get("time_vs_naive"),
                TARGETS["time_vs_naive"],
            ),
            ("logprobs+entropy fwd+bwd <= veRL", ours.get("time_vs_verl"), TARGETS["time_vs_verl"]),
            (
                f"policy loss in the processor <= 1.05x {fused.get('baseline', '-')}",
                fused.get("time_vs_naive"),
                TARGETS["policy_vs_naive"],
            ),
        ]
        if section != "main":  # fixed costs dominate the memory of a small case
            checks = checks[1:]
        for label, value, target in checks:
            if value is None:
                continue
            met = "n/a" if value != value else ("yes" if value <= target else "no")
            lines.append(f"| {label} | {section} {dtype} | {_r(value)} | {met} |")
    if skipped:
        lines += ["", "Not run: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) + "."]
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += [
            "",
            "Errors: "
            + "; ".join(f"{r['method']} {r['dtype']}: {r['error']}" for r in errors)
            + ".",
        ]
    return "\n".join(lines) + "\n"


def _r(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.3f}" if value < 0.1 else f"{value:.2f}"


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()

    def group(r: dict[str, Any]) -> str:
        return (
            r["dtype"]
            if r["section"] == "main"
            else f"{r['dtype']} {r['tokens']}x{r['hidden']}x{r['vocab']}"
        )

    main = [r for r in rows if r["section"] in ("main", "bf16-small") and not r.get("error")]
    sweep = [r for r in rows if r["section"].startswith("sweep") and not r.get("error")]
    fig, axes = plt.subplots(1, 4 if sweep else 2, figsize=(21 if sweep else 11, 4.5))
    dtypes = list(dict.fromkeys(group(r) for r in main))
    methods = list(dict.fromkeys(r["method"] for r in main))
    width = 0.8 / max(1, len(dtypes))
    for k, dtype in enumerate(dtypes):
        by = {r["method"]: r for r in main if group(r) == dtype}
        xs = [i + k * width for i in range(len(methods))]
        axes[0].bar(xs, [by[m].get("time_vs_naive", math.nan) if m in by else math.nan
                         for m in methods], width, label=dtype)  # fmt: skip
        axes[1].bar(xs, [by[m].get("mem_vs_naive", math.nan) if m in by else math.nan
                         for m in methods], width, label=dtype)  # fmt: skip
    for ax, title in zip(axes[:2], ("time / naive (fwd+bwd)", "peak extra memory / naive")):
        ax.set_xticks([i + width * (len(dtypes) - 1) / 2 for i in range(len(methods))])
        ax.set_xticklabels(methods, rotation=30, ha="right")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(title)
        ax.legend()
    axes[1].set_yscale("log")
    axes[1].axhline(TARGETS["mem_vs_naive"], color="red", lw=0.8, ls="--")
    axes[0].axhline(TARGETS["time_vs_naive"], color="red", lw=0.8, ls="--")
    sections = (("sweep-tokens", "tokens"), ("sweep-vocab", "vocab"))
    for ax, (section, key) in zip(axes[2:], sections):
        at = [r for r in sweep if r["section"] == section]
        lines = [(m, q, f"{mark}{ls}") for q, ls in (("time_vs_naive", "-"), ("mem_vs_naive", ":"))
                 for m, mark in (("ours", "o"), ("verl", "s"))]  # fmt: skip
        for method, metric, style in lines:
            pts = sorted((r[key], r.get(metric, math.nan)) for r in at if r["method"] == method)
            if pts:
                what = "time" if metric.startswith("time") else "memory"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{method} {what}")
        other = "vocab" if key == "tokens" else "tokens"
        fixed = {r[other] for r in at}
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(
            f"fp32 sweep over {key} ({other} {', '.join(map(str, sorted(fixed)))}): / naive"
        )
        ax.set_xlabel(key)
        if ax.get_legend_handles_labels()[0]:  # a sweep with no rows for this key draws no lines
            ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.logprobs", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument(
        "--sections", default="main,bf16-small,sweep", help="of main, bf16-small, sweep"
    )
    parser.add_argument("--floors", action="store_true", help="also time bare GEMMs (3 and 4)")
    parser.add_argument(
        "--methods", default="", help="only these methods (comma-separated), e.g. naive,ours"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)

    shape = QUICK if args.quick else FULL
    methods, skipped = _methods(args.device, args.floors)
    if args.methods:
        wanted = args.methods.split(",")
        methods = [m for m in methods if m in wanted]
    sections = set(args.sections.split(","))
    rows: list[dict[str, Any]] = []
    out = args.out

    def save() -> str:
        write_csv(rows, out / "logprobs.csv", COLUMNS)
        summary = _summary(rows, args.device, skipped, args)
        (out / "logprobs_summary.md").write_text(summary)
        _plot(rows, out / "logprobs.png")
        return summary

    slow_bf16 = args.device == "cpu" and not args.quick
    if "main" in sections:
        for dtype in args.dtypes.split(","):
            skip = BF16_GEMM_METHODS if slow_bf16 and dtype != "fp32" else ()
            rows += _case("main", shape, dtype, args.device, methods, args, skip=skip)
            save()
    if "bf16-small" in sections and slow_bf16:
        rows += _case(
            "bf16-small",
            BF16_SMALL,
            "bf16",
            args.device,
            [m for m in methods if "floor" not in m],
            args,
        )
        save()
    if "sweep" in sections:
        sweep_methods = [m for m in ("naive", "verl", "ours") if m in methods]
        sweep, hidden = (QUICK_SWEEP if args.quick else SWEEP), shape["hidden"]
        for n in sweep["tokens"]:
            sweep_shape = {"tokens": n, "hidden": hidden, "vocab": sweep["at_vocab"]}
            rows += _case("sweep-tokens", sweep_shape, "fp32", args.device, sweep_methods, args)
            save()
        for v in sweep["vocab"]:
            sweep_shape = {"tokens": sweep["at_tokens"], "hidden": hidden, "vocab": v}
            rows += _case("sweep-vocab", sweep_shape, "fp32", args.device, sweep_methods, args)
            save()
    summary = save()
    print()
    print(summary)
    print(f"wrote {out / 'logprobs.csv'}, {out / 'logprobs_summary.md'}, {out / 'logprobs.png'}")
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The GPU results page: ``docs/gpu-results.md``'s measured sections, from one run of
``scripts/gpu_tests.sh``, so the next person with a GPU only runs and commits.

    python -m benchmarks.gpu_results env DIR       # on the GPU machine: DIR/env.json
    python -m benchmarks.gpu_results render DIR    # DIR/gpu-results.md, and the backend choice
    python -m benchmarks.gpu_results render DIR --write docs/gpu-results.md
    python -m benchmarks.gpu_results render --empty --write docs/gpu-results.md   # no run

``DIR`` holds what the run wrote: ``env.json`` (device, versions, commit, date),
``gpu_measure.jsonl`` (what is measured first, :mod:`benchmarks.gpu_measure`),
``tests-<release>.log`` (``pytest -v -m gpu`` per megatron-core release) and
``gpu_logprobs.jsonl`` (one row per size and method, :mod:`benchmarks.gpu_logprobs`).
Where ``benchmarks.gpu_model`` exists and offers ``predicted_ms(device_class) ->
{pass: ms}`` (and optionally ``DEVICE_CLASSES``), each pass's predicted time is put
beside the measured one (pass names: :func:`benchmarks.gpu_measure.measured_passes`,
and the benchmark's method names at the targets' size); without it that column is
left out.
``--write`` replaces, in the page, the text between the ``<!-- gpu-results:run -->``
and ``<!-- gpu-results:targets -->`` markers and their ends; nothing else. ``render``
also prints, per device class, which backend measured faster on each path: the rows
the ``backend="auto"`` table is filled from. Every cell of a run without a measurement
says "not measured"; nothing is estimated. The tables exist only for a run: with
``--empty`` the regions say in a sentence that no run is recorded (:data:`NO_RUN`), not a
table of "not measured" rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import math
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ._harness import ROOT
from .gpu_logprobs import (
    RESULTS,
    SIZE_KEYS,
    SIZES,
    TARGET_SIZE,
    device_class_here,
    methods_at,
    size_of,
)
from .gpu_measure import RESULTS as MEASURE_RESULTS
from .gpu_measure import measured_passes
from .gpu_methods import KEPT, METHODS, REPLAY_METHODS

__all__ = [
    "NO_RUN",
    "RELEASES",
    "backend_choice",
    "class_choice",
    "gpu_test_files",
    "main",
    "measure_lines",
    "model_predictions",
    "peers_target",
    "render",
    "replay_lines",
    "targets",
    "write_page",
]

RELEASES = ("0.19.2", "0.16.1")
NOT = "not measured"
PROCESSOR_ONLY = (
    "tests/processors/test_gpu_checks.py",
    "tests/processors/test_processors_triton.py",
)
"""GPU test files that test no Megatron code: run on the first release only
(scripts/gpu_tests.sh)."""
GPU_MARK = re.compile(r"^[ \t]*(@pytest\.mark\.gpu\b|pytestmark[ \t]*=.*pytest\.mark\.gpu\b)", re.M)
"""A gpu-marked test or module (the grep -E of scripts/gpu_tests.sh matches the same lines)."""

WHAT = {
    "floor3": "3 bare GEMMs (logits, dh, dW)",
    "floor4": "4 bare GEMMs (the logits twice, dh, dW)",
    "ours-triton": "ours, logprobs + entropy, backend triton",
    "ours-torch": "ours, logprobs + entropy, backend torch",
    "ours-loss-triton": "ours, fused GRPO loss, backend triton",
    "ours-loss-torch": "ours, fused GRPO loss, backend torch",
    "ours-ce-triton": "ours, logprobs only, backend triton",
    "ours-ce-torch": "ours, logprobs only, backend torch",
    "naive": "naive: fp32 logits [n, V], logprobs + entropy",
    "naive-loss": "naive: fp32 logits [n, V], GRPO loss",
    "verl-triton": "veRL 0.9.1 Triton linear_cross_entropy, logprobs + entropy",
    "liger": "Liger-Kernel 0.8.5 fused linear cross entropy, logprobs only",
    "liger-sm90": "Liger-Kernel 0.8.5 SM90 CUTLASS-DSL scaled cross entropy, logprobs + entropy",
    "cce": "Cut Cross-Entropy 25.1.1, logprobs only (reduction none), default gradient filter",
    "cce-exact": "Cut Cross-Entropy 25.1.1, logprobs only (reduction none), filter_eps=None",
    "ours-ce-mean-triton": "ours, mean cross entropy (fused_token_loss, 3 GEMMs), backend triton",
    "liger-mean": "Liger-Kernel 0.8.5 fused linear cross entropy, reduction mean",
    "cce-mean": "Cut Cross-Entropy 25.1.1, reduction mean, default gradient filter",
    "cce-mean-exact": "Cut Cross-Entropy 25.1.1, reduction mean, filter_eps=None",
    "verl": "veRL 0.9.1 FusedLinearForPPO (torch), logprobs + entropy",
    "ours-support-ids-triton": f"ours, sampling replay by kept ids ([n, {KEPT}]), backend triton",
    "ours-support-ids-torch": f"ours, sampling replay by kept ids ([n, {KEPT}]), backend torch",
    "ours-support-topk-topp-triton": "ours, sampling replay by top_k=50, top_p=0.9, "
    "min_p=0.01, backend triton",
    "ours-support-topk-topp-torch": "ours, sampling replay by top_k=50, top_p=0.9, min_p=0.01, "
    "backend torch",
    "ours-support-topp-triton": "ours, sampling replay by top_p=0.9 (no top-k bound: the radix "
    "select), backend triton",
    "ours-support-topp-torch": "ours, sampling replay by top_p=0.9 (no top-k bound: the radix "
    "select), backend torch",
}
FAMILY_TEXT = {
    "lp+ent": "logprobs + entropy",
    "lp": "logprobs only",
    "loss": "fused GRPO loss",
    "ce-mean": "mean cross entropy",
    "replay-ids": "sampling replay by kept ids",
    "replay-topk-topp": "sampling replay by top-k, top-p, min-p",
    "replay-topp": "sampling replay by top-p alone",
}
REPLAY_TABLE = {
    # family: (the support as passed, GEMMs forward + backward on paper: docs/gpu-design.md)
    "lp": ("none (`linear_logprobs`)", 4),
    "replay-ids": (f"`kept_ids` (`K = {KEPT}`)", 4),
    "replay-topk-topp": ("`top_k=50, top_p=0.9, min_p=0.01`", 4),
    "replay-topp": ("`top_p=0.9` (no top-k bound: the radix select)", 7),
}
"""The rows of the sampling-replay table: the baseline (``ours-ce-<backend>``) and each
support, with its GEMM count for fp32 logits on paper ("Sampling replay" in
docs/gpu-design.md: a logprob is 4)."""
REPLAY_TARGET = 1.1
"""Sampling replay by kept ids costs at most this many times ``linear_logprobs``."""
MARKERS = ("run", "targets")
NO_RUN = {
    "run": (
        "No run of the current code is recorded: nothing is rendered here. From a run's folder "
        "`python -m benchmarks.gpu_results render DIR --write docs/gpu-results.md` writes its "
        "device, versions, commit and date, what it measured first, the GPU tests per "
        "megatron-core release, the benchmark at each size and the faster backend per device "
        "class."
    ),
    "targets": "No run of the current code is recorded: the same command writes each target's "
    "verdict here.",
}
"""The regions of a page with no run rendered (``render --empty``): a sentence each, not
the tables with every row "not measured"."""


# ---------------------------------------------------------------- reading a run


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """The test files holding ``gpu``-marked tests, in the order scripts/gpu_tests.sh runs them."""
    found = sorted(
        p.relative_to(root).as_posix()
        for p in (root / "tests").glob("*/test_*.py")
        if GPU_MARK.search(p.read_text())
    )
    first = [f for f in PROCESSOR_ONLY if f in found]
    return first + [f for f in found if f not in first]


def _env(root: Path) -> dict[str, Any]:
    """What one run ran on: the device, the versions, the commit and the date."""
    import torch

    env: dict[str, Any] = {"date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")}
    env["python"] = sys.version.split()[0]
    env["torch"] = torch.__version__
    env["cuda"] = torch.version.cuda or ""
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "absent"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = f"sm_{major}{minor}"
        env["device_class"] = device_class_here()
        env["device_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)
        try:
            smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(
                smi, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            env["driver"] = ""
    else:
        env["device"] = "no CUDA device"
    for folder in sorted(root.glob(".site-*")):  # --no-deps installs of the carried wheels
        for info in folder.glob("*.dist-info"):
            name, _, version = info.name[: -len(".dist-info")].partition("-")
            env.setdefault("packages", {}).setdefault(name.replace("_", "-"), []).append(version)
    wheels = sorted(p.name for p in (root / ".whl").glob("verl-*.whl"))
    if wheels:
        env.setdefault("packages", {})["verl"] = [wheels[0].split("-")[1]]
    env.update(_commit(root))
    return env


def _commit(root: Path) -> dict[str, str]:
    """The commit the run's tree was made from: ``.whl/commit.txt`` first (written by
    ``scripts/gpu_wheels.sh`` from this tree's ``git rev-parse HEAD``; the GPU machine's
    copy has no ``.git``, and a ``git`` there would answer for whatever repository holds
    the copy), else ``git`` when ``root`` is the top of its own repository."""
    stamp = root / ".whl" / "commit.txt"
    if stamp.exists():
        lines = stamp.read_text().splitlines()
        note = "; ".join(["from .whl/commit.txt (written by scripts/gpu_wheels.sh)", *lines[1:]])
        return {"commit": lines[0] if lines else "unknown", "commit_note": note}

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(
                ["git", *args], capture_output=True, text=True, cwd=root, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout if proc.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != root.resolve():
        why = "no .whl/commit.txt, and the tree is not a git checkout's top"
        return {"commit": "unknown", "commit_note": why}
    head, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain") or ""
    changed = len([ln for ln in dirty.splitlines() if ln.strip()])
    return {
        "commit": (head or "unknown").strip(),
        "commit_note": f"{changed} uncommitted paths" if changed else "clean",
    }


TEST_LINE = re.compile(r"^(tests/[\w/.-]+\.py)::(\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
STARTED = re.compile(r"^(tests/[\w/.-]+\.py)::(\S+) ?$")
COLLECT_ERROR = re.compile(r"^ERROR (?:collecting )?(tests/[\w/.-]+\.py)\b")
SUMMARY = re.compile(
    r"^=+ .*\b(passed|failed|skipped|errors?|deselected|no tests ran)\b.* in [\d.]+s"
)


def read_tests(log: Path) -> dict[str, str]:
    """Per test file, what ``pytest -v`` logged: the count of each outcome, and where
    the run was cut if its time limit ended it (a test started and never finished, or
    no summary line); the key ``"(run)"`` holds the latter."""
    if not log.exists():
        return {}
    counts: dict[str, dict[str, int]] = {}
    partial: tuple[str, str] | None = None
    finished = False
    for line in log.read_text(errors="replace").splitlines():
        m = TEST_LINE.match(line)
        c = COLLECT_ERROR.match(line)
        if m or c:
            f, outcome = (
                (m.group(1), m.group(3).lower())
                if m
                else (c.group(1), "collection error")  # type: ignore[union-attr]
            )  # fmt: skip
            per = counts.setdefault(f, {})
            per[outcome] = per.get(outcome, 0) + 1
            partial = None
        elif STARTED.match(line):
            s = STARTED.match(line)
            assert s is not None
            partial = (s.group(1), s.group(2))
        elif SUMMARY.match(line):
            finished = True
    out = {f: ", ".join(f"{n} {k}" for k, n in sorted(per.items())) for f, per in counts.items()}
    if partial is not None:
        f, test = partial
        out[f] = ", ".join(x for x in (out.get(f, ""), f"cut at the time limit in {test}") if x)
    if not finished:
        out["(run)"] = "no summary line: the run was cut at its time limit or crashed"
    return out


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.startswith("{")]


# ---------------------------------------------------------------- the tables


def _shape(size: dict[str, Any]) -> str:
    logits = size.get("logits", "flat")
    return f"{size['tokens']} x {size['hidden']} x {size['vocab']} {size['dtype']}" + (
        "" if logits == "flat" else f", {logits} logits"
    )


def _row(rows: list[dict[str, Any]], size: dict[str, Any], method: str) -> dict[str, Any] | None:
    for r in rows:
        if r["method"] == method and size_of(r) == size_of(size):
            return r
    return None


def _num(r: dict[str, Any] | None, key: str) -> float:
    v = None if r is None or r.get("error") else r.get(key)
    return float(v) if isinstance(v, (int, float)) else math.nan


def _fmt(x: float, spec: str) -> str:
    return NOT if math.isnan(x) else format(x, spec)


def _best(rows: list[dict[str, Any]], size: dict[str, Any], family: str) -> tuple[str, float]:
    """Our faster backend on ``family`` at ``size`` (the one the auto table then picks)."""
    best = ("", math.nan)
    base = {
        "lp+ent": "ours",
        "lp": "ours-ce",
        "loss": "ours-loss",
        "replay-ids": "ours-support-ids",
    }
    for backend in ("torch", "triton"):
        name = f"{base[family]}-{backend}"
        t = _num(_row(rows, size, name), "time_ms")
        if not math.isnan(t) and (math.isnan(best[1]) or t < best[1]):
            best = (name, t)
    return best


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The design's targets at the targets' size, as ``(target, verdict, measured)``:
    ratios within one run; "not measured" where a figure is missing."""
    s = TARGET_SIZE
    t = {m: _num(_row(rows, s, m), "time_ms") for m in METHODS}
    p = {m: _num(_row(rows, s, m), "peak_extra_gb") for m in METHODS}
    e = {m: _num(_row(rows, s, m), "dh_rel_err") for m in METHODS}
    lp_name, lp_t = _best(rows, s, "lp+ent")
    loss_name, loss_t = _best(rows, s, "loss")
    out = []

    def verdict(values: Iterable[float], ok: bool) -> str:
        return NOT if any(math.isnan(v) for v in values) else ("met" if ok else "not met")

    ratio = lp_t / t["floor4"]
    out.append(
        (
            "Logprobs + entropy, forward + backward: at most 1.05x the 4-GEMM floor",
            verdict([ratio], ratio <= 1.05),
            NOT
            if math.isnan(ratio)
            else f"{lp_name} {lp_t:.1f} ms = {ratio:.2f}x floor4 {t['floor4']:.1f} ms",
        )
    )
    ratio = loss_t / t["floor3"]
    out.append(
        (
            "The fused GRPO/PPO scalar loss, forward + backward: at most 1.08x the 3-GEMM floor",
            verdict([ratio], ratio <= 1.08),
            NOT
            if math.isnan(ratio)
            else f"{loss_name} {loss_t:.1f} ms = {ratio:.2f}x floor3 {t['floor3']:.1f} ms",
        )
    )
    busy = [_num(_row(rows, s, name), "busy_fraction") for name in (lp_name, loss_name)]
    out.append(
        (
            "The GPU busy at least 0.97 of each call's span (logprobs + entropy, the fused loss)",
            verdict(busy, all(b >= 0.97 for b in busy)),
            NOT if any(math.isnan(b) for b in busy) else " / ".join(f"{b:.2f}" for b in busy),
        )
    )
    out.append(peers_target(rows))
    loss_p = p.get(loss_name, math.nan)
    out.append(
        (
            "Peak extra memory of the fused loss at most 1 GB",
            verdict([loss_p], loss_p <= 1.0),
            NOT if math.isnan(loss_p) else f"{loss_name} {loss_p:.2f} GB",
        )
    )
    ours_e, naive_e = e.get(lp_name, math.nan), e["naive"]
    out.append(
        (
            "The dh error no worse than the naive bf16 path's",
            verdict([ours_e, naive_e], ours_e <= naive_e),
            NOT
            if math.isnan(ours_e)
            else f"ours {ours_e:.1e}, naive {_fmt(naive_e, '.1e')} (relative, against float64)",
        )
    )
    out.append(replay_target(rows))
    out.append(
        (
            "On the CPU, nothing slower: at 8192 x 1024 x 65536 fp32, ours at most 0.8x"
            " the naive time",
            NOT,
            "a CPU figure, not this GPU command's: measured by `python -m benchmarks.logprobs`: see"
            " [processors.md](processors.md#benchmarks)",
        )
    )
    return out


def replay_target(rows: list[dict[str, Any]]) -> tuple[str, str, str]:
    """Sampling replay by kept ids at most :data:`REPLAY_TARGET` times ``linear_logprobs``
    (logprobs only) at the targets' size on the peaked logits, where the replay rows run:
    the faster of our backends on each."""
    size = dict(TARGET_SIZE, logits="peaked")
    ids_name, ids_t = _best(rows, size, "replay-ids")
    lp_name, lp_t = _best(rows, size, "lp")
    ratio = ids_t / lp_t
    measured = NOT
    if not math.isnan(ratio):
        measured = f"{ids_name} {ids_t:.1f} ms = {ratio:.2f}x {lp_name} {lp_t:.1f} ms"
    return (
        f"Sampling replay by kept ids, forward + backward: at most {REPLAY_TARGET}x "
        "`linear_logprobs` on the same shape (peaked logits)",
        NOT if math.isnan(ratio) else ("met" if ratio <= REPLAY_TARGET else "not met"),
        measured,
    )


def replay_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The sampling-replay table of each size that runs the replay methods: each method's
    time against ``linear_logprobs`` (``ours-ce-<backend>``) on the same shape and
    backend, the GEMMs the design counts on paper, the errors against float64 over the
    kept set."""
    lines = [
        "",
        "Sampling replay (`linear_logprobs(support=)`, logprobs only; `benchmarks.gpu_methods`): "
        "each support against `linear_logprobs` on the same shape and backend (`ours-ce-torch`, "
        "`ours-ce-triton`), from the rows above; GEMMs: the design's count on paper "
        '(docs/gpu-design.md, "Sampling replay"), not measured; errors relative to float64 '
        "over the kept set (the logprob over the rows whose label it keeps).",
    ]
    for size in SIZES:
        replay = methods_at(size, REPLAY_METHODS)
        if not replay:
            continue
        lines += [
            "",
            f"{_shape(size)}:",
            "",
            "| method | support | backend | time ms | x linear_logprobs | GEMMs (on paper) "
            "| logprob rel err | dh rel err | dW rel err | note |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        base = {b: _num(_row(rows, size, f"ours-ce-{b}"), "time_ms") for b in ("triton", "torch")}
        for m in [f"ours-ce-{b}" for b in base] + replay:
            r = _row(rows, size, m)
            backend = METHODS[m].backend
            support, gemms = REPLAY_TABLE[METHODS[m].family]
            t = _num(r, "time_ms")
            cells = [_fmt(t, ".1f"), _fmt(t / base[backend], ".2f"), str(gemms)]
            cells += [_fmt(_num(r, k), ".1e") for k in ("lp_rel_err", "dh_rel_err", "dw_rel_err")]
            note = "; ".join(
                x for x in ((r or {}).get("error", ""), (r or {}).get("note", "")) if x
            )
            lines.append(
                f"| {m} | {support} | {backend} | "
                + " | ".join(cells)
                + f" | {note.replace('|', '/')} |"
            )
    return lines


LIKE_WITH_LIKE = (
    ("ours-triton", ("verl-triton", "liger-sm90")),
    ("ours-ce-triton", ("liger", "cce", "cce-exact")),
    ("ours-ce-mean-triton", ("liger-mean", "cce-mean", "cce-mean-exact")),
)
"""Ours and the peers doing the same work: logprobs + entropy; per-token logprobs
(``reduction="none"``); the mean cross entropy, a scalar (3 GEMMs)."""


def peers_target(rows: list[dict[str, Any]]) -> tuple[str, str, str]:
    """Ours faster than every peer on the same work, at the targets' size, on the flat
    and the peaked logits; "not measured" while a pair is missing (a peer that cannot
    run here, such as Liger's SM90 path without its package, is left out and named)."""
    parts, verdicts = [], []
    for logits in ("flat", "peaked"):
        size = dict(TARGET_SIZE, logits=logits)
        for ours, peers in LIKE_WITH_LIKE:
            t_ours = _num(_row(rows, size, ours), "time_ms")
            for peer in peers:
                r = _row(rows, size, peer)
                t_peer = _num(r, "time_ms")
                if peer == "liger-sm90" and (
                    r is None or r.get("error")
                ):  # needs a package not carried
                    parts.append(f"{logits}: {peer} left out ({NOT}: its package is not carried)")
                    continue
                if math.isnan(t_ours) or math.isnan(t_peer):
                    verdicts.append(NOT)
                    parts.append(f"{logits}: {ours} / {peer} {NOT}")
                    continue
                verdicts.append("met" if t_ours < t_peer else "not met")
                parts.append(f"{logits}: {ours} {t_ours:.1f} / {peer} {t_peer:.1f} ms")
    v = "not met" if "not met" in verdicts else (NOT if NOT in verdicts or not verdicts else "met")
    measured = NOT if all(x == NOT for x in verdicts) else "; ".join(parts)
    return (
        "Faster than every peer on the same work (veRL Triton and Liger SM90 for logprobs + "
        "entropy; Liger and CCE, default and exact, per token and as a mean), on flat and "
        "peaked logits",
        v,
        measured,
    )


def backend_choice(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per device class, size and path, our two backends' times and the faster one."""
    out = []
    seen = set()
    for r in rows:
        if not r.get("backend") or r.get("error"):
            continue
        key = (r.get("device_class", "?"), size_of(r), r["family"])
        if key in seen:
            continue
        seen.add(key)
        size = dict(zip(SIZE_KEYS, key[1], strict=True))
        base = r["method"].rsplit("-", 1)[0]
        times = {b: _num(_row(rows, size, f"{base}-{b}"), "time_ms") for b in ("torch", "triton")}
        if any(math.isnan(x) for x in times.values()):
            continue
        faster = min(times, key=lambda b: times[b])
        out.append({
            "device_class": key[0], "device": r.get("device", ""), "size": _shape(size),
            "dtype": size["dtype"], "path": FAMILY_TEXT[r["family"]], "torch_ms": times["torch"],
            "triton_ms": times["triton"], "faster": faster,
            "ratio": max(times.values()) / min(times.values()),
        })  # fmt: skip
    return out


def class_choice(rows: list[dict[str, Any]]) -> dict[str, tuple[str, float, float, int]]:
    """Per device class, the backend with the smaller total time over every (size, path)
    measured on both backends: ``{class: (backend, torch ms, triton ms, pairs)}``, the one
    row of the ``backend="auto"`` table a class gets."""
    totals: dict[str, list[float]] = {}
    for c in backend_choice(rows):
        t = totals.setdefault(c["device_class"], [0.0, 0.0, 0])
        t[0] += c["torch_ms"]
        t[1] += c["triton_ms"]
        t[2] += 1
    return {k: ("torch" if a < b else "triton", a, b, int(n)) for k, (a, b, n) in totals.items()}


MEASURE_WHAT = {
    "mm": "achieved TFLOP/s",
    "copy": "GB/s (read + written)",
    "kernel": "GB/s, and the fraction of the copy bandwidth",
    "floor": "",
}
MEASURE_ORDER = (
    "mm bf16->bf16",
    "mm bf16->fp32",
    "dh gemm strided",
    "dh gemm contiguous",
    "dW gemm strided",
    "dW gemm contiguous",
    "copy 1024 MiB",
    "floor3",
    "floor4",
)
"""The rows ``benchmarks.gpu_measure`` writes on a GPU, in its order (the kernels' rows,
named by the run, go between the copy and the floors)."""


def model_predictions(device_class: str | None) -> dict[str, dict[str, float]]:
    """``{device class: {pass: predicted ms}}`` from ``benchmarks.gpu_model`` when it
    exists (imported here, on use), for ``device_class`` or every class it offers; ``{}``
    without it."""
    try:
        model = importlib.import_module("benchmarks.gpu_model")
    except ImportError:
        return {}
    predict = getattr(model, "predicted_ms", None)
    if not callable(predict):
        return {}
    classes = (
        [device_class] if device_class else list(getattr(model, "DEVICE_CLASSES", ("H100", "H200")))
    )
    out = {}
    for cls in classes:
        try:
            got = predict(cls)
        except (KeyError, ValueError):  # a class the model has no figures for
            continue
        out[cls] = {str(k): float(v) for k, v in dict(got).items()}
    return out


def measure_lines(
    mrows: list[dict[str, Any]], rows: list[dict[str, Any]], env: dict[str, Any]
) -> list[str]:
    """The tables of what the command measures first, and, where ``benchmarks.gpu_model``
    predicts them, each pass's measured and predicted time side by side."""
    lines = [
        "",
        "Measured first (`benchmarks.gpu_measure`, before the tests: median of 10 after 3 "
        "warm-ups, CUDA events): `torch.mm` at the Triton backend's logits chunk of the "
        "targets' size (bf16 and fp32 out; the gradient GEMMs on the in-place gradient's "
        "doubled-stride view and on a contiguous copy), the copy bandwidth, each Triton "
        "kernel alone, the floors:",
        "",
        "| measurement | shape | time ms | rate | note |",
        "|---|---|---|---|---|",
    ]
    by_case = {r["case"]: r for r in mrows}
    kernels = [r["case"] for r in mrows if r.get("what") == "kernel"]
    order = [*MEASURE_ORDER[:7], *(kernels or ["kernel (each Triton kernel)"]), *MEASURE_ORDER[7:]]
    order += [c for c in by_case if c not in order]  # a run's other rows (a CPU dry run's names)
    for case in order:
        r = by_case.get(case)
        if r is None or r.get("error") or "time_ms" not in r:
            note = (r or {}).get("error", "")
            lines.append(
                f"| {case} | {(r or {}).get('shape', '')} | {NOT} | | {note.replace('|', '/')} |"
            )
            continue
        if "tflops" in r:
            rate = f"{r['tflops']:.0f} TFLOP/s"
        elif "gbps" in r:
            rate = f"{r['gbps']:.0f} GB/s" + (
                f" = {r['of_copy']:.2f} of copy" if "of_copy" in r else ""
            )
        else:
            rate = ""
        note = f"stride {tuple(r['stride'])}" if "stride" in r else ""
        lines.append(f"| {case} | {r.get('shape', '')} | {r['time_ms']:.3f} | {rate} | {note} |")
    predicted = model_predictions(env.get("device_class"))
    if predicted:
        measured = measured_passes(mrows)
        for m in METHODS:
            t = _num(_row(rows, TARGET_SIZE, m), "time_ms")
            if not math.isnan(t):
                measured[m] = t
        for cls, passes in predicted.items():
            lines += [
                "",
                f"Measured against `benchmarks.gpu_model`'s prediction for {cls} "
                f"(docs/gpu-design.md), per pass, at {_shape(TARGET_SIZE)}:",
                "",
                "| pass | measured ms | predicted ms | measured / predicted |",
                "|---|---|---|---|",
            ]
            for name, p in passes.items():
                t = measured.get(name, math.nan)
                ratio = _fmt(t / p if p else math.nan, ".2f")
                lines.append(f"| {name} | {_fmt(t, '.3f')} | {p:.3f} | {ratio} |")
    return lines


def render(directory: Path | None) -> dict[str, str]:
    """The two generated regions of the page, ``{"run": ..., "targets": ...}``."""
    env: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    logs: dict[str, dict[str, str]] = {}
    mrows: list[dict[str, Any]] = []
    if directory is not None:
        if (directory / "env.json").exists():
            env = json.loads((directory / "env.json").read_text())
        rows = read_rows(directory / RESULTS)
        mrows = read_rows(directory / MEASURE_RESULTS)
        logs = {rel: read_tests(directory / f"tests-{rel}.log") for rel in RELEASES}
    pk = env.get("packages", {})

    def versions(name: str) -> str:
        return ", ".join(pk.get(name, [])) or NOT

    device = env.get("device", NOT)
    if env.get("device_class"):
        device += f" (class {env['device_class']}, {env.get('capability', '?')}, "
        device += f"{env.get('device_memory_gb', '?')} GB, driver {env.get('driver', '?')})"
    lines = [] if env or rows or mrows else [f"No run is recorded yet: every row says {NOT}.", ""]
    lines += [
        "| run | |",
        "|---|---|",
        f"| device | {device} |",
        f"| torch | {env.get('torch', NOT)}"
        + (f" (CUDA {env['cuda']})" if env.get("cuda") else "")
        + " |",
        f"| triton | {env.get('triton', NOT)} |",
        f"| megatron-core | {versions('megatron-core')} |",
        f"| liger-kernel, cut-cross-entropy, veRL | {versions('liger-kernel')}, "
        f"{versions('cut-cross-entropy')}, {versions('verl')} |",
        f"| commit | {env.get('commit', NOT)}"
        + (f" ({env['commit_note']})" if env.get("commit_note") else "")
        + " |",
        f"| date (UTC) | {env.get('date_utc', NOT)} |",
    ]
    lines += measure_lines(mrows, rows, env)
    lines += [
        "",
        "GPU tests (`pytest -v -m gpu`, one run per megatron-core release; the files that test "
        "no Megatron code run on the first release only):",
        "",
        "| test file | " + " | ".join(f"megatron-core {rel}" for rel in RELEASES) + " |",
        "|---|" + "---|" * len(RELEASES),
    ]
    for f in gpu_test_files():
        cells = []
        for i, rel in enumerate(RELEASES):
            if i > 0 and f in PROCESSOR_ONLY:
                cells.append("not run on this release (tests no Megatron code)")
            else:
                cells.append(logs.get(rel, {}).get(f) or NOT)
        lines.append(f"| `{f}` | " + " | ".join(cells) + " |")
    if any("(run)" in logs.get(rel, {}) for rel in RELEASES):
        lines.append(
            "| the whole run | "
            + " | ".join(logs.get(rel, {}).get("(run)", "") for rel in RELEASES)
            + " |"
        )
    lines += [
        "",
        "Benchmark (`benchmarks.gpu_logprobs`): forward + backward with ones as cotangents, "
        "median of 3 after 1 warm-up (CUDA events), peak extra memory as the growth of "
        "`max_memory_allocated`, `dh` and `dW` errors relative to float64 on a subset of rows "
        "and vocabulary entries; busy: the GPU's busy fraction (kernel time over the event span) "
        "of one profiled call after the timed ones, with its kernels and launches.",
    ]
    for size in SIZES:
        f3 = _num(_row(rows, size, "floor3"), "time_ms")
        f4 = _num(_row(rows, size, "floor4"), "time_ms")
        lines += [
            "",
            f"{_shape(size)}:",
            "",
            "| method | what | time ms | x floor3 | x floor4 | peak extra GB | dh rel err "
            "| dW rel err | busy | kernels / launches | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m in methods_at(size, list(METHODS)):
            r = _row(rows, size, m)
            t = _num(r, "time_ms")
            note = "; ".join(
                x for x in ((r or {}).get("error", ""), (r or {}).get("note", "")) if x
            )
            if math.isnan(t):
                cells = [NOT, "", "", "", "", "", "", ""]
            else:
                na = "n/a" if METHODS[m].family == "floor" else NOT
                cells = [
                    f"{t:.1f}",
                    _fmt(t / f3, ".2f"),
                    _fmt(t / f4, ".2f"),
                    _fmt(_num(r, "peak_extra_gb"), ".2f"),
                    na if math.isnan(_num(r, "dh_rel_err")) else f"{_num(r, 'dh_rel_err'):.1e}",
                    na if math.isnan(_num(r, "dw_rel_err")) else f"{_num(r, 'dw_rel_err'):.1e}",
                    _fmt(_num(r, "busy_fraction"), ".2f"),
                    f"{r['kernels']} / {r['launches']}" if r and "kernels" in r else NOT,
                ]
            lines.append(
                f"| {m} | {WHAT[m]} | " + " | ".join(cells) + f" | {note.replace('|', '/')} |"
            )
    lines += replay_lines(rows)
    choice = backend_choice(rows)
    lines += [
        "",
        'The faster backend per device class, size and path (what the `backend="auto"` table is '
        "filled from):",
        "",
        "| device class | size | path | torch ms | triton ms | faster |",
        "|---|---|---|---|---|---|",
    ]
    for c in choice:
        lines.append(
            f"| {c['device_class']} ({c['device']}) | {c['size']} | {c['path']} "
            f"| {c['torch_ms']:.1f} | {c['triton_ms']:.1f} | {c['faster']} ({c['ratio']:.2f}x) |"
        )
    if not choice:
        lines.append(f"| {NOT} | | | | | |")
    for cls, (backend, a, b, n) in class_choice(rows).items():
        lines += ["", f"Device class {cls}: over {n} size and path pairs, torch {a:.1f} ms "
                  f"and triton {b:.1f} ms in all: `backend=\"auto\"` row `{backend}`."]  # fmt: skip
    tl = [
        f"At {_shape(TARGET_SIZE)}, ratios within one run; "
        '"ours" is the faster of our two backends.',
        "",
        "| target | verdict | measured |",
        "|---|---|---|",
    ]
    tl += [f"| {a} | {b} | {c} |" for a, b, c in targets(rows)]
    return {"run": "\n".join(lines), "targets": "\n".join(tl)}


def write_page(page: Path, regions: dict[str, str]) -> None:
    """Replace each ``<!-- gpu-results:NAME -->`` ... ``<!-- gpu-results:NAME end -->`` region."""
    text = page.read_text()
    for name, body in regions.items():
        start, end = f"<!-- gpu-results:{name} -->", f"<!-- gpu-results:{name} end -->"
        i, j = text.find(start), text.find(end)
        if i < 0 or j < i:
            raise SystemExit(f"gpu_results: {page} has no {start} ... {end} region")
        text = text[: i + len(start)] + "\n" + body + "\n" + text[j:]
    page.write_text(text)


def _env_of(directory: Path | None) -> dict[str, Any]:
    path = None if directory is None else directory / "env.json"
    return json.loads(path.read_text()) if path is not None and path.exists() else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    e = sub.add_parser("env", help="record the device, versions, commit and date in DIR/env.json")
    e.add_argument("dir", type=Path)
    r = sub.add_parser("render", help="the page's generated regions from DIR")
    r.add_argument("dir", type=Path, nargs="?")
    r.add_argument("--empty", action="store_true", help="no run: the regions say so (no DIR)")
    r.add_argument(
        "--write", type=Path, help="replace the regions in this page (docs/gpu-results.md)"
    )
    args = ap.parse_args(argv)
    if args.command == "env":
        args.dir.mkdir(parents=True, exist_ok=True)
        env = _env(ROOT)
        (args.dir / "env.json").write_text(json.dumps(env, indent=1) + "\n")
        print(json.dumps(env))
        return 0
    if (args.dir is None) != args.empty:
        ap.error("give DIR, or --empty for a page with no run")
    regions = dict(NO_RUN) if args.empty else render(args.dir)
    text = f"{regions['run']}\n\nTargets:\n\n{regions['targets']}\n"
    if args.dir is not None:
        (args.dir / "gpu-results.md").write_text(text)
    if args.write is not None:
        write_page(args.write, regions)
    print(text)
    rows = [] if args.dir is None else read_rows(args.dir / RESULTS)
    env = _env_of(args.dir)
    where = (
        f"docs/gpu-results.md: run of {env.get('date_utc', '?')} "
        f"on commit {env.get('commit', '?')[:12]}"
    )
    for cls, (backend, _, _, n) in class_choice(rows).items():
        row = f'"{cls}": BackendChoice("{backend}", measured=True, source="{where}")'
        print(f"auto table row: {row}  # {n} size and path pairs")
    for c in backend_choice(rows):
        print(f"auto table: {c['device_class']} ({c['device']}) {c['size']} {c['path']}: "
              f"torch {c['torch_ms']:.1f} ms, triton {c['triton_ms']:.1f} ms "
              f"-> {c['faster']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The benchmark machinery at toy sizes, in this process (a subprocess per method
would cost seconds each): the methods agree on the quantities they time, the
summary and plot are written, and the hook-overhead run is bitwise stock."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from benchmarks import _worker, hook_overhead, logprobs
from benchmarks.methods import VERL_ENV

TOY = {"tokens": 64, "hidden": 16, "vocab": 300, "dtype": "fp32"}
VERL_FILE = (
    Path(__file__).resolve().parent.parent
    / ".venvs/cache/verl/verl-0.9.1/verl/utils/experimental/torch_functional.py"
)


def test_logprob_methods_agree() -> None:
    methods = ["naive", "ours"]
    if VERL_FILE.exists() or os.environ.get(VERL_ENV):
        os.environ.setdefault(VERL_ENV, str(VERL_FILE))
        methods.append("verl")
    results = {m: _worker.run(dict(TOY, method=m)) for m in methods}
    for m in methods:
        assert results[m]["check"] == pytest.approx(results["naive"]["check"], rel=1e-5), m
        assert results[m]["grad_norm_h"] == pytest.approx(results["naive"]["grad_norm_h"], rel=1e-5), m
        assert results[m]["time_s"] > 0 and results[m]["peak_extra_mib"] >= 0


def test_policy_methods_agree() -> None:
    results = {
        m: _worker.run(dict(TOY, method=m))
        for m in ("policy-naive", "policy-ours-autograd", "policy-ours-fused")
    }
    for r in results.values():
        assert r["check"] == pytest.approx(results["policy-naive"]["check"], rel=1e-5)
        assert r["grad_norm_h"] == pytest.approx(results["policy-naive"]["grad_norm_h"], rel=1e-4)


def test_summary_and_plot(tmp_path: Path) -> None:
    rows = []
    for dtype in ("fp32", "bf16"):
        for method, t, mem in (("naive", 10.0, 1000.0), ("verl", 9.0, 100.0), ("ours", 8.0, 30.0)):
            rows.append(
                dict(section="main", dtype=dtype, method=method, time_s=t, peak_extra_mib=mem, load_avg=1.0)
            )
        rows.append(
            dict(
                section="main",
                dtype=dtype,
                method="policy-naive",
                time_s=10.0,
                peak_extra_mib=1000.0,
                load_avg=1.0,
            )
        )
        rows.append(
            dict(
                section="main",
                dtype=dtype,
                method="policy-ours-fused",
                time_s=11.0,
                peak_extra_mib=50.0,
                load_avg=1.0,
            )
        )
    for n in (1, 2):
        for method in ("naive", "ours"):
            rows.append(
                dict(
                    section="sweep-tokens",
                    dtype="fp32",
                    method=method,
                    tokens=n,
                    time_s=n * 1.0,
                    peak_extra_mib=5.0,
                    load_avg=1.0,
                )
            )
    by_case: dict[tuple[str, str, int], dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault((r["section"], r["dtype"], r.get("tokens", 0)), {})[r["method"]] = r
    for case in by_case.values():
        for r in case.values():
            base = case.get("policy-naive" if r["method"].startswith("policy") else "naive")
            r["time_vs_naive"] = r["time_s"] / base["time_s"]
            r["mem_vs_naive"] = r["peak_extra_mib"] / base["peak_extra_mib"]
            if "verl" in case and not r["method"].startswith("policy"):
                r["time_vs_verl"] = r["time_s"] / case["verl"]["time_s"]
    summary = logprobs._summary(rows, "cpu", {"liger": "GPU only"}, argparse.Namespace(repeats=2))
    assert "| peak extra memory <= 5% of naive | fp32 | 0.030 | yes |" in summary
    assert "| policy loss in the processor <= 1.05x naive | bf16 | 1.10 | no |" in summary
    assert "Not run: liger (GPU only)." in summary
    logprobs._plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_hook_overhead_run_is_bitwise_stock(tmp_path: Path) -> None:
    size = dict(hook_overhead.QUICK, iters=1, seq=16, vocab=256)
    rows = hook_overhead.run(size)
    assert [r["variant"] for r in rows] == ["stock", "enabled, no processor", "enabled, pass-through"]
    assert all(r["same_loss_bitwise"] for r in rows)
    hook_overhead._plot(rows, tmp_path / "h.png")
    assert torch.isfinite(torch.tensor([r["median_vs_stock"] for r in rows])).all()

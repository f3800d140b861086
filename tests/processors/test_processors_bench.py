"""The benchmark machinery at toy sizes, in this process (a subprocess per method
would cost seconds each): the methods agree on the quantities they time, the
summary and plot are written, and the hook-overhead run is bitwise stock."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from benchmarks import _worker, hook_overhead, logprobs
from benchmarks.methods import VERL_ENV

TOY = {"tokens": 64, "hidden": 16, "vocab": 300, "dtype": "fp32"}
VERL_FILE = (
    Path(__file__).resolve().parents[2]
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
        assert results[m]["grad_norm_h"] == pytest.approx(
            results["naive"]["grad_norm_h"], rel=1e-5
        ), m
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
    def case(
        section: str, dtype: str, figures: dict[str, tuple[float, float]], tokens: int = 8
    ) -> list[dict]:
        rows = [
            dict(section=section, dtype=dtype, method=m, time_s=t, peak_extra_mib=mem, load_avg=1.0,
                 tokens=tokens, hidden=4, vocab=16)
            for m, (t, mem) in figures.items()
        ]  # fmt: skip
        return logprobs.add_ratios(rows)

    policy = {"policy-naive": (10.0, 1000.0), "policy-ours-fused": (11.0, 50.0)}
    rows = case(
        "main",
        "fp32",
        {"naive": (10.0, 1000.0), "verl": (9.0, 100.0), "ours": (8.0, 30.0), **policy},
    )
    rows += case(
        "main",
        "bf16",
        {"naive-upcast": (5.0, 800.0), "ours": (4.0, 20.0), "policy-naive-upcast": (5.0, 800.0)},
    )
    rows += case(
        "bf16-small", "bf16", {"naive": (20.0, 100.0), "verl": (30.0, 50.0), "ours": (2.0, 10.0)}
    )
    for n in (1, 2):
        rows += case(
            "sweep-tokens", "fp32", {"naive": (n * 1.0, 5.0), "ours": (n * 0.9, 1.0)}, tokens=n
        )
    assert rows[2]["time_vs_verl"] == pytest.approx(8.0 / 9.0)
    assert rows[6]["baseline"] == "naive-upcast" and rows[6]["time_vs_naive"] == pytest.approx(0.8)
    summary = logprobs._summary(rows, "cpu", {"liger": "GPU only"}, argparse.Namespace(repeats=2))
    assert "| peak extra memory <= 5% of naive | main fp32 | 0.030 | yes |" in summary
    assert (
        "| policy loss in the processor <= 1.05x policy-naive | main fp32 | 1.10 | no |" in summary
    )
    assert "| logprobs+entropy fwd+bwd <= 0.8x naive-upcast | main bf16 | 0.80 | yes |" in summary
    assert "| logprobs+entropy fwd+bwd <= veRL | bf16-small bf16 | 0.067 | yes |" in summary
    assert "Not run: liger (GPU only)." in summary
    logprobs._plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_hook_overhead_run_is_bitwise_stock(tmp_path: Path) -> None:
    size = dict(hook_overhead.QUICK, iters=2, seq=16, vocab=256)
    rows = hook_overhead.run(size)
    assert [r["variant"] for r in rows] == list(hook_overhead.VARIANTS)
    assert all(r["same_loss_bitwise"] for r in rows)
    stock, no_processor, passthrough = rows
    assert stock["paired_median_vs_stock"] == 1.0 and stock["adapter_us_per_call"] == 0.0
    assert no_processor["adapter_us_per_call"] == 0.0
    for r in rows:
        assert r["paired_ci95_low"] <= r["paired_median_vs_stock"] <= r["paired_ci95_high"]
        assert r["iters"] == 2
    # The adapter's per-call work is timed: positive, and a fraction of the stock step.
    assert 0 < passthrough["adapter_us_per_call"] * 1e-6 < stock["median_s"]
    assert passthrough["adapter_vs_stock_step"] == pytest.approx(
        passthrough["adapter_us_per_call"] * 1e-6 / stock["median_s"]
    )
    hook_overhead._plot(rows, tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 1000


def test_median_interval_brackets_the_median() -> None:
    values = [1.0, 1.02, 0.98, 1.01, 0.99, 1.03, 0.97]
    lo, hi = hook_overhead.median_interval(values, resamples=500)
    assert min(values) <= lo <= 1.0 <= hi <= max(values)
    assert hook_overhead.median_interval([2.0] * 5) == (2.0, 2.0)
    # Seeded: the same interval each run.
    assert hook_overhead.median_interval(values, resamples=500) == (lo, hi)

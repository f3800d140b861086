"""The GPU benchmark's machinery, run on a CPU at a tiny size: every method in one
worker process, the float64 errors beside the times, a method that needs CUDA
reported as such, and the targets marked "not measured" without a GPU."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch

from benchmarks import gpu_logprobs


def test_quick_cpu_run(tmp_path: Path) -> None:
    methods = "naive,ours-torch,ours-ce-torch,floor3,liger"
    assert (
        gpu_logprobs.main(
            [
                "--quick",
                "--device",
                "cpu",
                "--methods",
                methods,
                "--runs",
                "2",
                "--warmup",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    with (tmp_path / "gpu_logprobs.csv").open() as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(methods.split(","))
    assert rows["liger"]["error"] == "needs CUDA"
    for m in ("naive", "ours-torch", "ours-ce-torch"):
        assert rows[m]["error"] == "", rows[m]
        assert float(rows[m]["time_ms"]) > 0
        assert float(rows[m]["dh_rel_err"]) < 1e-5 and float(rows[m]["dw_rel_err"]) < 1e-5  # fp32 vs float64
    report = (tmp_path / "gpu_logprobs.md").read_text()
    assert report.count("**not measured**") == 5
    assert json.loads((tmp_path / "gpu_logprobs.json").read_text())["header"].startswith("Measured")


def test_reference_matches_autograd() -> None:
    """The row-subset float64 reference equals autograd on the full logits."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(29, 8, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 29, (13,), generator=g)
    logp = (h @ w.T).log_softmax(-1)
    (logp.gather(1, y[:, None]).sum() - (logp.exp() * logp).sum()).backward()
    rows, cols = torch.tensor([0, 5, 12]), torch.tensor([1, 2, 28])
    dh, dw = gpu_logprobs.reference(h.detach(), w.detach(), y, rows, cols, entropy=True)
    torch.testing.assert_close(dh, h.grad[rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(dw, w.grad[cols], rtol=0, atol=1e-12)

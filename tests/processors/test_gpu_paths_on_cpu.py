"""The GPU-only code paths, run on the CPU: every method of the GPU benchmark
(``benchmarks.gpu_logprobs`` with ``benchmarks.gpu_methods``), its profiled call
(``benchmarks.gpu_profile``) and its two logits distributions, at a tiny size, the
Triton backend under Triton's interpreter. An API the benchmark calls that has moved
fails here, in CI, and not on the GPU. (The doctor's GPU checks: ``tests/releases/test_doctor.py``;
``benchmarks.gpu_measure``: ``tests/processors/test_gpu_bench.py``.)
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from benchmarks import gpu_logprobs
from benchmarks.gpu_methods import METHODS
from benchmarks.gpu_profile import busy_of_intervals, profile_call

pytestmark = [  # the interpreter's numpy: both sides of tl.where; Triton 3.6's array-to-int
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter"),
]
TINY = {"tokens": 40, "hidden": 24, "vocab": 300, "dtype": "fp32"}


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="the Triton methods need triton"
)
@pytest.mark.parametrize("logits", ["flat", "peaked"])
def test_every_benchmark_method_runs_on_the_cpu(logits: str) -> None:
    """Ours, naive and the floors run and match float64; a peer that needs CUDA or its
    package (veRL's torch file) says so."""
    size = dict(TINY, logits=logits)
    rows = {
        r["method"]: r
        for r in gpu_logprobs.run_size(size, list(METHODS), device="cpu", runs=1, warmup=0)
    }
    assert set(rows) == set(METHODS)
    for name, method in METHODS.items():
        r = rows[name]
        assert r["logits"] == logits
        if method.cuda_only:
            assert r["error"] == "needs CUDA", r
            continue
        if not name.startswith(("ours", "naive", "floor")) and "not found" in r["error"]:
            continue  # a peer's package not here
        assert r["error"] == "", r
        assert r["time_ms"] > 0 and r["profile_cpu_ops"] > 0, r
        assert r["busy_fraction"] is None and "no CUDA kernels" in r["busy_note"]
        if method.family != "floor":  # fp32 against float64
            assert r["dh_rel_err"] < 1e-4 and r["dw_rel_err"] < 1e-4, r
    if logits == "peaked":
        assert abs(rows["floor3"]["mean_entropy"] - gpu_logprobs.PEAKED_ENTROPY) < 0.05


def test_peaked_logits_are_a_language_models() -> None:
    """A mean entropy of a few nats (flat: near log V), and labels the model finds likely."""
    size = {"tokens": 256, "hidden": 32, "vocab": 2000, "dtype": "fp32"}
    for logits in ("flat", "peaked"):
        h, w, y, info = gpu_logprobs.make_inputs(dict(size, logits=logits), "cpu")
        logp = (h.detach() @ w.detach().T).log_softmax(-1)
        entropy = float(-(logp.exp() * logp).sum(-1).mean())
        label_lp = float(logp.gather(1, y[:, None]).mean())
        if logits == "flat":
            assert entropy > math.log(2000) - 1.0 and label_lp < -math.log(2000) + 1.0
        else:
            assert abs(entropy - gpu_logprobs.PEAKED_ENTROPY) < 0.3, entropy
            assert label_lp > -entropy - 1.0, (
                label_lp,
                entropy,
            )  # drawn from the softmax: E[lp] = -H
            assert info["hidden_scale"] > 1.0


def test_a_size_runs_its_methods_only() -> None:
    big = next(s for s in gpu_logprobs.SIZES if s["tokens"] == 32768)
    assert "naive" not in gpu_logprobs.methods_at(big, list(METHODS))
    peaked = next(s for s in gpu_logprobs.SIZES if s["logits"] == "peaked")
    assert set(gpu_logprobs.methods_at(peaked, list(METHODS))) == set(gpu_logprobs.PEERS_ON_PEAKED)
    shapes = {(s["tokens"], s["hidden"], s["vocab"], s["dtype"]) for s in gpu_logprobs.SIZES}
    assert {
        (8192, 4096, 151936, "bf16"),
        (32768, 4096, 151936, "bf16"),
        (8192, 1024, 65536, "bf16"),
    } <= shapes
    assert gpu_logprobs.SIZES[-1]["dtype"] == "fp32"  # the optional one last


def test_busy_fraction_is_the_union_of_intervals() -> None:
    assert busy_of_intervals([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4.0
    assert busy_of_intervals([]) == 0.0


def test_profile_on_the_cpu_counts_host_ops() -> None:
    a = torch.randn(8, 8)
    got = profile_call(lambda: (a @ a).relu().sum(), device="cpu")
    assert got["profile_cpu_ops"] >= 3 and got["busy_fraction"] is None

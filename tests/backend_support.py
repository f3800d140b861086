"""The processors' ``backend="auto"`` forced to one backend for a test; the
float64 comparison that the option tests share (their ``backend`` fixture, each
backend in turn, is ``tests/conftest.py``'s)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from torch_impl.processors import BackendChoice

__all__ = ["close_to_float64", "force_backend", "skip_fp64_triton"]


def force_backend(monkeypatch: pytest.MonkeyPatch, name: str) -> str:
    """Make ``"auto"`` answer ``name`` (the table's entry for any device) for the rest
    of the test; skip where ``name`` is ``"triton"`` and Triton is not installed."""
    if name == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here (py311's CPU torch wheel has none); the torch backend runs")
    choice = BackendChoice(name, measured=False, source="test")
    monkeypatch.setattr("torch_impl.processors._options.auto_choice", lambda device: choice)
    return name


def close_to_float64(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` computed in ``dtype`` against float64's ``want``: fp64 to 1e-12, fp32 to
    2e-5 of the largest entry (a logit gradient rounded once)."""
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got.detach().double(), want, rtol=tol, atol=tol * float(want.abs().max()))


def skip_fp64_triton(backend: str, dtype: torch.dtype) -> None:
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernels take fp32/bf16/fp16")

"""The processors' ``backend="auto"`` forced to one backend for a test."""

from __future__ import annotations

import importlib.util

import pytest

from torch_impl.processors import BackendChoice

__all__ = ["force_backend"]


def force_backend(monkeypatch: pytest.MonkeyPatch, name: str) -> str:
    """Make ``"auto"`` answer ``name`` (the table's entry for any device) for the rest
    of the test; skip where ``name`` is ``"triton"`` and Triton is not installed."""
    if name == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here (py311's CPU torch wheel has none); the torch backend runs")
    choice = BackendChoice(name, measured=False, source="test")
    monkeypatch.setattr("torch_impl.processors._options.auto_choice", lambda device: choice)
    return name

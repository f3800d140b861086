"""The tiny CPU ``HybridModel``, for the tests: the names of
:mod:`torch_impl.tiny_hybrid`, its supported home, re-exported."""

from __future__ import annotations

from torch_impl.tiny_hybrid import build_tiny_hybrid, cpu_hybrid_stack_spec

__all__ = ["build_tiny_hybrid", "cpu_hybrid_stack_spec"]

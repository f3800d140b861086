"""The tiny CPU ``HybridModel``, for the tests: :mod:`torch_impl.tiny_hybrid`, its one
home, under the test-support roof. Its names and ``__all__`` are that module's, not a
copy."""

from __future__ import annotations

from torch_impl.tiny_hybrid import *  # noqa: F403
from torch_impl.tiny_hybrid import __all__ as __all__

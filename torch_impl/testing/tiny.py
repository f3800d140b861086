"""The tiny CPU GPT, for the tests: :mod:`torch_impl.tiny`, its one home (the doctor and
``hookcheck`` read it there, and the library never imports this package), under the
test-support roof so that test code keeps one import for its support. Its names and
``__all__`` are that module's, not a copy."""

from __future__ import annotations

from torch_impl.tiny import *  # noqa: F403
from torch_impl.tiny import __all__ as __all__

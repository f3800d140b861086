"""The caller's state a tool keeps: :mod:`torch_impl.process_state`, where the
tools (library code) read it; named here too for the tests that import it so."""

from __future__ import annotations

from ..process_state import CallerState, callers_state_kept

__all__ = ["CallerState", "callers_state_kept"]

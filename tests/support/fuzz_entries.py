"""The contract fuzzer's entry points and their weights: :func:`draw_case` picks one
and draws its arguments (test support for ``tests/contract/test_contract_fuzz.py``)."""

from __future__ import annotations

from collections.abc import Callable

from .fuzz_processors import PROCESSOR_ENTRIES
from .fuzz_support import Case, Draw
from .fuzz_surface import SURFACE_ENTRIES
from .fuzz_tensors import TENSOR_ENTRIES

__all__ = ["ENTRIES", "draw_case"]

ENTRIES: dict[str, tuple[Callable[[Draw], Case], int]] = {
    **PROCESSOR_ENTRIES,
    **TENSOR_ENTRIES,
    **SURFACE_ENTRIES,
}
"""entry point -> (its case generator, its weight among the entries)."""


def draw_case(d: Draw) -> Case:
    """One case: an entry point (by weight) and its drawn arguments."""
    names = sorted(ENTRIES)
    name = d.rng.choices(names, weights=[ENTRIES[n][1] for n in names])[0]
    return ENTRIES[name][0](d)

"""The temperature stays inside the engine: no epilogue module (``_fused``, ``_distill``,
``_topk``) names how it is applied (folded into the hidden rows, scaled per tile, or
inside the Triton kernels). An epilogue reads a tile's values through
``Tiles.logits_of`` and hands the gradient of the tempered logits to the sink
(``GradSink.put``, ``GradSink.add_sparse``); the single pass's row scale is
``_single_pass``'s. Top-k's ``prologue(..., fold=False)`` is a keyword of the call's
prologue, not a member: it asks that equal logits stay equal (ties)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PROCESSORS = pathlib.Path(__file__).resolve().parents[2] / "torch_impl" / "processors"
EPILOGUES = ("_fused.py", "_distill.py", "_topk.py")
REGIME = {
    "temper",
    "untempered_grad",
    "row_inv_t",
    "fold",
    "inv_t",
    "unfold_dh",
    "RowScale",
    "row_scale",
}


def _regime_names(source: str) -> list[tuple[str, int]]:
    """The temperature members named in ``source``: attributes, names, imported names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            found.append((node.attr, node.lineno))
        elif isinstance(node, ast.Name):
            found.append((node.id, node.lineno))
        elif isinstance(node, ast.alias):
            found.append((node.asname or node.name, node.lineno))
    return [(name, line) for name, line in found if name in REGIME]


@pytest.mark.parametrize("module", EPILOGUES)
def test_no_epilogue_names_the_temperature_regime(module: str) -> None:
    named = _regime_names((PROCESSORS / module).read_text())
    assert not named, f"{module} names the temperature regime at {named}"


def test_the_check_finds_the_members_where_they_live() -> None:
    """The scan can fail: the engine's own modules name every member it looks for."""
    engine = {
        name
        for module in ("_tiles.py", "_engine.py", "_sink.py", "_single_pass.py")
        for name, _ in _regime_names((PROCESSORS / module).read_text())
    }
    assert {
        "untempered_grad",
        "row_inv_t",
        "fold",
        "inv_t",
        "unfold_dh",
        "RowScale",
        "row_scale",
    } <= engine
    assert sorted(_regime_names("zs = eng.temper(z, rows)\nfrom ._engine import RowScale\n")) == [
        ("RowScale", 2),
        ("temper", 1),
    ]

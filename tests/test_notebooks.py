"""Every notebook runs top to bottom: its code cells executed in order in one namespace
(no Jupyter needed), and none is stored with outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path) -> None:
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for cell in cells:
        assert cell.get("outputs", []) == [] and cell.get("execution_count") is None, "stored outputs"
    namespace: dict[str, object] = {"__name__": "__notebook__"}
    try:
        for i, cell in enumerate(cells):
            source = "".join(cell["source"])
            exec(compile(source, f"{path.name}[cell {i}]", "exec"), namespace)
    finally:
        stack = namespace.get("stack")
        if stack is not None:
            stack.close()  # tear down torch.distributed even when a cell failed

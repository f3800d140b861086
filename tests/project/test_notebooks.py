"""The notebooks are committed executed, and they still run top to bottom.

Each notebook in notebooks/ is stored with the outputs of one clean run (every code cell
executed once, in order, no error), so that a reader sees its tables and plots on the
repository page; ``scripts/run_notebooks.sh`` re-executes them in place. The check of the
stored outputs reads JSON only and runs in both environments. The execution test runs each
notebook in a fresh ipykernel of this interpreter with nbclient (the py312 environment has
nbclient, nbformat and ipykernel) and compares nothing numeric with the stored outputs:
timings and float noise differ from run to run.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = (
    "01_write_validate_deploy.ipynb",
    "02_validate_in_depth.ipynb",
    "03_rl_grpo.ipynb",
    "04_distillation.ipynb",
    "05_sampling_replay_and_rollout_correction.ipynb",
)
CELL_TIMEOUT_S = 600
HAS_NBCLIENT = all(
    importlib.util.find_spec(m) is not None for m in ("nbclient", "nbformat", "ipykernel")
)

# appended to the executed copy: a notebook that starts torch.distributed tears it down
TEARDOWN_CHECK = (
    "import sys\n"
    "_dist = sys.modules.get('torch.distributed')\n"
    "assert _dist is None or not _dist.is_initialized(), 'torch.distributed left initialised'"
)


def clean_run_problems(nb: dict[str, Any]) -> list[str]:
    """What keeps ``nb`` (nbformat 4 JSON) from holding the outputs of one clean run:
    code-cell execution counts other than 1..n in order, or an output of type error."""
    problems = []
    if nb.get("nbformat") != 4:
        problems.append(f"nbformat {nb.get('nbformat')}, expected 4")
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    counts = [c.get("execution_count") for c in code]
    if counts != list(range(1, len(code) + 1)):
        problems.append(f"execution counts {counts}, expected 1..{len(code)} in order")
    for i, cell in enumerate(code, start=1):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                problems.append(f"code cell {i}: {out.get('ename')}: {out.get('evalue')}")
    return problems


def test_there_are_notebooks() -> None:
    names = {p.name for p in NOTEBOOKS}
    assert set(EXPECTED) <= names, f"missing: {sorted(set(EXPECTED) - names)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_executed(path: Path) -> None:
    text = path.read_text()
    nb = json.loads(text)
    assert not clean_run_problems(nb), clean_run_problems(nb)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert any(c.get("outputs") for c in code), "no stored output at all"
    assert str(ROOT) not in text, "an output names this checkout's absolute path"


def test_clean_run_check_catches_each_problem() -> None:
    def notebook(*cells: dict[str, Any]) -> dict[str, Any]:
        return {"nbformat": 4, "cells": [{"cell_type": "markdown", "source": "# t"}, *cells]}

    def code(count: int | None, *outputs: dict[str, Any]) -> dict[str, Any]:
        return {"cell_type": "code", "execution_count": count, "outputs": list(outputs)}

    ok = {"output_type": "stream", "name": "stdout", "text": "1\n"}
    error = {"output_type": "error", "ename": "AssertionError", "evalue": "", "traceback": []}
    assert clean_run_problems(notebook(code(1, ok), code(2))) == []
    assert clean_run_problems(notebook(code(None), code(None)))  # stored without outputs
    assert clean_run_problems(notebook(code(1), code(3)))  # a cell skipped
    assert clean_run_problems(notebook(code(2), code(1)))  # out of order
    assert clean_run_problems(notebook(code(1), code(1)))  # a cell run twice, the other not
    assert clean_run_problems(notebook(code(1, ok), code(2, error)))


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_NBCLIENT,
    reason="nbclient, nbformat or ipykernel is not installed: notebooks execute in the py312 "
    "environment only (requirements/py312.txt)",
)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes_cleanly(path: Path) -> None:
    import nbformat
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    class ThisPython(KernelSpecManager):  # an ipykernel of this interpreter, whatever specs exist
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
            argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
            return KernelSpec(argv=argv, display_name="Python 3", language="python")

    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(TEARDOWN_CHECK))
    client = NotebookClient(
        nb,
        km=AsyncKernelManager(kernel_name="python3", kernel_spec_manager=ThisPython()),
        timeout=CELL_TIMEOUT_S,
        record_timing=False,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    # cleanup_kc: shut the kernel down after (nbclient keeps a kernel alive when given its manager);
    # raises CellExecutionError, naming the cell, on the first error
    client.execute(cleanup_kc=True)
    executed = json.loads(nbformat.writes(nb))
    assert not clean_run_problems(executed), clean_run_problems(executed)

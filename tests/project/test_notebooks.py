"""The notebooks are committed executed, they still run top to bottom, and their stored
numbers still come out of their cells.

Each notebook in notebooks/ is stored with the outputs of one clean run (every code cell
executed once, in order, no error) and the platform it ran on, so that a reader sees its
tables and plots on the repository page; ``scripts/run_notebooks.sh`` re-executes them in
place. The check of the stored outputs reads JSON only and runs in both environments, as does
the unit test of the comparison. The execution test runs each notebook in a fresh ipykernel
of this interpreter with nbclient (the py312 environment has nbclient, nbformat and
ipykernel), under the conditions the stored run had (``tests/support/notebook_support.py``: one
thread, this checkout's packages, warnings off), and compares the text outputs of that very
run with the stored ones, exactly: on the same platform a run repeats them bit for bit. Not
compared: images, and the cells tagged ``varies`` (wall times). On a machine whose CPU
capability differs from the stored run's, the numbers are not compared (the test is skipped
after the notebook ran cleanly): float32's last bits differ there, and a seeded sampler
turns them into other tokens now and then.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.notebook_support import (
    NOTEBOOK_DIR,
    ROOT,
    STORED_RUN_KEY,
    VARIES_TAG,
    execute,
    output_mismatches,
    platform_differs,
    run_platform,
)

NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = (
    "01_write_validate_deploy.ipynb",
    "02_validate_in_depth.ipynb",
    "03_rl_grpo.ipynb",
    "04_distillation.ipynb",
    "05_sampling_replay_and_rollout_correction.ipynb",
)
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
    run = nb["metadata"].get(STORED_RUN_KEY, {})
    assert {"torch", "machine", "cpu_capability"} <= run.keys(), (
        f"no platform stored ({STORED_RUN_KEY}): store the run with scripts/run_notebooks.sh"
    )


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


def test_output_comparison_catches_a_changed_number_and_ignores_an_exempt_cell() -> None:
    def code(*outputs: dict[str, Any], tags: tuple[str, ...] = ()) -> dict[str, Any]:
        return {"cell_type": "code", "metadata": {"tags": list(tags)}, "outputs": list(outputs)}

    def stream(text: str, name: str = "stdout") -> dict[str, Any]:
        return {"output_type": "stream", "name": name, "text": text}

    def result(text: str, png: str) -> dict[str, Any]:
        return {"output_type": "execute_result", "data": {"text/plain": text, "image/png": png}}

    def notebook(
        rewards: str = "last [0.958, 0.956]\n",
        seconds: str = "200 steps in 13.0 s\n",
        loss: str = "-0.0307",
        png: str = "x",
        timing_tags: tuple[str, ...] = (VARIES_TAG,),
    ) -> dict[str, Any]:
        return {
            "cells": [
                {"cell_type": "markdown", "source": "The reward rises to about 0.95."},
                code(stream(rewards), stream("a note\n", "stderr")),
                code(stream(seconds), tags=timing_tags),
                code(result(loss, png)),
            ]
        }

    stored = notebook()
    assert output_mismatches(stored, notebook()) == []
    # may change: the wall time of the cell tagged "varies", an image, how the kernel split a
    # stream into outputs, and a cell the test appends to the run
    fresh = notebook(seconds="200 steps in 42.1 s\n", png="y")
    fresh["cells"][1]["outputs"][:1] = [stream("last [0.9"), stream("58, 0.956]\n")]
    fresh["cells"].append(code(stream("torn down\n")))
    assert output_mismatches(stored, fresh) == []
    # a number changed: the cell, the output and the line are named
    assert output_mismatches(stored, notebook(rewards="last [0.958, 0.950]\n")) == [
        "code cell 1, stdout:\n-last [0.958, 0.956]\n+last [0.958, 0.950]"
    ]
    (report,) = output_mismatches(stored, notebook(loss="-0.0308"))
    assert report == "code cell 3, text/plain:\n--0.0307\n+-0.0308"
    silent = notebook()
    silent["cells"][1]["outputs"].pop()  # the stderr note gone
    assert [r.splitlines()[0] for r in output_mismatches(stored, silent)] == [
        "code cell 1, stderr:"
    ]
    # without the tag the wall time is compared like any other number
    untagged, slower = notebook(timing_tags=()), notebook(seconds="200 steps in 42.1 s\n")
    slower["cells"][2]["metadata"]["tags"] = []
    assert output_mismatches(untagged, slower) == [
        "code cell 2, stdout:\n-200 steps in 13.0 s\n+200 steps in 42.1 s"
    ]


def test_a_run_elsewhere_is_told_apart_from_a_torch_upgrade() -> None:
    here = {"torch": "2.13.0", "machine": "x86_64", "cpu_capability": "AVX2"}
    stored = {"metadata": {STORED_RUN_KEY: dict(here)}}
    assert platform_differs(stored, here) is None
    assert platform_differs(stored, {**here, "torch": "2.14.0"}) is None  # compared: re-store
    assert platform_differs(stored, {**here, "cpu_capability": "AVX512"})
    assert platform_differs(stored, {**here, "machine": "arm64"})
    assert platform_differs({"metadata": {}}, here)


@pytest.mark.skipif(not HAS_NBCLIENT, reason="nbclient, nbformat or ipykernel is not installed")
def test_the_kernel_talks_over_unix_sockets_and_binds_no_tcp_port() -> None:
    # A TCP kernel's five ports are picked free, freed and bound again by the kernel: another
    # process of a parallel run can take one in between ("Address already in use").
    import nbformat

    cell = (
        "import json\nfrom ipykernel.connect import get_connection_info\n"
        "print(json.loads(get_connection_info())['transport'])"
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    execute(nb)
    assert nb.cells[0].outputs[0]["text"] == "ipc\n"


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_NBCLIENT,
    reason="nbclient, nbformat or ipykernel is not installed: notebooks execute in the py312 "
    "environment only (requirements/py312.txt)",
)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes_cleanly_and_repeats_its_outputs(path: Path) -> None:
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(TEARDOWN_CHECK))
    execute(nb)  # raises CellExecutionError, naming the cell, on the first error
    executed = json.loads(nbformat.writes(nb))
    assert not clean_run_problems(executed), clean_run_problems(executed)
    stored = json.loads(path.read_text())
    elsewhere = platform_differs(stored, run_platform())
    if elsewhere:
        pytest.skip(f"ran cleanly; its numbers are not compared: {elsewhere}")
    mismatches = output_mismatches(stored, executed)
    assert not mismatches, (
        f"{len(mismatches)} stored output(s) no longer come out of their cells (re-execute with "
        "scripts/run_notebooks.sh, or tag a cell whose output varies by nature "
        f"{VARIES_TAG!r}):\n" + "\n".join(mismatches)
    )

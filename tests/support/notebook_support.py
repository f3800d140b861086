"""The notebooks' runs: one set of conditions for the stored run and the test's, and the
comparison of a run's text outputs with the stored ones.

``scripts/run_notebooks.sh`` stores a run (``python -m tests.support.notebook_support [PATH ...]``,
:func:`store`); ``tests/project/test_notebooks.py`` executes each notebook again through the same
:func:`execute` and compares with :func:`output_mismatches`. Both run a notebook in a fresh
ipykernel of this interpreter, working directory ``notebooks/``, with

- one intra-op thread (``OMP_NUM_THREADS=1``, as the test suite runs every process): torch
  splits a reduction among its threads, so the thread count changes the last bits of a sum
  (two threads against one: notebook 03's losses differ from the 7th digit on);
- this checkout first on the kernel's ``sys.path`` (``PYTHONPATH``), before an installed copy
  (an editable install may point at another checkout);
- warnings off (``PYTHONWARNINGS=ignore``): a warning on stderr is no output of the notebook;
- on x86_64, the AVX2 kernels whatever the CPU offers beyond them (:data:`X86_SETTINGS`):
  ATen's vectorised ops (``ATEN_CPU_CAPABILITY=avx2``), MKL's GEMMs (``MKL_CBWR=AVX2``, its
  conditional bitwise reproducibility) and oneDNN's (``ONEDNN_MAX_CPU_ISA=AVX2``), so that
  an AVX-512 machine computes what the stored run's AVX2 machine did (on an AVX2 machine
  they change nothing: a float32 GEMM and softmax hash the same with and without them).

Under these conditions two runs on the same machine print the same text, bit for bit, so the
comparison is exact. What is compared: the text outputs of each code cell (stdout and stderr,
each joined over the cell's outputs, and every ``text/*`` value of a result or a display).
Not compared: images, and every output of a cell tagged ``varies`` (``"tags": ["varies"]`` in
the cell's metadata) whose text changes from run to run by nature (a wall time).

The last bits of a float32 result depend on the CPU kernels torch picks for the machine (the
vector instruction set, ATen's CPU capability), and a seeded sampler turns a last-bit
difference into another token now and then. The stored run's platform is kept in the
notebook's metadata (``stored_run``: torch's version, the machine, the CPU capability); a
run on another platform is compared only where its platform equals the stored one
(:func:`platform_differs`).
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
CELL_TIMEOUT_S = 600
VARIES_TAG = "varies"
STORED_RUN_KEY = "stored_run"
KERNEL_SETTINGS = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
X86_SETTINGS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
DIFF_LINES = 12  # the most lines of one output's difference a report shows


def kernel_env() -> dict[str, str]:
    """The environment a notebook's kernel starts with: the caller's, with
    :data:`KERNEL_SETTINGS` (and on x86_64 :data:`X86_SETTINGS`) set and this checkout
    first on ``PYTHONPATH``."""
    x86 = X86_SETTINGS if platform.machine() in ("x86_64", "AMD64") else {}
    env = dict(os.environ, **KERNEL_SETTINGS, **x86)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *rest])
    return env


PLATFORM_PROBE = (
    "import json, platform, torch; print(json.dumps({'torch': torch.__version__, "
    "'machine': platform.machine(), 'cpu_capability': torch.backends.cpu.get_cpu_capability()}))"
)


@functools.cache
def _probed_platform() -> str:
    probe = [sys.executable, "-c", PLATFORM_PROBE]
    return subprocess.run(
        probe, env=kernel_env(), capture_output=True, text=True, check=True
    ).stdout


def run_platform() -> dict[str, str]:
    """What the last bits of a run depend on beyond the code: torch's version, the machine
    and ATen's CPU capability, as a process started with :func:`kernel_env` sees them (the
    kernel's: ``avx2`` on an AVX-512 machine), asked of one such process once."""
    return dict(json.loads(_probed_platform()))


def platform_differs(stored: dict[str, Any], here: dict[str, str]) -> str | None:
    """Why the stored run's numbers cannot be expected here (its machine or CPU capability
    is not this one's), or ``None``. A different torch version is no reason: the notebooks
    are stored again after a change of the pinned torch."""
    run = stored.get("metadata", {}).get(STORED_RUN_KEY, {})
    for key in ("machine", "cpu_capability"):
        if run.get(key) != here[key]:
            return f"stored on {key} {run.get(key)!r}, this machine has {here[key]!r}"
    return None


def execute(nb: Any, *, timeout: int = CELL_TIMEOUT_S) -> None:
    """Run the ``nbformat`` notebook ``nb`` top to bottom in place, in a fresh ipykernel of
    this interpreter started with :func:`kernel_env` in ``notebooks/``, its channels on Unix
    sockets in a temporary directory (no TCP port to lose to a parallel test), shut down after.
    Raises ``nbclient``'s ``CellExecutionError``, naming the cell, on the first error."""
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    class ThisPython(KernelSpecManager):
        """An ipykernel of this very interpreter, whatever kernelspecs are installed."""

        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
            argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
            return KernelSpec(argv=argv, display_name="Python 3", language="python")

    with tempfile.TemporaryDirectory(prefix="nb-kernel-") as sockets:
        # The kernel's channels are Unix sockets in a directory of its own (transport "ipc"):
        # with TCP, the client picks five free ports, frees them and the kernel binds them,
        # and another process of a parallel test run can take one in between.
        km = AsyncKernelManager(
            kernel_name="python3",
            kernel_spec_manager=ThisPython(),
            transport="ipc",
            ip=os.path.join(sockets, "kernel"),
        )
        client = NotebookClient(
            nb,
            km=km,
            timeout=timeout,
            record_timing=False,  # no per-cell timestamps in the stored file
            resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
        )
        # cleanup_kc: shut the kernel down after (nbclient keeps it alive given its manager)
        client.execute(cleanup_kc=True, env=kernel_env())


def store(path: Path) -> float:
    """Execute notebook ``path`` and write it back with its outputs and platform; the
    seconds it took. On an error the file is left as it was."""
    import nbformat

    start = time.monotonic()
    nb = nbformat.read(path, as_version=4)
    execute(nb)
    nb.metadata[STORED_RUN_KEY] = run_platform()
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return time.monotonic() - start


def is_exempt(cell: dict[str, Any]) -> bool:
    """Whether ``cell`` is tagged :data:`VARIES_TAG`: its outputs are not compared."""
    return VARIES_TAG in cell.get("metadata", {}).get("tags", [])


def text_outputs(cell: dict[str, Any]) -> dict[str, str]:
    """The text a code cell showed, by kind: each stream (``stdout``, ``stderr``) joined
    over the cell's outputs (a kernel splits a stream into outputs as it flushes), and each
    ``text/*`` value of its results and displays joined in order."""
    texts: dict[str, str] = {}
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts = {out.get("name", "stream"): out.get("text", "")}
        else:
            parts = {k: v for k, v in out.get("data", {}).items() if k.startswith("text/")}
        for kind, text in parts.items():
            texts[kind] = texts.get(kind, "") + ("".join(text) if isinstance(text, list) else text)
    return texts


def code_cells(nb: dict[str, Any]) -> list[dict[str, Any]]:
    """The code cells of ``nb`` (nbformat 4 JSON), in order."""
    return [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]


def output_mismatches(stored: dict[str, Any], executed: dict[str, Any]) -> list[str]:
    """Where the text outputs of ``executed`` differ from those of ``stored`` (both nbformat
    4 JSON, the same cells; ``executed`` may have more code cells after): one report per
    differing output of a code cell not tagged ``varies``, with its changed lines."""
    reports = []
    for number, (old, new) in enumerate(zip(code_cells(stored), code_cells(executed)), 1):
        if is_exempt(old):
            continue
        want, got = text_outputs(old), text_outputs(new)
        for kind in sorted(want.keys() | got.keys()):
            if want.get(kind) != got.get(kind):
                diff = changed_lines(want.get(kind, ""), got.get(kind, ""))
                reports.append(f"code cell {number}, {kind}:\n" + "\n".join(diff))
    return reports


def changed_lines(stored: str, fresh: str) -> list[str]:
    """The lines that differ, ``-`` stored and ``+`` fresh, at most :data:`DIFF_LINES`."""
    diff = difflib.unified_diff(stored.splitlines(), fresh.splitlines(), lineterm="", n=0)
    lines = [line for line in diff if not line.startswith(("---", "+++", "@@"))]
    if len(lines) > DIFF_LINES:
        return [*lines[:DIFF_LINES], f"... {len(lines) - DIFF_LINES} more"]
    return lines


def main(argv: Sequence[str]) -> int:
    """Store a fresh run of each notebook named (default: every ``notebooks/*.ipynb``);
    the first error stops, leaving that notebook as it was."""
    paths = [Path(p) for p in argv] or sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    for path in paths:
        seconds = store(path)
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        print(f"{shown}: executed in {seconds:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

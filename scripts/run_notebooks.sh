#!/usr/bin/env bash
# Execute the notebooks top to bottom and store their outputs in place, ready to commit.
#   bash scripts/run_notebooks.sh                                    # every notebooks/*.ipynb
#   bash scripts/run_notebooks.sh notebooks/02_validate_in_depth.ipynb
# Each runs in a fresh kernel of the py312 environment's Python (or $PYTHON), working
# directory notebooks/, as tests/project/test_notebooks.py runs them. The first error stops the
# script and leaves that notebook as it was.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-$root/.venvs/py312/bin/python}
cd "$root"
PYTHONWARNINGS=ignore "$py" - "$@" <<'EOF'
import pathlib
import sys
import time

import nbformat
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient


class ThisPython(KernelSpecManager):
    """An ipykernel of this very interpreter, whatever kernelspecs are installed."""

    def get_kernel_spec(self, kernel_name):
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        return KernelSpec(argv=argv, display_name="Python 3", language="python")


paths = [pathlib.Path(p) for p in sys.argv[1:]] or sorted(pathlib.Path("notebooks").glob("*.ipynb"))
for path in paths:
    nb = nbformat.read(path, as_version=4)
    start = time.monotonic()
    NotebookClient(
        nb,
        km=AsyncKernelManager(kernel_name="python3", kernel_spec_manager=ThisPython()),
        timeout=600,
        record_timing=False,  # no per-cell timestamps in the stored file
        resources={"metadata": {"path": str(path.parent)}},
    ).execute(cleanup_kc=True)  # shut the kernel down after (it was given its manager)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    print(f"{path}: executed in {time.monotonic() - start:.1f} s", flush=True)
EOF

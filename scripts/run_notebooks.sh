#!/usr/bin/env bash
# Execute the notebooks top to bottom and store their outputs in place, ready to commit.
#   bash scripts/run_notebooks.sh                                    # every notebooks/*.ipynb
#   bash scripts/run_notebooks.sh notebooks/02_validate_in_depth.ipynb
# Each runs in a fresh kernel of the py312 environment's Python (or $PYTHON), working
# directory notebooks/, under the conditions tests/project/test_notebooks.py runs them under
# (one thread, this checkout's packages, warnings off: tests/support/notebook_support.py), so
# that the test gets the stored numbers again. The first error stops the script and leaves that
# notebook as it was.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-$root/.venvs/py312/bin/python}
cd "$root"
PYTHONWARNINGS=ignore "$py" -m tests.support.notebook_support "$@"

#!/usr/bin/env bash
# Benchmarks of the production processors, on a fresh checkout, in one command:
#   bash scripts/bench.sh            # full sizes (on 2 CPU cores: about an hour)
#   bash scripts/bench.sh --quick    # small sizes, a few minutes
# Extra arguments go to `python -m benchmarks.logprobs` (e.g. --dtypes fp32 --sections main).
# Sets up the py312 environment if needed, fetches veRL 0.9.1's wheel (no dependencies)
# into .venvs/cache/verl and loads only verl/utils/experimental/torch_functional.py
# from it by file path. Results: benchmarks/results/ (CSV, summary, PNG).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venvs=${HOOKSPEC_VENVS:-$root/.venvs}
if [ -f scripts/setup_env.sh ]; then
  bash scripts/setup_env.sh py312
fi
py=$venvs/py312/bin/python
[ -x "$py" ] || { echo "bench.sh: no Python at $py (run scripts/setup_env.sh py312)" >&2; exit 1; }

cache=$venvs/cache/verl
file=$cache/verl-0.9.1/verl/utils/experimental/torch_functional.py
if [ ! -f "$file" ]; then
  mkdir -p "$cache"
  if "$py" -m pip download --quiet verl==0.9.1 --no-deps --only-binary=:all: -d "$cache"; then
    "$py" - "$cache" <<'PY'
import pathlib, sys, zipfile
cache = pathlib.Path(sys.argv[1])
wheel = next(cache.glob("verl-0.9.1-*.whl"))
zipfile.ZipFile(wheel).extract("verl/utils/experimental/torch_functional.py", cache / "verl-0.9.1")
PY
  else
    echo "bench.sh: could not fetch verl==0.9.1; the veRL baseline will be skipped" >&2
  fi
fi
[ -f "$file" ] && export HOOKSPEC_VERL_TORCH_FUNCTIONAL=$file

# The Liger-Kernel and Cut Cross-Entropy rows need CUDA (Triton kernels). Where torch sees a GPU
# the two packages are installed into py312, from $venvs/cache/gpu-bench when that folder holds
# their wheels (for a GPU machine without PyPI: `pip download --no-deps -d .venvs/cache/gpu-bench
# liger-kernel==0.8.5 cut-cross-entropy==25.1.1` beforehand), else from PyPI. Without them the
# rows are skipped and the summary says why.
if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  src=()
  [ -d "$venvs/cache/gpu-bench" ] && src=(--no-index --find-links "$venvs/cache/gpu-bench")
  "$py" -m pip install --quiet --no-deps "${src[@]}" liger-kernel==0.8.5 cut-cross-entropy==25.1.1 ||
    echo "bench.sh: could not install liger-kernel / cut-cross-entropy; their rows will be skipped" >&2
fi

quick=()
for arg in "$@"; do [ "$arg" = "--quick" ] && quick=(--quick); done
export PYTHONWARNINGS=ignore
"$py" -m benchmarks.hook_overhead "${quick[@]}"
"$py" -m benchmarks.logprobs "$@"

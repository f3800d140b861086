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

quick=()
for arg in "$@"; do [ "$arg" = "--quick" ] && quick=(--quick); done
export PYTHONWARNINGS=ignore
"$py" -m benchmarks.hook_overhead "${quick[@]}"
"$py" -m benchmarks.logprobs "$@"

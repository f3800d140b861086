#!/usr/bin/env bash
# The one prepared command of the GPU benchmark (issue 9), for a GPU machine that reaches
# no package index: installs the wheels carried in .whl/ (scripts/gpu_wheels.sh) into
# .site-bench without their dependencies, then runs benchmarks.gpu_logprobs on every size,
# each in its own process. Results (CSV, JSON, Markdown table with the targets) go to
# $OUT/gpu (the device tool's folder that comes back) or benchmarks/results/.
#   bash scripts/gpu_bench.sh                      # all sizes and methods, about 3 minutes on one H200
#   bash scripts/gpu_bench.sh --methods ours-triton,cce
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
site=$root/.site-bench
if [ -d .whl ]; then
  wheels=(.whl/megatron_core-0.19.2*.whl .whl/liger_kernel-*.whl .whl/cut_cross_entropy-*.whl)
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}" ||
    echo "gpu_bench.sh: some wheels did not install; their methods report why" >&2
  verl=$(ls .whl/verl-0.9.1-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$verl" ]; then
    export HOOKSPEC_VERL_WHEEL=$root/$verl
    "$py" - "$verl" "$site/verl-files" <<'PY'
import pathlib, sys, zipfile
wheel, out = sys.argv[1], pathlib.Path(sys.argv[2])
zipfile.ZipFile(wheel).extract("verl/utils/experimental/torch_functional.py", out)
PY
    export HOOKSPEC_VERL_TORCH_FUNCTIONAL=$site/verl-files/verl/utils/experimental/torch_functional.py
  fi
fi
export PYTHONPATH=$site:$root${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-$root/benchmarks/results}/gpu
timeout 235 "$py" -m benchmarks.gpu_logprobs --out "$out" "$@"

#!/usr/bin/env bash
# The GPU checks in one prepared command, for a GPU machine that reaches no package index
# (wheels carried in .whl/ by scripts/gpu_wheels.sh): `pytest -m gpu` on megatron-core 0.19.2
# and 0.16.1, each installed --no-deps into its own folder, then the GPU benchmark
# (scripts/gpu_bench.sh). Logs go to $OUT/gpu (the device tool's folder that comes back) or
# benchmarks/results/gpu. Each step has its own time limit; the whole is sized for about
# 9 minutes on one H100/H200.
#   bash scripts/gpu_tests.sh              # tests on both releases, then the benchmark
#   bash scripts/gpu_tests.sh --no-bench   # the tests only
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
out=${OUT:-$root/benchmarks/results}/gpu
mkdir -p "$out"
status=0
for release in 0.19.2 0.16.1; do
  site=$root/.site-mcore-$release
  wheel=$(ls .whl/megatron_core-"$release"-*.whl .whl/mcore016/megatron_core-"$release"-*.whl 2>/dev/null | head -n 1)
  if [ -z "$wheel" ]; then
    echo "gpu_tests.sh: no megatron-core $release wheel in .whl/ (run scripts/gpu_wheels.sh here first)" | tee -a "$out/tests.log"
    status=1
    continue
  fi
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel" || { status=1; continue; }
  echo "== pytest -m gpu on megatron-core $release" | tee -a "$out/tests.log"
  PYTHONPATH=$site:$root PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu \
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 "$py" -m pytest -q -p no:cacheprovider -m gpu \
    -rs tests 2>&1 | tee -a "$out/tests.log" | tail -n 40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
if [ "${1:-}" != "--no-bench" ]; then
  OUT=${OUT:-$root/benchmarks/results} bash scripts/gpu_bench.sh || status=1
fi
exit $status

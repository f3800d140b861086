#!/usr/bin/env bash
# The GPU benchmark as one prepared command, for a GPU machine that reaches no package index
# (scripts/gpu_tests.sh runs it after the GPU tests; its three steps are in that script's time
# budget): installs the carried wheels of .whl/ (scripts/gpu_wheels.sh) into .site-bench
# without their dependencies and unpacks veRL's two files, runs benchmarks.gpu_logprobs
# within its budget (each row appended to gpu_logprobs.jsonl as it is measured), then writes
# gpu-results.md, the fragment of docs/gpu-results.md (benchmarks.gpu_results), from whatever
# rows there are. Output: $OUT/gpu or benchmarks/results/gpu.
#   bash scripts/gpu_bench.sh                                   # every size and method
#   bash scripts/gpu_bench.sh --methods floor3,floor4,ours-triton
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
out=${OUT:-$root/benchmarks/results}/gpu
mkdir -p "$out"
status=0
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false

timeout -k 3 12 bash -c '
  py=$1
  pip=("$py" -m pip install -q --no-index --no-deps --no-compile --upgrade)
  [ -d .site-mcore-0.19.2/megatron ] || "${pip[@]}" --target .site-mcore-0.19.2 .whl/megatron_core-0.19.2-*.whl
  if [ ! -d .site-bench/liger_kernel ] || [ ! -d .site-bench/cut_cross_entropy ]; then
    "${pip[@]}" --target .site-bench .whl/liger_kernel-*.whl .whl/cut_cross_entropy-*.whl ||
      echo "gpu_bench.sh: Liger-Kernel or Cut Cross-Entropy did not install; their rows say why"
  fi
  verl=$(ls .whl/verl-0.9.1-*.whl 2>/dev/null | head -n 1)
  if [ -n "$verl" ]; then
    "$py" -m zipfile -e "$verl" .site-bench/verl-files || echo "gpu_bench.sh: veRL wheel did not unpack"
  fi
  true' _ "$py" >>"$out/install.log" 2>&1 || status=1

verl=$(ls .whl/verl-0.9.1-*.whl 2>/dev/null | head -n 1)
if [ -n "$verl" ]; then
  export HOOKSPEC_VERL_WHEEL=$root/$verl
  export HOOKSPEC_VERL_TORCH_FUNCTIONAL=$root/.site-bench/verl-files/verl/utils/experimental/torch_functional.py
fi
export PYTHONPATH=$root/.site-bench:$root/.site-mcore-0.19.2:$root

# The benchmark stops starting methods after --budget; the timeout is the backstop.
timeout -k 3 170 "$py" -m benchmarks.gpu_logprobs --out "$out" --budget 160 "$@" 2>&1 | tee -a "$out/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# the fragment (gpu-results.md) from the rows there are; printed here: the backend choice
timeout -k 3 12 "$py" -m benchmarks.gpu_results render "$out" | grep -e "^auto table" -e "^| [A-Z].*| \(met\|not met\|not measured\) |"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_bench.sh: exit $status; results in $out"
exit $status

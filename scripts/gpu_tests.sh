#!/usr/bin/env bash
# The GPU checks and the GPU benchmark as one prepared command, for one H100 or H200 that
# reaches no package index (the wheels come carried in .whl/, put there by
# scripts/gpu_wheels.sh): megatron-core 0.19.2 and 0.16.1 installed --no-deps each into its
# own folder, the environment recorded, `pytest -v -m gpu` on each release, then
# scripts/gpu_bench.sh (the benchmark, its rows appended as they are measured, and the
# fragment of docs/gpu-results.md). Everything goes to $OUT/gpu (the folder a GPU call brings
# back) or benchmarks/results/gpu: env.json, install.log, tests-0.19.2.log,
# tests-0.16.1.log, bench.log, gpu_logprobs.jsonl, gpu-results.md.
#   bash scripts/gpu_tests.sh              # tests on both releases, then the benchmark
#   bash scripts/gpu_tests.sh --no-bench   # the tests only
#
# Time budget: every step runs under `timeout -k 3 LIMIT`; the limits plus the 3 s of each
# kill add up to at most 480 s (8 minutes), installs included. tests/test_gpu_bench.py reads
# this table and the `timeout` calls of this script and of gpu_bench.sh, and checks both.
#   step                                          limit s
#   install megatron-core 0.19.2, 0.16.1, Liger, CCE   15
#   record the environment (env.json)                  15
#   pytest -m gpu, megatron-core 0.19.2               140
#   pytest -m gpu, megatron-core 0.16.1                80
#   gpu_bench.sh: install Liger, CCE; unpack veRL      12
#   gpu_bench.sh: the benchmark                       170
#   gpu_bench.sh: the results fragment                 12
#   kill grace, 3 s for each of the 7 steps            21
#   total                                             465
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
out=${OUT:-$root/benchmarks/results}/gpu
mkdir -p "$out"
status=0
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false

# megatron-core, each release in its own folder (pip refuses two versions of one package),
# Liger-Kernel and CCE; and whether pytest-timeout is there (then each test gets 90 s at most)
timeout -k 3 15 bash -c '
  py=$1 root=$2
  for release in 0.19.2 0.16.1; do
    wheel=$(ls "$root"/.whl/megatron_core-"$release"-*.whl "$root"/.whl/mcore016/megatron_core-"$release"-*.whl 2>/dev/null | head -n 1)
    if [ -z "$wheel" ]; then
      echo "no megatron-core $release wheel in .whl/ (run scripts/gpu_wheels.sh where PyPI is reachable)"
      exit 1
    fi
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$root/.site-mcore-$release" "$wheel" || exit 1
  done
  # the benchmark'"'"'s peers too, so that env.json records their versions (gpu_bench.sh skips them then)
  "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$root/.site-bench" \
    "$root"/.whl/liger_kernel-*.whl "$root"/.whl/cut_cross_entropy-*.whl || echo "Liger-Kernel or CCE did not install"
  rm -f "$root/.site-mcore-0.19.2/.pytest-timeout"
  "$py" -c "import pytest_timeout" 2>/dev/null && touch "$root/.site-mcore-0.19.2/.pytest-timeout"
  true' _ "$py" "$root" >"$out/install.log" 2>&1 || { status=1; cat "$out/install.log"; }

PYTHONPATH=$root/.site-mcore-0.19.2:$root timeout -k 3 15 "$py" -m benchmarks.gpu_results env "$out" ||
  status=1

# The files with gpu-marked tests, the two that test no Megatron code first; those two run on the
# first release only (benchmarks.gpu_results.PROCESSOR_ONLY, kept equal by a test).
processor_only=(tests/test_gpu_checks.py tests/test_processors_triton.py)
mapfile -t marked < <(grep -lE '^[[:space:]]*(@pytest\.mark\.gpu\b|pytestmark[[:space:]]*=.*pytest\.mark\.gpu\b)' tests/test_*.py | sort)
megatron_files=()
for f in "${marked[@]}"; do
  [[ " ${processor_only[*]} " == *" $f "* ]] || megatron_files+=("$f")
done
files=()
for f in "${processor_only[@]}"; do [ -f "$f" ] && files+=("$f"); done
files+=("${megatron_files[@]}")
per_test=()
[ -f "$root/.site-mcore-0.19.2/.pytest-timeout" ] && per_test=(--timeout 90)

run_tests() {  # run_tests RELEASE LIMIT FILE...
  local release=$1 limit=$2
  shift 2
  echo "== pytest -m gpu on megatron-core $release (limit $limit s)" | tee "$out/tests-$release.log"
  PYTHONPATH=$root/.site-mcore-$release:$root timeout -k 3 "$limit" "$py" -m pytest -v -p no:cacheprovider \
    -m gpu -rs "${per_test[@]}" "$@" 2>&1 | tee -a "$out/tests-$release.log" | grep -v -e ' PASSED' -e ' SKIPPED'
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
run_tests 0.19.2 140 "${files[@]}"
run_tests 0.16.1 80 "${megatron_files[@]}"

if [ "${1:-}" != "--no-bench" ]; then
  OUT=$(dirname "$out") bash scripts/gpu_bench.sh || status=1
fi
echo "gpu_tests.sh: exit $status; results in $out"
exit $status

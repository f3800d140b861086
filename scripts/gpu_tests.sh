#!/usr/bin/env bash
# The GPU checks and the GPU benchmark as one prepared command, for one H100 or H200 that
# reaches no package index (the wheels come carried in .whl/, put there by
# scripts/gpu_wheels.sh): megatron-core 0.19.2 and 0.16.1 installed --no-deps each into its
# own folder, the environment recorded, then first what decides the design
# (benchmarks.gpu_measure: torch.mm at the logits chunk's shape, bf16 and fp32 out, the
# gradient GEMMs on the doubled-stride view; the copy bandwidth; each Triton kernel alone
# against it; the 3- and 4-GEMM floors), then `pytest -v -m gpu` on each release, then
# scripts/gpu_bench.sh (the benchmark, its rows appended as they are measured, and the
# fragment of docs/gpu-results.md). Everything goes to $OUT/gpu (the folder that comes back
# from the GPU machine) or benchmarks/results/gpu: env.json, install.log, measure.log,
# gpu_measure.jsonl, tests-0.19.2.log, tests-0.16.1.log, bench.log, gpu_logprobs.jsonl,
# gpu-results.md.
#   bash scripts/gpu_tests.sh              # tests on both releases, then the benchmark
#   bash scripts/gpu_tests.sh --no-bench   # the tests only
#   bash scripts/gpu_tests.sh --dry        # every step on a CPU: tiny measurements, the GPU
#                                          # tests collected and skipped, a tiny benchmark
#
# Time budget: every step runs under `timeout -k 3 LIMIT`; the limits plus the 3 s of each
# kill add up to at most 480 s (8 minutes), installs included. tests/processors/test_gpu_bench.py reads
# this table and the `timeout` calls of this script and of gpu_bench.sh, and checks both.
# The environment step's limit covers the first cold `import torch` of a fresh machine
# (10.6 s seen on a loaded CPU); the benchmark gave it the time (it stops starting methods
# at its own budget). The test limits are 1.8x and 1.5x the times of the 2026-11-26 H200 run
# (56 s and 44 s); the benchmark has the rest, to reach its three bf16 shapes and the peaked
# logits.
#   step                                          limit s
#   install megatron-core 0.19.2, 0.16.1, Liger, CCE   15
#   record the environment (env.json)                  25
#   measure first (benchmarks.gpu_measure)             55
#   pytest -m gpu, megatron-core 0.19.2               100
#   pytest -m gpu, megatron-core 0.16.1                65
#   gpu_bench.sh: install Liger, CCE; unpack veRL      12
#   gpu_bench.sh: the benchmark                       170
#   gpu_bench.sh: the results fragment                 12
#   kill grace, 3 s for each of the 8 steps            24
#   total                                             478
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

dry=0 bench=1
for arg in "$@"; do
  case $arg in
    --dry) dry=1 ;;
    --no-bench) bench=0 ;;
    *) echo "gpu_tests.sh: unknown argument $arg (--dry, --no-bench)" >&2; exit 2 ;;
  esac
done

[ $dry -eq 1 ] && export TRITON_INTERPRET=1  # no GPU: the kernels run under Triton's interpreter
PYTHONPATH=$root/.site-mcore-0.19.2:$root timeout -k 3 25 "$py" -m benchmarks.gpu_results env "$out" ||
  status=1

# What decides the design, first: each row lands in gpu_measure.jsonl as it is measured.
measure_args=(--out "$out")
[ $dry -eq 1 ] && measure_args+=(--dry)
PYTHONPATH=$root/.site-mcore-0.19.2:$root timeout -k 3 55 "$py" -m benchmarks.gpu_measure "${measure_args[@]}" \
  >"$out/measure.log" 2>&1 || { status=1; tail -n 20 "$out/measure.log"; }
grep -e "what=" "$out/measure.log" | cut -c1-160

# The files with gpu-marked tests, the two that test no Megatron code first; those two run on the
# first release only (benchmarks.gpu_results.PROCESSOR_ONLY, kept equal by a test).
processor_only=(tests/processors/test_gpu_checks.py tests/processors/test_processors_triton.py)
mapfile -t marked < <(grep -lE '^[[:space:]]*(@pytest\.mark\.gpu\b|pytestmark[[:space:]]*=.*pytest\.mark\.gpu\b)' tests/*/test_*.py | sort)
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
run_tests 0.19.2 100 "${files[@]}"
run_tests 0.16.1 65 "${megatron_files[@]}"

if [ $bench -eq 1 ]; then
  bench_args=()
  [ $dry -eq 1 ] && bench_args=(--device cpu --quick --runs 2 --warmup 1)
  OUT=$(dirname "$out") bash scripts/gpu_bench.sh "${bench_args[@]}" || status=1
fi
echo "gpu_tests.sh: exit $status; results in $out"
exit $status

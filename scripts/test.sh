#!/usr/bin/env bash
# Set up both environments and run every test: lint, type checks, and pytest on
#   py312: Python 3.12, megatron-core 0.19.2 (native hook), jax 0.12, and the GPU machine's
#          torch 2.11.0 + Triton 3.6.0 (the Triton interpreter, the compile test)
#   py311: Python 3.11, megatron-core 0.16.1 (no hook; the adapter's own path), jax 0.10,
#          torch 2.13.0 (CPU)
# then, side by side, the release matrix (scripts/matrix.sh): the tests marked release_matrix
# on every megatron-core release from 0.13.1 to 0.19.2, each in the environment of its
# Python, and the patch series of upstream/ on copies of 0.19.2 and 0.18.2
# (scripts/upstream_check.sh); each into its own log, both printed whole once both have ended.
# Extra arguments go to both pytest runs (e.g. -x, -k tp2).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venvs=${HOOKSPEC_VENVS:-$root/.venvs}
# The two environments' requirements are installed side by side (mostly downloads and
# unpacking), each into its own log, printed once all have ended; then the project itself
# into each, one after another (an editable install reads the one checkout).
logs=$(mktemp -d)  # the logs of the steps that run side by side
trap 'rm -rf "$logs"' EXIT
setup_pids=()
for name in py312 py311; do
  HOOKSPEC_DEPS_ONLY=1 bash scripts/setup_env.sh "$name" >"$logs/$name.log" 2>&1 &
  setup_pids+=($!)
done
setup_status=0
for pid in "${setup_pids[@]}"; do wait "$pid" || setup_status=1; done
cat "$logs"/py312.log "$logs"/py311.log
[ $setup_status -eq 0 ] || { echo "== setting up an environment failed (its log is above)"; exit 1; }
for name in py312 py311; do bash scripts/setup_env.sh "$name" || exit 1; done

status=0
step() { echo; echo "== $*  [$((SECONDS / 60)) min $((SECONDS % 60)) s into the run]"; }
step "lint: ruff check + ruff format --check"
"$venvs/py312/bin/ruff" check . || status=1
"$venvs/py312/bin/ruff" format --check . || status=1
step "types: mypy (strict on hookspec; checked bodies in torch_impl, jax_ref)"
"$venvs/py312/bin/mypy" || status=1

export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
# Two pytest-xdist workers, a test file each at a time; the tests marked release_independent
# run once, in py312; the 25 slowest tests are printed (docs/testing.md: what runs where, why).
for name in py311 py312; do
  once=(); [ "$name" = py311 ] && once=(-m "not release_independent")
  step "pytest on $name ($("$venvs/$name/bin/python" -c 'import importlib.metadata as md, sys; v, t = md.version("megatron-core"), md.version("torch"); print(f"Python {sys.version.split()[0]}, megatron-core {v}, torch {t}")'))"
  "$venvs/$name/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25 \
    ${once[@]+"${once[@]}"} "$@" || status=1
done
# The release matrix and the upstream check run side by side: one after the other, a core
# would idle (the matrix's last round runs one release, the upstream check mostly one process
# at a time). The matrix runs at a lower priority (nice): the upstream check's steps are one
# chain, the longer, and the matrix's releases fill the core it leaves. Each writes its own
# log, which ends with its wall time and exit status; the two print whole, in this order,
# once both have ended. The step fails if either fails.
side_by_side() {  # $1 log, $2.. the command
  local log=$1 start=$SECONDS rc
  shift
  "$@" >"$log" 2>&1
  rc=$?
  echo "($*: $((SECONDS - start)) s, exit status $rc)" >>"$log"
  return $rc
}
step "release matrix (scripts/matrix.sh) and upstream check (scripts/upstream_check.sh), side by side; their logs follow"
side_by_side "$logs/matrix.log" nice -n 10 bash scripts/matrix.sh &
matrix_pid=$!
side_by_side "$logs/upstream.log" bash scripts/upstream_check.sh &
upstream_pid=$!
wait "$matrix_pid" || status=1
wait "$upstream_pid" || status=1
echo; echo "== the release matrix's log (the release_matrix tests on megatron-core 0.13.1 to 0.19.2)"
cat "$logs/matrix.log"
echo; echo "== the upstream check's log (the patch series on copies of 0.19.2 and 0.18.2)"
cat "$logs/upstream.log"
echo
echo "== $((SECONDS / 60)) min $((SECONDS % 60)) s in all"
if [ $status -eq 0 ]; then echo "== all checks passed on py311, py312 and the release matrix"; else echo "== SOME CHECKS FAILED"; fi
exit $status

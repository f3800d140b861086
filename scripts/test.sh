#!/usr/bin/env bash
# Set up both environments and run every test: lint, type checks, and pytest on
#   py312: Python 3.12, megatron-core 0.19.2 (native hook), jax 0.12, and the GPU machine's
#          torch 2.11.0 + Triton 3.6.0 (the Triton interpreter, the compile test)
#   py311: Python 3.11, megatron-core 0.16.1 (no hook; the adapter's own path), jax 0.10,
#          torch 2.13.0 (CPU)
# then the release matrix (scripts/matrix.sh): the tests marked release_matrix on every
# megatron-core release from 0.13.1 to 0.19.2, each in the environment of its Python,
# and the patch series of upstream/ on copies of 0.19.2 and 0.18.2 (scripts/upstream_check.sh).
# Extra arguments go to both pytest runs (e.g. -x, -k tp2).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venvs=${HOOKSPEC_VENVS:-$root/.venvs}
# The two environments' requirements are installed side by side (mostly downloads and
# unpacking), each into its own log, printed once all have ended; then the project itself
# into each, one after another (an editable install reads the one checkout).
setup_logs=$(mktemp -d)
trap 'rm -rf "$setup_logs"' EXIT
setup_pids=()
for name in py312 py311; do
  HOOKSPEC_DEPS_ONLY=1 bash scripts/setup_env.sh "$name" >"$setup_logs/$name.log" 2>&1 &
  setup_pids+=($!)
done
setup_status=0
for pid in "${setup_pids[@]}"; do wait "$pid" || setup_status=1; done
cat "$setup_logs"/py312.log "$setup_logs"/py311.log
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
step "release matrix: the release_matrix tests on megatron-core 0.13.1 to 0.19.2 (scripts/matrix.sh)"
bash scripts/matrix.sh || status=1
step "upstream: the patch series on copies of 0.19.2 and 0.18.2 (scripts/upstream_check.sh)"
bash scripts/upstream_check.sh || status=1
echo
echo "== $((SECONDS / 60)) min $((SECONDS % 60)) s in all"
if [ $status -eq 0 ]; then echo "== all checks passed on py311, py312 and the release matrix"; else echo "== SOME CHECKS FAILED"; fi
exit $status

#!/usr/bin/env bash
# The Megatron Core release matrix: a chosen subset of the tests (marked release_matrix)
# on each release, in the existing environments, without an environment per release.
#
#   bash scripts/matrix.sh              # every release below
#   bash scripts/matrix.sh 0.15.3       # some of them
#
# Each release's wheel is fetched once (`pip download --no-deps`) into .venvs/cache/mcore/,
# installed with `pip install --no-deps --target .venvs/mcore/<release>` (scripts/mcore_install.sh)
# and put first on PYTHONPATH of the environment of its Python (py311 or py312); the run
# checks that `megatron.core` then imports from that folder. The releases the environments
# themselves pin (0.16.1 in py311, 0.19.2 in py312) get the full suite from scripts/test.sh:
# here they only print their row of the release table (docs/releases.md). Every release prints
# `python -m torch_impl.doctor --facts-row`, the row tests/releases/test_release_matrix.py checks
# (for a fetched release, by the process that checked the import: one import of torch and
# Megatron for both).
# Two releases run at a time, each into its own log; the logs print whole, in order, at the end.
# Exit status: 0 when every release passed, 1 otherwise. Expects both environments set up.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venvs=${HOOKSPEC_VENVS:-$root/.venvs}
cache=$venvs/cache/mcore

# release and environment; kept equal to torch_impl.doctor.MATRIX_RELEASES (a test checks it)
MATRIX=(
  "0.13.1 py311"
  "0.14.0 py311"
  "0.15.3 py311"
  "0.16.1 py311"
  "0.17.1 py312"
  "0.18.2 py312"
  "0.19.2 py312"
)
TESTS=(tests/hook/test_enable.py tests/hook/test_enable_tp.py tests/hook/test_hybrid.py tests/releases/test_release_matrix.py tests/releases/test_doctor.py tests/releases/test_upstream_mirror.py)

wanted=("$@")
selected() { [ ${#wanted[@]} -eq 0 ] && return 0; local w; for w in "${wanted[@]}"; do [ "$w" = "$1" ] && return 0; done; return 1; }

install_release() {  # $1 release, $2 python; prints the target folder
  local release=$1 python=$2 target=$venvs/mcore/$1
  if [ ! -f "$target/.installed" ]; then
    rm -rf "$target"
    bash "$root/scripts/mcore_install.sh" "$cache" "$release" "$python" "$target" >&2 || return 1
    touch "$target/.installed"
  fi
  echo "$target"
}

export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}

run_release() {  # $1 release, $2 environment; prints its log, ends with its row of the summary
  local release=$1 env=$2 python=$venvs/$2/bin/python start=$SECONDS own target
  own=$("$python" -c 'import importlib.metadata as md; print(md.version("megatron-core"))')
  echo
  if [ "$own" = "$release" ]; then
    echo "== matrix: megatron-core $release ($env's own release: the full suite runs in scripts/test.sh)"
    "$python" -m torch_impl.doctor --facts-row || { echo "ROW $release  $env  FAILED: doctor"; return; }
    echo "ROW $release  $env  full suite (scripts/test.sh)"
    return
  fi
  echo "== matrix: megatron-core $release on $env ($("$python" -c 'import sys; print(sys.version.split()[0])'))"
  if ! target=$(install_release "$release" "$python"); then
    echo "could not fetch or install megatron-core $release"
    echo "ROW $release  $env  FAILED: install"; return
  fi
  # One process: the import check, then (exit status 3 where megatron.core did not import
  # from the target folder) the doctor's row, as `python -m torch_impl.doctor --facts-row`.
  local ok=1 rc=0
  PYTHONPATH="$target" "$python" - "$target" "$release" <<'EOF2' || rc=$?
import importlib.metadata as md, os, sys, traceback
target, release = os.path.realpath(sys.argv[1]), sys.argv[2]
try:
    import megatron.core
except Exception:
    traceback.print_exc()
    sys.exit(3)
where = os.path.realpath(megatron.core.__file__)
version = md.version("megatron-core")
print(f"megatron.core from {where} (metadata {version})")
if not (where.startswith(target + os.sep) and version == release):
    sys.exit(3)
from torch_impl.doctor import main
sys.exit(main(["--facts-row"]))
EOF2
  if [ $rc -eq 3 ]; then
    echo "megatron.core did not import from $target"
    echo "ROW $release  $env  FAILED: not shadowed"; return
  fi
  [ $rc -eq 0 ] || ok=0
  PYTHONPATH="$target" "$python" -m pytest -q -p no:cacheprovider -m release_matrix "${TESTS[@]}" || ok=0
  if [ $ok = 1 ]; then echo "ROW $release  $env  passed  $((SECONDS - start)) s"
  else echo "ROW $release  $env  FAILED  $((SECONDS - start)) s"; fi
}

# Two releases at a time (each run is one process; the machine has two cores), each into its
# own log, printed whole and in the table's order once all have ended.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
index=0
for entry in "${MATRIX[@]}"; do
  read -r release env <<<"$entry"
  selected "$release" || continue
  while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n || true; done
  index=$((index + 1))
  run_release "$release" "$env" >"$logs/$(printf %02d $index).log" 2>&1 &
done
wait
status=0
summary=()
for log in "$logs"/*.log; do
  [ -e "$log" ] || continue
  grep -v '^ROW ' "$log"
  row=$(grep '^ROW ' "$log" | tail -n 1)
  [ -n "$row" ] || row="ROW $(basename "$log" .log)  FAILED: no result"
  summary+=("${row#ROW }")
  case $row in *FAILED*) status=1 ;; esac
done
echo
echo "== release matrix"
printf '   %s\n' "${summary[@]}"
exit $status

#!/usr/bin/env bash
# The patch series of upstream/ (see upstream/README.md), checked on the released wheels:
#
#   1. megatron-core 0.19.2, the release of the py312 environment: its installed
#      megatron/core and metadata are copied to a scratch folder, every patch of
#      upstream/series is applied there (git apply), the patches' own unit tests run
#      there, and then the project's hook, MTP, HybridModel and plan tests run with the
#      patched copy first on PYTHONPATH and tests.stand_aside loaded: the adapter finds
#      Megatron's native hooks in the installed code and stands aside (a test fails if
#      the adapter's own post-processing, MTP loop or plan norm ran).
#   2. megatron-core 0.18.2 (its wheel fetched once into the cache scripts/matrix.sh
#      uses): the patches of upstream/series-0.18.2, the ones that apply there, and their
#      unit tests.
#
#   bash scripts/upstream_check.sh                 # both (scripts/test.sh runs this)
#   bash scripts/upstream_check.sh --full          # also test_mtp_tp.py, test_schedule_plan.py
#                                                  # and the reproductions on the patched copy
#   bash scripts/upstream_check.sh --main DIR      # instead: upstream/series-main on the
#                                                  # megatron/core of a Megatron-LM checkout
#
# PYTHON: the interpreter (default $HOOKSPEC_VENVS/py312/bin/python). Nothing is
# installed into its environment; the scratch folders are removed on exit.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venvs=${HOOKSPEC_VENVS:-$root/.venvs}
python=${PYTHON:-$venvs/py312/bin/python}
cache=$venvs/cache/mcore
full=0
main_dir=
while [ $# -gt 0 ]; do
  case $1 in
    --full) full=1 ;;
    --main) main_dir=$2; shift ;;
    *) echo "usage: $0 [--full] [--main MEGATRON_LM_CHECKOUT]" >&2; exit 2 ;;
  esac
  shift
done
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
status=0
step() { echo; echo "== upstream: $*"; }

apply_series() {  # $1 series file, $2 target folder: every listed patch, in order
  local name
  while read -r name; do
    case $name in ''|'#'*) continue ;; esac
    if ! (cd "$2" && git apply -p1 "$root/upstream/$name"); then
      echo "$name does not apply to $2" >&2
      return 1
    fi
    echo "applied $name"
  done <"$1"
}

unit_tests() {  # $1 target folder, $2.. extra pytest arguments: the tests the series added there
  local target=$1
  shift
  local tests
  tests=$(cd "$target" && find tests/unit_tests -name 'test_*.py' | sort)
  (cd "$target" && PYTHONPATH="$target${plugins:+:$plugins}" "$python" -m pytest -q -p no:cacheprovider "$@" $tests)
}
plugins=

imports_from() {  # $1 folder: megatron.core imports from it, with the metadata of its release
  PYTHONPATH="$1" "$python" - "$1" <<'EOF'
import importlib.metadata as md, os, sys
import megatron.core
where = os.path.realpath(megatron.core.__file__)
print(f"megatron.core {md.version('megatron-core')} from {where}")
sys.exit(0 if where.startswith(os.path.realpath(sys.argv[1]) + os.sep) else 1)
EOF
}

if [ -n "$main_dir" ]; then
  step "Megatron-LM main at $main_dir ($(git -C "$main_dir" log -1 --format='%H %cs' 2>/dev/null || echo 'not a git checkout'))"
  mkdir -p "$scratch/main/megatron"
  cp -r "$main_dir/megatron/core" "$scratch/main/megatron/core"
  apply_series upstream/series-main "$scratch/main" || exit 1
  # Without Transformer Engine, main's MTP layer fails to build on a CPU (see upstream/README.md);
  # upstream/check_plugin.py answers that one check, as TE's absence means.
  plugins="$root/upstream" unit_tests "$scratch/main" -p check_plugin || exit 1
  exit 0
fi

step "megatron-core 0.19.2 (py312's), patched with upstream/series"
site=$("$python" -c 'import megatron.core, os; print(os.path.dirname(os.path.dirname(os.path.realpath(megatron.core.__file__))))')
dist=$("$python" -c 'import importlib.metadata as md; print(md.distribution("megatron-core")._path)')
release=$("$python" -c 'import importlib.metadata as md; print(md.version("megatron-core"))')
if [ "$release" != 0.19.2 ]; then
  echo "upstream/series is for megatron-core 0.19.2; $python has $release" >&2
  exit 1
fi
mkdir -p "$scratch/v0192/megatron"
cp -r "$site/core" "$scratch/v0192/megatron/core"
cp -r "$dist" "$scratch/v0192/"
find "$scratch/v0192" -name __pycache__ -prune -exec rm -rf {} +
apply_series upstream/series "$scratch/v0192" || exit 1
imports_from "$scratch/v0192" || status=1
unit_tests "$scratch/v0192" || status=1

step "the project's hook, MTP, HybridModel and plan tests on the patched 0.19.2 (the adapter stands aside)"
project_tests=(tests/test_upstream_series.py tests/test_enable.py tests/test_mtp.py tests/test_hybrid.py tests/test_plan_whole.py)
if [ $full -eq 1 ]; then
  project_tests+=(tests/test_mtp_tp.py tests/test_schedule_plan.py)
fi
PYTHONPATH="$scratch/v0192:$root" "$python" -m pytest -q -p no:cacheprovider -p tests.stand_aside "${project_tests[@]}" || status=1
if [ $full -eq 1 ]; then
  step "the reproductions of docs/upstream.md on the patched 0.19.2 (reports 1 and 4 no longer show)"
  for script in final_norm_schedule_plan.py interleaved_gloo_batch_p2p.py; do
    out=$(PYTHONPATH="$scratch/v0192" "$python" "scripts/repro/$script" | tail -n 1)
    echo "$script: $out"
    case $out in *'"defect": false'*) ;; *) status=1 ;; esac
  done
fi

step "megatron-core 0.18.2, patched with upstream/series-0.18.2"
wheel=$(ls "$cache"/megatron_core-0.18.2-*.whl 2>/dev/null | head -n 1)
if [ -z "$wheel" ]; then
  mkdir -p "$cache"
  "$python" -m pip download -q --no-deps --only-binary=:all: -d "$cache" "megatron-core==0.18.2" || exit 1
  wheel=$(ls "$cache"/megatron_core-0.18.2-*.whl | head -n 1)
fi
"$python" -m pip install -q --no-deps --no-index --target "$scratch/v0182" "$wheel" || exit 1
apply_series upstream/series-0.18.2 "$scratch/v0182" || exit 1
imports_from "$scratch/v0182" || status=1
unit_tests "$scratch/v0182" || status=1

echo
if [ $status -eq 0 ]; then echo "== upstream: the series applies and its checks pass"; else echo "== upstream: SOME CHECKS FAILED"; fi
exit $status

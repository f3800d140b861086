#!/usr/bin/env bash
# The patch series of upstream/ (see upstream/README.md), checked as a Megatron maintainer
# would check it, on the released wheels:
#
#   1. megatron-core 0.19.2, the release of the py312 environment: its installed
#      megatron/core and metadata are copied to a scratch folder and the patches of
#      upstream/series applied there one by one (git apply). Before each patch, its unit
#      tests run on the copy without it (the series before it, plus its tests): exactly
#      the tests its description lists under "Fails without the fix" must fail, the others
#      pass. With the whole series, every patch's tests pass. Then the project's hook,
#      MTP, HybridModel and plan tests run with the patched copy first on PYTHONPATH and
#      tests.stand_aside loaded: the adapter finds Megatron's native hooks in the
#      installed code and stands aside (a test fails if the adapter's own
#      post-processing, MTP loop or plan norm ran where Megatron has the hook).
#   2. black and isort, at the versions Megatron pins (.pre-commit-config.yaml) with
#      Megatron's settings (upstream/megatron-format.toml), on every file the series
#      touches: a file the series adds whole, a file it changes on the lines it adds
#      (black --line-ranges; Megatron's own files are not all black-clean) and isort on
#      the whole file. Both run from a small virtual environment this script creates
#      once (UPSTREAM_FMT_VENV, default $HOOKSPEC_VENVS/upstream-fmt), from PyPI.
#   3. megatron-core 0.18.2 (its wheel fetched once into the cache scripts/matrix.sh
#      uses): the patches of upstream/series-0.18.2, the ones that apply there, and
#      their unit tests.
#
#   bash scripts/upstream_check.sh                 # all three (scripts/test.sh runs this)
#   bash scripts/upstream_check.sh --full          # also test_mtp_tp.py, test_schedule_plan.py
#                                                  # and the reproductions on the patched copy
#   bash scripts/upstream_check.sh --main DIR      # instead: upstream/series-main on the
#                                                  # megatron/core of a Megatron-LM checkout
#                                                  # at the snapshot series-main records,
#                                                  # steps 1 and 2 there (by hand: CI has no
#                                                  # network but PyPI)
#
# PYTHON: the interpreter (default $HOOKSPEC_VENVS/py312/bin/python). Nothing is
# installed into its environment; the scratch folders are removed on exit.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venvs=${HOOKSPEC_VENVS:-$root/.venvs}
python=${PYTHON:-$venvs/py312/bin/python}
cache=$venvs/cache/mcore
fmt_venv=${UPSTREAM_FMT_VENV:-$venvs/upstream-fmt}
black_version=26.3.0 # Megatron-LM's .pre-commit-config.yaml
isort_version=5.13.2
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
plugins= # a folder on PYTHONPATH holding check_plugin (main only)

series_patches() {  # $1 series file: its patches, in order
  sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$1"
}

patch_tests() {  # $1 patch: the test files it adds or changes
  sed -n 's|^diff --git a/\(tests/[^ ]*\) b/.*|\1|p' "$1"
}

description_of() {  # $1 patch path under upstream/: its description
  local name
  name=$(basename "$1" .patch)
  echo "$root/upstream/$name.md"
}

fails_as_described() {  # $1 pytest -rA log, $2 description: the failures are those it lists
  "$python" - "$1" "$2" "${main_dir:+main}" <<'EOF'
import re, sys

log, description, where = sys.argv[1:]
# "### Fails without the fix" then a fenced block of node ids; an id without parameters
# stands for every parametrization of that test. On main, the block under
# "### Fails without the fix on main" too, where the description has one.
text = open(description).read()
headings = ["### Fails without the fix\n"] + (["### Fails without the fix on main"] if where else [])
expected = []
for heading in headings:
    if heading in text:
        block = text.split(heading, 1)[1].split("```")[1]
        expected += [line.strip() for line in block.splitlines()[1:] if line.strip()]
outcome = {}
for line in open(log):
    found = re.match(r"^(PASSED|FAILED|ERROR) (\S+)", line)
    if found:
        outcome[found.group(2)] = found.group(1)
failed = {node for node, result in outcome.items() if result != "PASSED"}
wrong, covered = [], set()
for entry in expected:
    nodes = [n for n in outcome if n == entry or ("[" not in entry and n.split("[")[0] == entry)]
    if not nodes or any(outcome[n] == "PASSED" for n in nodes):
        wrong.append(f"listed, but passed or did not run: {entry}")
    covered.update(nodes)
wrong += [f"failed, but not listed: {node}" for node in sorted(failed - covered)]
for line in wrong:
    print("  " + line, file=sys.stderr)
print(f"{len(failed)} failed, {len(outcome) - len(failed)} passed")
sys.exit(1 if wrong else 0)
EOF
}

run_tests() {  # $1 folder, $2.. pytest arguments (test files): pytest there
  local target=$1
  shift
  local plugin_args=()
  [ -n "$plugins" ] && plugin_args=(-p check_plugin)
  (cd "$target" && PYTHONPATH="$target${plugins:+:$plugins}" "$python" -m pytest -q \
    -p no:cacheprovider "${plugin_args[@]}" "$@")
}

apply_one() {  # $1 patch (relative to upstream/), $2 target folder, $3.. git apply options
  local patch=$1 target=$2
  shift 2
  (cd "$target" && git apply -p1 "$@" "$root/upstream/$patch")
}

check_series() {  # $1 series file, $2 target folder holding the unpatched megatron/core
  local series=$1 target=$2 patch tests summary log
  local all_tests=()
  while read -r patch; do
    mapfile -t tests < <(patch_tests "$root/upstream/$patch")
    rm -rf "$scratch/before" && cp -r "$target" "$scratch/before"
    if ! apply_one "$patch" "$scratch/before" --include='tests/*'; then
      echo "$patch: its tests do not apply to $target" >&2
      return 1
    fi
    log=$scratch/before.log
    run_tests "$scratch/before" -rA "${tests[@]}" >"$log" 2>&1
    if summary=$(fails_as_described "$log" "$(description_of "$patch")"); then
      echo "$patch without its fix: $summary, as its description says"
    else
      echo "$patch without its fix: $summary, not as its description says" >&2
      tail -n 5 "$log" >&2
      status=1
    fi
    if ! apply_one "$patch" "$target"; then
      echo "$patch does not apply to $target" >&2
      return 1
    fi
    echo "applied $patch"
    all_tests+=("${tests[@]}")
  done < <(series_patches "$series")
  rm -rf "$scratch/before"
  step "the series' unit tests with the whole series"
  run_tests "$target" "${all_tests[@]}" || status=1
}

format_check() {  # $1 unpatched folder, $2 patched folder, $3 series file
  local orig=$1 patched=$2 series=$3 file ranges bad=0
  local have_black have_isort
  have_black=$("$fmt_venv/bin/black" --version 2>/dev/null)
  have_isort=$("$fmt_venv/bin/isort" --version 2>/dev/null)
  if [[ $have_black != *" $black_version "* || $have_isort != *"VERSION $isort_version"* ]]; then
    echo "creating $fmt_venv (black $black_version, isort $isort_version)"
    rm -rf "$fmt_venv"
    "$python" -m venv "$fmt_venv" || return 1
    "$fmt_venv/bin/python" -m pip install -q "black==$black_version" "isort==$isort_version" || return 1
  fi
  local config=$root/upstream/megatron-format.toml
  while read -r file; do
    if [ -f "$orig/$file" ]; then
      # the lines the series adds, as black --line-ranges START-END arguments
      mapfile -t ranges < <(diff -U0 "$orig/$file" "$patched/$file" |
        sed -n 's/^@@ -[0-9,]* +\([0-9]*\),\{0,1\}\([0-9]*\) @@.*/\1 \2/p' |
        awk '{n = ($2 == "" ? 1 : $2); if (n > 0) print "--line-ranges=" $1 "-" ($1 + n - 1)}')
      [ ${#ranges[@]} -eq 0 ] && continue
    else
      ranges=()
    fi
    if ! (cd "$patched" && "$fmt_venv/bin/black" -q --config "$config" --check "${ranges[@]}" "$file" 2>/dev/null); then
      echo "black: $file (lines the series adds)" >&2
      (cd "$patched" && "$fmt_venv/bin/black" -q --config "$config" --diff "${ranges[@]}" "$file" 2>/dev/null) | head -n 30 >&2
      bad=1
    fi
    if ! (cd "$patched" && "$fmt_venv/bin/isort" -q --settings-path "$config" --check-only "$file"); then
      echo "isort: $file" >&2
      bad=1
    fi
  done < <(while read -r patch; do
             sed -n 's|^diff --git a/\([^ ]*\) b/.*|\1|p' "$root/upstream/$patch"
           done < <(series_patches "$series") | sort -u)
  if [ $bad -eq 0 ]; then
    echo "black $black_version and isort $isort_version: clean with Megatron's settings on every file the series touches"
  fi
  return $bad
}

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
  recorded=$(sed -n 's/^# snapshot: //p' upstream/series-main)
  here=$(git -C "$main_dir" log -1 --format='%H %cs' 2>/dev/null || echo 'not a git checkout')
  step "Megatron-LM main at $main_dir ($here; upstream/series-main records $recorded)"
  if [ "${here%% *}" != "${recorded%% *}" ]; then
    echo "upstream/series-main is checked at ${recorded%% *}; check out that commit, or" >&2
    echo "rebase the series and record the new snapshot and its date there" >&2
    exit 1
  fi
  mkdir -p "$scratch/main/megatron" "$scratch/orig/megatron"
  cp -r "$main_dir/megatron/core" "$scratch/main/megatron/core"
  cp -r "$main_dir/megatron/core" "$scratch/orig/megatron/core"
  # Without patch 0006 no MTP layer builds on a CPU without Transformer Engine (report 6):
  # upstream/check_plugin.py answers that one check where the fix is absent.
  plugins="$root/upstream"
  check_series upstream/series-main "$scratch/main" || exit 1
  step "black and isort on the files upstream/series-main touches"
  format_check "$scratch/orig" "$scratch/main" upstream/series-main || status=1
  exit $status
fi

step "megatron-core 0.19.2 (py312's), each patch of upstream/series without and with its fix"
site=$("$python" -c 'import megatron.core, os; print(os.path.dirname(os.path.dirname(os.path.realpath(megatron.core.__file__))))')
dist=$("$python" -c 'import importlib.metadata as md; print(md.distribution("megatron-core")._path)')
release=$("$python" -c 'import importlib.metadata as md; print(md.version("megatron-core"))')
if [ "$release" != 0.19.2 ]; then
  echo "upstream/series is for megatron-core 0.19.2; $python has $release" >&2
  exit 1
fi
mkdir -p "$scratch/v0192/megatron" "$scratch/orig/megatron"
cp -r "$site/core" "$scratch/v0192/megatron/core"
cp -r "$dist" "$scratch/v0192/"
find "$scratch/v0192" -name __pycache__ -prune -exec rm -rf {} +
cp -r "$scratch/v0192/megatron/core" "$scratch/orig/megatron/core"
imports_from "$scratch/v0192" || status=1
check_series upstream/series "$scratch/v0192" || exit 1

step "black and isort on the files upstream/series touches"
format_check "$scratch/orig" "$scratch/v0192" upstream/series || status=1

step "the project's hook, MTP, HybridModel and plan tests on the patched 0.19.2 (the adapter stands aside)"
project_tests=(tests/test_upstream_series.py tests/test_enable.py tests/test_mtp.py tests/test_hybrid.py tests/test_plan_whole.py)
if [ $full -eq 1 ]; then
  project_tests+=(tests/test_mtp_tp.py tests/test_schedule_plan.py)
fi
PYTHONPATH="$scratch/v0192:$root" "$python" -m pytest -q -p no:cacheprovider -p tests.stand_aside "${project_tests[@]}" || status=1
if [ $full -eq 1 ]; then
  step "the reproductions of docs/upstream.md on the patched 0.19.2 (reports 1, 4 and 5 no longer show)"
  for script in final_norm_schedule_plan.py interleaved_gloo_batch_p2p.py plan_mtp_overwrites_input_ids.py; do
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
imports_from "$scratch/v0182" || status=1
tests=()
while read -r patch; do
  apply_one "$patch" "$scratch/v0182" || { echo "$patch does not apply to 0.18.2" >&2; exit 1; }
  echo "applied $patch"
  mapfile -t -O ${#tests[@]} tests < <(patch_tests "$root/upstream/$patch")
done < <(series_patches upstream/series-0.18.2)
run_tests "$scratch/v0182" "${tests[@]}" || status=1

echo
if [ $status -eq 0 ]; then echo "== upstream: the series applies and its checks pass"; else echo "== upstream: SOME CHECKS FAILED"; fi
exit $status

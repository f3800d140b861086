#!/usr/bin/env bash
# The patch series of upstream/ (see upstream/README.md), checked on a CPU as a Megatron
# maintainer would check it:
#
#   1. megatron-core 0.19.2, the release of the py312 environment: its installed
#      megatron/core and metadata are copied to a scratch folder and the patches of
#      upstream/series applied there one by one (git apply: the megatron/ part, and the
#      test files a patch creates; the wheel has no tests/). Before each patch, the tests
#      upstream/checks.toml names for it run on the copy without it (the series before
#      it): exactly the tests it lists under "fails" must fail, the others pass. With the
#      whole series they all pass. They run through upstream/cpu_harness.py: Megatron's
#      own unit tests that need neither CUDA nor Transformer Engine, with Utils over gloo
#      (two processes under torchrun where they need two ranks), and this project's CPU
#      checks of the patches whose Megatron tests need GPUs. Then the project's hook,
#      MTP, HybridModel and plan tests run with the patched copy first on PYTHONPATH and
#      tests.stand_aside loaded: the adapter finds Megatron's native hooks in the
#      installed code and stands aside.
#   2. black and isort as Megatron's pre-commit runs them (its pinned versions, its
#      settings in upstream/megatron-format.toml): black on the lines the series adds to
#      megatron/core and tests/unit_tests (a file it creates, whole), isort on the
#      megatron/core files it touches. They run from a small virtual environment this
#      script creates once (UPSTREAM_FMT_VENV, default $HOOKSPEC_VENVS/upstream-fmt).
#   3. The sign-off: each patch applied with `git am --signoff` and its author reset,
#      as upstream/README.md tells the submitter, carries exactly one Signed-off-by, the
#      submitter's, who is also its author.
#   4. megatron-core 0.18.2 (installed by scripts/mcore_install.sh, its wheel fetched once
#      into the cache scripts/matrix.sh uses): the patches of upstream/series-0.18.2 and their
#      tests. It runs beside steps 1 to 3 (mostly one process at a time), into its own
#      log, printed after them.
#
#   bash scripts/upstream_check.sh              # all of it on 0.19.2 and 0.18.2 (CI)
#   bash scripts/upstream_check.sh --full       # also test_mtp_tp.py, test_schedule_plan.py
#                                               # and the reproductions on the patched copy
#   bash scripts/upstream_check.sh --main DIR   # instead: upstream/series-main on a
#   bash scripts/upstream_check.sh --dev DIR    # Megatron-LM checkout (main or dev) at the
#                                               # snapshot the series file records: the
#                                               # whole patches with git am, steps 1 to 3
#                                               # there (by hand: CI has no network but PyPI)
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
checkout=
series_file=upstream/series
while [ $# -gt 0 ]; do
  case $1 in
    --full) full=1 ;;
    --main) checkout=$2; series_file=upstream/series-main; shift ;;
    --dev) checkout=$2; series_file=upstream/series-dev; shift ;;
    *) echo "usage: $0 [--full] [--main|--dev MEGATRON_LM_CHECKOUT]" >&2; exit 2 ;;
  esac
  shift
done
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
scratch=$(mktemp -d)
v0182_pid=  # step 4, while it runs in the background
trap '[ -z "$v0182_pid" ] || kill -- "-$v0182_pid" 2>/dev/null; rm -rf "$scratch"' EXIT
status=0
started=$SECONDS
port_base=29500  # torchrun's master port: port_base + RANDOM % 1000 (step 4: its own range)
step() { echo; echo "== upstream: $*"; }

series_patches() {  # $1 series file: its patches, in order
  sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$1"
}

patch_files() {  # $1 patch: the files it touches
  sed -n 's|^diff --git a/\([^ ]*\) b/.*|\1|p' "$1"
}

created_files() {  # $1 patch: the files it creates
  awk '/^diff --git a\//{path=substr($3, 3)} /^new file mode/{print path}' "$1"
}

checks() {  # $1 patch name, $2 key of upstream/checks.toml: its entries, one a line
  "$python" - "$1" "$2" <<'EOF'
import sys, tomllib
with open("upstream/checks.toml", "rb") as f:
    sys.stdout.write("".join(f"{x}\n" for x in tomllib.load(f).get(sys.argv[1], {}).get(sys.argv[2], [])))
EOF
}

include_args() {  # $1 patch, $2 target, $3 "tests" or "code" for one part only: git apply
  local patch=$1 target=$2 file  # --include for what applies there (test files there or created)
  [ "${3:-}" = tests ] || echo "--include=megatron/*"
  [ "${3:-}" = code ] && return
  while read -r file; do
    if [ -f "$target/$file" ] || grep -qxF "$file" <(created_files "$patch"); then
      echo "--include=$file"
    fi
  done < <(patch_files "$patch" | grep '^tests/')
}

apply_one() {  # $1 patch (relative to upstream/), $2 target, $3 "tests" or "code" only
  local patch=$root/upstream/$1 target=$2 includes
  mapfile -t includes < <(include_args "$patch" "$target" "${3:-}")
  [ ${#includes[@]} -gt 0 ] || return 0
  (cd "$target" && git apply -p1 "${includes[@]}" "$patch")
}

run_checks() {  # $1 folder, $2.. patch names: their tests there, pytest -rA, one log
  local target=$1 name file rc=0
  shift
  local cpu=() unit=() unit2=()
  for name in "$@"; do
    mapfile -t -O ${#cpu[@]} cpu < <(checks "$name" cpu | grep .)
    mapfile -t -O ${#unit[@]} unit < <(checks "$name" unit | grep .)
    mapfile -t -O ${#unit2[@]} unit2 < <(checks "$name" unit2 | grep .)
  done
  local pytest=(-m pytest -q -rA -p no:cacheprovider -p cpu_harness)
  local path="$target:$root/upstream"
  if [ ${#cpu[@]} -gt 0 ]; then
    PYTHONPATH="$path" "$python" "${pytest[@]}" "${cpu[@]}" || rc=1
  fi
  if [ ${#unit[@]} -gt 0 ]; then
    (cd "$target" && PYTHONPATH="$path" "$python" "${pytest[@]}" --noconftest "${unit[@]}") || rc=1
  fi
  if [ ${#unit2[@]} -gt 0 ]; then
    (cd "$target" && PYTHONPATH="$path" "$python" -m torch.distributed.run --nproc-per-node 2 \
      --master-port "$((port_base + RANDOM % 1000))" "${pytest[@]}" --noconftest "${unit2[@]}") || rc=1
  fi
  return $rc
}

fails_as_listed() {  # $1 pytest -rA log, $2 patch name: the failures are those listed
  "$python" - "$1" "$2" "${checkout:+main}" <<'EOF'
import re, sys, tomllib

log, name, where = sys.argv[1:]
with open("upstream/checks.toml", "rb") as f:
    entry = tomllib.load(f)[name]
expected = entry.get("fails", []) + (entry.get("fails_main", []) if where else [])
outcome = {}
for line in open(log):
    found = re.match(r"^(PASSED|FAILED|ERROR) (\S+)", line)
    if found:  # two ranks print a line each: any failure fails the test
        node, result = found.group(2), found.group(1)
        outcome[node] = result if outcome.get(node, "PASSED") == "PASSED" else outcome[node]
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
sys.exit(1 if wrong or not outcome else 0)
EOF
}

check_series() {  # $1 series file, $2 target folder holding the unpatched megatron/core
  local series=$1 target=$2 patch name summary log
  local names=()
  while read -r patch; do
    # without the fix: the series before it and the patch's tests, in the target itself
    # (its compiled modules are reused from one run to the next)
    name=$(basename "$patch")
    if ! apply_one "$patch" "$target" tests; then
      echo "$patch: its tests do not apply to $target" >&2
      return 1
    fi
    log=$scratch/$name.log
    run_checks "$target" "$name" >"$log" 2>&1
    if summary=$(fails_as_listed "$log" "$name"); then
      echo "$patch without its fix: $summary, as upstream/checks.toml lists"
    else
      echo "$patch without its fix: $summary, not as upstream/checks.toml lists" >&2
      tail -n 5 "$log" >&2
      status=1
    fi
    if ! apply_one "$patch" "$target" code; then
      echo "$patch does not apply to $target" >&2
      return 1
    fi
    echo "applied $patch"
    names+=("$name")
  done < <(series_patches "$series")
  step "the series' tests with the whole series"
  run_checks "$target" "${names[@]}" >"$scratch/after.log" 2>&1 || status=1
  grep -E '^(FAILED|ERROR) ' "$scratch/after.log" | sort -u >&2
  grep -E '^[0-9]+ (passed|failed)' "$scratch/after.log"
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
    [ -f "$patched/$file" ] || continue  # a test file the wheel does not carry
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
    if [[ $file == megatron/core/* ]] &&
      ! (cd "$patched" && "$fmt_venv/bin/isort" -q --settings-path "$config" --check-only "$file"); then
      echo "isort: $file" >&2
      bad=1
    fi
  done < <(while read -r patch; do patch_files "$root/upstream/$patch"; done < <(series_patches "$series") |
             grep -E '^(megatron/core|tests/unit_tests)/' | sort -u)
  if [ $bad -eq 0 ]; then
    echo "black $black_version and isort $isort_version: clean as Megatron's pre-commit runs them"
  fi
  return $bad
}

signoff_check() {  # $1 git work tree at the series' base, $2 series file
  local repo=$1 series=$2 patch name author trailers bad=0
  local who=(-c user.name="Maintainer Check" -c user.email="check@example.invalid")
  while read -r patch; do
    name=$(basename "$patch")
    local includes=()
    [ -n "$checkout" ] || mapfile -t includes < <(include_args "$root/upstream/$patch" "$repo")
    if ! git -C "$repo" "${who[@]}" am -q --signoff "${includes[@]}" "$root/upstream/$patch" ||
      ! git -C "$repo" "${who[@]}" commit -q --amend --no-edit --reset-author; then
      echo "$name: git am does not apply it" >&2
      git -C "$repo" am --abort 2>/dev/null
      return 1
    fi
    author=$(git -C "$repo" log -1 --format='%an <%ae>')
    trailers=$(git -C "$repo" log -1 --format=%B | git interpret-trailers --parse | grep '^Signed-off-by:')
    if [ "$trailers" != "Signed-off-by: $author" ] || [ "$author" != "Maintainer Check <check@example.invalid>" ]; then
      echo "$name: author $author, sign-off [$trailers]" >&2
      bad=1
    fi
  done < <(series_patches "$series")
  [ $bad -eq 0 ] && echo "every commit signed off by its submitter, who is its author"
  return $bad
}

imports_from() {  # $1 folder: megatron.core imports from it
  PYTHONPATH="$1" "$python" - "$1" <<'EOF'
import importlib.metadata as md, os, sys
import megatron.core
where = os.path.realpath(megatron.core.__file__)
print(f"megatron.core {md.version('megatron-core')} from {where}")
sys.exit(0 if where.startswith(os.path.realpath(sys.argv[1]) + os.sep) else 1)
EOF
}

check_0182() {  # step 4: 0.18.2 patched with upstream/series-0.18.2; 1 if a check failed
  local patch names=() rc=0
  local port_base=30500  # its torchrun may run beside step 1's
  step "megatron-core 0.18.2, patched with upstream/series-0.18.2"
  bash "$root/scripts/mcore_install.sh" "$cache" 0.18.2 "$python" "$scratch/v0182" || return 1
  imports_from "$scratch/v0182" || rc=1
  while read -r patch; do
    apply_one "$patch" "$scratch/v0182" || { echo "$patch does not apply to 0.18.2" >&2; return 1; }
    echo "applied $patch"
    names+=("$(basename "$patch")")
  done < <(series_patches upstream/series-0.18.2)
  run_checks "$scratch/v0182" "${names[@]}" >"$scratch/v0182.log" 2>&1 || rc=1
  grep -E '^(FAILED|ERROR) ' "$scratch/v0182.log" | sort -u >&2
  grep -E '^[0-9]+ (passed|failed)' "$scratch/v0182.log"
  return $rc
}

finish() {
  echo
  if [ $status -eq 0 ]; then
    echo "== upstream: the series applies and its checks pass ($((SECONDS - started)) s)"
  else
    echo "== upstream: SOME CHECKS FAILED ($((SECONDS - started)) s)"
  fi
  exit $status
}

if [ -n "$checkout" ]; then
  recorded=$(sed -n 's/^# snapshot: //p' "$series_file")
  here=$(git -C "$checkout" log -1 --format='%H %cs' 2>/dev/null || echo 'not a git checkout')
  step "Megatron-LM at $checkout ($here; $series_file records $recorded)"
  if [ "${here%% *}" != "${recorded%% *}" ]; then
    echo "$series_file is checked at ${recorded%% *}; check out that commit, or" >&2
    echo "rebase the series and record the new snapshot and its date there" >&2
    exit 1
  fi
  # megatron/core and the test files the series touches, as the checkout has them
  for copy in target orig; do
    mkdir -p "$scratch/$copy/megatron"
    cp -r "$checkout/megatron/core" "$scratch/$copy/megatron/core"
    while read -r file; do
      if [ -f "$checkout/$file" ]; then
        mkdir -p "$scratch/$copy/$(dirname "$file")" && cp "$checkout/$file" "$scratch/$copy/$file"
      fi
    done < <(while read -r patch; do patch_files "$root/upstream/$patch"; done < <(series_patches "$series_file") | grep '^tests/' | sort -u)
  done
  check_series "$series_file" "$scratch/target" || exit 1
  step "black and isort on the files $series_file touches"
  format_check "$scratch/orig" "$scratch/target" "$series_file" || status=1
  step "git am and the sign-off, on a clone at ${recorded%% *}"
  git clone -q --shared --no-checkout "$checkout" "$scratch/am" &&
    git -C "$scratch/am" checkout -q "${recorded%% *}" &&
    signoff_check "$scratch/am" "$series_file" || status=1
  finish
fi

# Step 4 runs beside steps 1 to 3, in a process group of its own (set -m; an early exit
# ends it with its processes), into its own log, printed after them.
set -m
check_0182 >"$scratch/v0182-step.log" 2>&1 </dev/null &
v0182_pid=$!
set +m

step "megatron-core 0.19.2 (py312's), each patch of upstream/series without and with its fix"
site=$("$python" -c 'import importlib.util as u, os; print(os.path.dirname(os.path.dirname(os.path.realpath(u.find_spec("megatron.core").origin))))')
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
cp -r "$scratch/v0192" "$scratch/orig"
imports_from "$scratch/v0192" || status=1
check_series upstream/series "$scratch/v0192" || exit 1

step "black and isort on the files upstream/series touches"
format_check "$scratch/orig" "$scratch/v0192" upstream/series || status=1

step "git am and the sign-off (the megatron/ part, on a copy of 0.19.2)"
(cd "$scratch/orig" && git init -q && git add -A &&
  git -c user.name=base -c user.email=base@example.invalid commit -q -m base) &&
  signoff_check "$scratch/orig" upstream/series || status=1

step "the project's hook, MTP, HybridModel and plan tests on the patched 0.19.2 (the adapter stands aside)"
project_tests=(tests/releases/test_upstream_series.py tests/hook/test_enable.py tests/hook/test_mtp.py tests/hook/test_hybrid.py tests/hook/test_plan_whole.py)
if [ $full -eq 1 ]; then
  project_tests+=(tests/hook/test_mtp_tp.py tests/hook/test_schedule_plan.py)
fi
PYTHONPATH="$scratch/v0192:$root" "$python" -m pytest -q -p no:cacheprovider -p tests.support.stand_aside "${project_tests[@]}" || status=1
if [ $full -eq 1 ]; then
  step "the reproductions of docs/upstream.md on the patched 0.19.2 (reports 1, 4 and 5 no longer show)"
  for script in final_norm_schedule_plan.py interleaved_gloo_batch_p2p.py plan_mtp_overwrites_input_ids.py; do
    out=$(PYTHONPATH="$scratch/v0192" "$python" "scripts/repro/$script" | tail -n 1)
    echo "$script: $out"
    case $out in *'"defect": false'*) ;; *) status=1 ;; esac
  done
fi

wait "$v0182_pid" || status=1
v0182_pid=
cat "$scratch/v0182-step.log"
finish

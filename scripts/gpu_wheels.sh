#!/usr/bin/env bash
# Run here, on a machine with PyPI, before a GPU run: put in .whl/ (ignored by git) every
# wheel the GPU machine lacks and cannot fetch (it reaches no package index), and check that
# the working tree plus .whl/ stays under 64 MiB, the most the GPU command's copy of the
# tree may take.
#   .whl/           megatron-core 0.19.2, liger-kernel 0.8.5, cut-cross-entropy 25.1.1, verl 0.9.1
#   .whl/mcore016/  megatron-core 0.16.1 (one version of a package per folder: pip refuses two)
#   .whl/commit.txt the commit and the count of uncommitted paths (the GPU copy has no .git)
# Not in .whl/: Liger-Kernel's SM90 CUTLASS-DSL path needs nvidia-cutlass-dsl and its
# -libs-cu12/-libs-cu13 wheel (about 92 MB), more than the 64 MiB; the benchmark reports
# that method as not measured, and why.
# Then, on the GPU machine, with .whl carried beside the working tree:
#   bash scripts/gpu_tests.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
dest=$root/.whl
py=${PYTHON:-python3}
limit_mib=64
mkdir -p "$dest" "$dest/mcore016"

download() {  # download DIR SPEC...: wheels for CPython 3.12 on x86-64 Linux, no dependencies
  local dir=$1
  shift
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$dir" "$@" 2> >(grep -v -e "is ignored: it is neither a file nor a directory" >&2)
}

download "$dest" megatron-core==0.19.2 liger-kernel==0.8.5 cut-cross-entropy==25.1.1 verl==0.9.1
download "$dest/mcore016" megatron-core==0.16.1

for spec in "megatron_core-0.19.2" "liger_kernel-0.8.5" "cut_cross_entropy-25.1.1" "verl-0.9.1" \
  "mcore016/megatron_core-0.16.1"; do
  if ! ls "$dest"/"$spec"-*.whl >/dev/null 2>&1; then
    echo "gpu_wheels.sh: FAILED: no $spec wheel in $dest" >&2
    exit 1
  fi
done

{
  git rev-parse HEAD 2>/dev/null || echo unknown
  echo "uncommitted paths: $(git status --porcelain 2>/dev/null | wc -l)"
  echo "written: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$dest/commit.txt"

# What the GPU command's copy of the tree holds: the tracked and untracked-not-ignored files, plus .whl/.
wheels_bytes=$(du -sb "$dest" | cut -f1)
tree_bytes=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
total=$((wheels_bytes + tree_bytes))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "gpu_wheels.sh: wheels $(mib "$wheels_bytes"), working tree $(mib "$tree_bytes"), together $(mib "$total") (limit $limit_mib MiB)"
(cd "$dest" && ls -l ./*.whl mcore016/*.whl | awk '{ printf "  %10d  %s\n", $5, $9 }')
if [ "$total" -gt $((limit_mib * 1048576)) ]; then
  echo "gpu_wheels.sh: FAILED: $(mib "$total") is over the $limit_mib MiB the GPU command's copy of the tree may take;" \
    "remove wheels from .whl/ or files from the tree" >&2
  exit 1
fi

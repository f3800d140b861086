#!/usr/bin/env bash
# Here, on a machine with PyPI: put in .whl/ (ignored by git) the wheels that the GPU
# machine lacks and cannot fetch (it reaches no package index). About 7 MB in all:
#   megatron-core 0.19.2 and 0.16.1, liger-kernel 0.8.5, cut-cross-entropy 25.1.1, verl 0.9.1.
# Then run `bash scripts/gpu_bench.sh` there, with `.whl` carried beside the working tree.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=$root/.whl
mkdir -p "$dest"
py=${PYTHON:-python3}
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$dest" \
  megatron-core==0.19.2 liger-kernel==0.8.5 cut-cross-entropy==25.1.1 verl==0.9.1
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$dest/mcore016" \
  megatron-core==0.16.1
ls -la "$dest" "$dest/mcore016"

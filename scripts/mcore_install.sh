#!/usr/bin/env bash
# Install megatron-core RELEASE into TARGET (`pip install --no-deps --target`, with PYTHON's
# pip), from its wheel in CACHE, fetched there first if absent (`pip download --no-deps`).
# scripts/matrix.sh and scripts/upstream_check.sh, which scripts/test.sh runs side by side,
# both call it, and both may fetch 0.18.2 at once: the wheel is downloaded into a folder of
# its own and moved into CACHE whole, so neither reads a half-written file.
#   bash scripts/mcore_install.sh CACHE RELEASE PYTHON TARGET
set -uo pipefail
usage="usage: mcore_install.sh CACHE RELEASE PYTHON TARGET"
cache=${1:?$usage} release=${2:?$usage} python=${3:?$usage} target=${4:?$usage}
pip_quiet() {  # PYTHON's pip, without the notes some pip configurations print for every package
  "$python" -m pip -q "$@" 2> >(grep -v -e "is ignored: it is neither a file nor a directory" \
    -e "Running pip as the 'root' user" >&2)
}
found() { ls "$cache"/megatron_core-"$release"-*.whl 2>/dev/null | head -n 1; }
wheel=$(found)
if [ -z "$wheel" ]; then
  mkdir -p "$cache"
  fetch=$(mktemp -d "$cache/.fetch.XXXXXX") || exit 1
  pip_quiet download --no-deps --only-binary=:all: -d "$fetch" "megatron-core==$release" &&
    mv "$fetch"/megatron_core-"$release"-*.whl "$cache"/
  rm -rf "$fetch"
  wheel=$(found)
fi
[ -n "$wheel" ] || { echo "mcore_install.sh: no megatron-core $release wheel in $cache" >&2; exit 1; }
pip_quiet install --no-deps --no-index --target "$target" "$wheel"

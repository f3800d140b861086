#!/usr/bin/env bash
# Print the path of megatron-core RELEASE's wheel in CACHE, fetching it there first if absent
# (`pip download --no-deps`, with PYTHON's pip). scripts/matrix.sh and scripts/upstream_check.sh,
# which scripts/test.sh runs side by side, both call it, and both may fetch 0.18.2 at once: the
# wheel is downloaded into a folder of its own and moved into CACHE whole, so neither reads a
# half-written file.
#   bash scripts/mcore_wheel.sh CACHE RELEASE PYTHON
set -uo pipefail
cache=${1:?usage: mcore_wheel.sh CACHE RELEASE PYTHON} release=${2:?release} python=${3:?python}
found() { ls "$cache"/megatron_core-"$release"-*.whl 2>/dev/null | head -n 1; }
wheel=$(found)
if [ -z "$wheel" ]; then
  mkdir -p "$cache"
  fetch=$(mktemp -d "$cache/.fetch.XXXXXX") || exit 1
  "$python" -m pip download -q --no-deps --only-binary=:all: -d "$fetch" "megatron-core==$release" \
    2> >(grep -v -e "is ignored: it is neither a file nor a directory" \
      -e "Running pip as the 'root' user" >&2) &&
    mv "$fetch"/megatron_core-"$release"-*.whl "$cache"/
  rm -rf "$fetch"
  wheel=$(found)
fi
[ -n "$wheel" ] || { echo "mcore_wheel.sh: no megatron-core $release wheel in $cache" >&2; exit 1; }
echo "$wheel"

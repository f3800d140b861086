#!/usr/bin/env bash
# Create (or reuse) one pinned environment of the project.
#   bash scripts/setup_env.sh py312   # Python 3.12, megatron-core 0.19.2 (native hook), jax 0.12,
#                                     # torch 2.11.0 + Triton 3.6.0: the GPU machine's pair
#   bash scripts/setup_env.sh py311   # Python 3.11, megatron-core 0.16.1 (no hook), jax 0.10,
#                                     # torch 2.13.0 (CPU): the newest torch
# Environments live in $HOOKSPEC_VENVS (default: .venvs/ in the checkout). An environment
# whose requirements file is unchanged is reused; the project itself is (re)installed
# editable from this checkout every time, which takes seconds.
set -euo pipefail
name=${1:?usage: setup_env.sh py311|py312}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venvs=${HOOKSPEC_VENVS:-$root/.venvs}
req=$root/requirements/$name.txt
[ -f "$req" ] || { echo "setup_env.sh: no requirements file $req" >&2; exit 2; }

find_python() {  # $1 = 3.11 or 3.12
  local want=$1 exe
  for exe in "python$want" "python3"; do
    if command -v "$exe" >/dev/null 2>&1 && "$exe" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" 2>/dev/null; then
      command -v "$exe"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then  # pyenv shims find a version only when told
    local v; v=$(pyenv versions --bare 2>/dev/null | grep -E "^$want(\.|$)" | sort -V | tail -n 1)
    if [ -n "$v" ]; then echo "$(pyenv root)/versions/$v/bin/python$want"; return 0; fi
  fi
  echo "setup_env.sh: Python $want not found (install it, or put python$want on PATH)" >&2
  return 1
}

pip_install() {  # pip, without the notes some pip configurations print for every package
  "$env_dir/bin/python" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

case $name in
  py311) py=$(find_python 3.11) ;;
  py312) py=$(find_python 3.12) ;;
  *) echo "setup_env.sh: unknown environment '$name' (py311 or py312)" >&2; exit 2 ;;
esac

env_dir=$venvs/$name
stamp=$env_dir/.requirements.sha256
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ ! -x "$env_dir/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "== creating $env_dir with $($py --version) from requirements/$name.txt (first time: minutes)"
  rm -rf "$env_dir"
  mkdir -p "$venvs"
  "$py" -m venv "$env_dir"
  pip_install --upgrade pip setuptools wheel
  pip_install -r "$req"
  echo "$want" > "$stamp"
fi
# py312 only: veRL without its dependencies, the oracle of the parity tests (its pure-Python
# wheel; tests/support/verl_oracle.py loads the three modules it calls)
if [ "$name" = py312 ]; then
  oracle=$(sed -n 's/^verl==//p' "$root/requirements/verl-oracle.txt")
  if [ "$("$env_dir/bin/python" -c 'import importlib.metadata as m; print(m.version("verl"))' 2>/dev/null)" != "$oracle" ]; then
    pip_install --no-deps -r "$root/requirements/verl-oracle.txt"
  fi
fi
# HOOKSPEC_DEPS_ONLY=1: the requirements only (scripts/test.sh builds the two environments
# side by side that way, then installs the project into each, one after another)
if [ "${HOOKSPEC_DEPS_ONLY:-0}" = 1 ]; then echo "== $name requirements ready: $env_dir"; exit 0; fi
pip_install --no-deps --no-build-isolation -e "$root" >/dev/null
echo "== $name ready: $env_dir"

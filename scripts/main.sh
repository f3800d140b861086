#!/usr/bin/env bash
# Set up the main environment (Python 3.12, megatron-core 0.19.2, jax 0.12) and run the
# project's main job: `hookcheck` builds a tiny Megatron GPT on the CPU, runs every
# built-in processor through the output hook and cross-checks values and gradients
# against the float64 JAX reference. Extra arguments go to hookcheck.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venvs=${HOOKSPEC_VENVS:-$root/.venvs}
bash "$root/scripts/setup_env.sh" py312
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
exec "$venvs/py312/bin/hookcheck" "$@"

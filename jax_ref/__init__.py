"""jax_ref: float64 JAX references for the hookspec contract, and the cross-check
that holds a torch processor to them.

- ``jax_ref.references``: the standard quantities (logprob, entropy, KL, PPO,
  GSPO, aggregations) as pure float64 functions.
- ``jax_ref.processors``: references for the built-in processors, functions of
  ``(hidden, weight, ReferenceInputs)``.
- ``jax_ref.sharded``: the same under ``shard_map`` over a device mesh.
- ``jax_ref.head``: a ``flax.nnx`` output head loaded from torch over DLPack.
- ``jax_ref.dlpack``, ``jax_ref.harness``, ``jax_ref.hookcheck``: the torch side
  (these import torch; nothing else in ``jax_ref`` does).

Importing ``jax_ref`` imports nothing heavy (names load on first use) and leaves
``jax_enable_x64`` alone: computations run inside :func:`float64`.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CrossCheckReport",
    "JaxCollectives",
    "ReferenceInputs",
    "Tolerance",
    "cross_check",
    "float64",
    "to_jax",
    "to_torch",
]

_LAZY = {
    "float64": "jax_ref._x64",
    "JaxCollectives": "jax_ref.collectives",
    "ReferenceInputs": "jax_ref.inputs",
    "to_jax": "jax_ref.dlpack",
    "to_torch": "jax_ref.dlpack",
    "CrossCheckReport": "jax_ref.harness",
    "Tolerance": "jax_ref.harness",
    "cross_check": "jax_ref.harness",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jax_ref' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

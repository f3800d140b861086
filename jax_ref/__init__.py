"""jax_ref: float64 JAX references for the hookspec contract.

The reference side imports no torch:

- ``jax_ref.references``: the standard quantities (logprob, entropy, KL, PPO,
  GSPO, aggregations) as pure float64 functions.
- ``jax_ref.processors``: references for the built-in processors, functions of
  ``(hidden, weight, ReferenceInputs)``; ``jax_ref.inputs``: ``ReferenceInputs``.
- ``jax_ref.sharded``: the same under ``shard_map`` over a device mesh, with
  ``jax_ref.collectives`` (``psum``/``pmax``) as the contract's collectives.
- ``float64()``: the scope in which references run.
- ``jax_ref.head``: a ``flax.nnx`` output head (``from_torch`` and
  ``from_megatron`` load one over DLPack, importing torch only when called).

The torch side, which runs a torch processor and holds it to a reference,
lives in ``jax_ref.check`` (DLPack boundary, runs through the hook, cases, the
comparison and its report, the ``hookcheck`` CLI).

Importing ``jax_ref`` imports nothing heavy and leaves ``jax_enable_x64`` alone:
computations run inside :func:`float64`. The names of ``__all__`` and the
submodules load on first use, so after ``import jax_ref`` both
``jax_ref.ReferenceInputs`` and ``jax_ref.processors.token_logprobs_of`` work
(``import jax_ref.processors`` does the same, explicitly); ``jax_ref.check``
imports torch when it is first touched.
"""

from __future__ import annotations

from typing import Any

from hookspec.lazy import LazyNames

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

_LAZY = LazyNames(
    __name__,
    {
        "float64": "jax_ref._x64",
        "JaxCollectives": "jax_ref.collectives",
        "ReferenceInputs": "jax_ref.inputs",
        "to_jax": "jax_ref.check.dlpack",
        "to_torch": "jax_ref.check.dlpack",
        "CrossCheckReport": "jax_ref.check.report",
        "Tolerance": "jax_ref.check.comparison",
        "cross_check": "jax_ref.check.comparison",
    },
    submodules=("check", "collectives", "head", "inputs", "processors", "references", "sharded"),
)


def __getattr__(name: str) -> Any:
    return _LAZY.load(name)


def __dir__() -> list[str]:
    return _LAZY.names()

"""jax_ref.check: hold a torch processor to a float64 JAX reference.

The torch side of ``jax_ref`` (it imports torch; the references do not):

- ``dlpack``: the one boundary, ``to_jax`` / ``to_torch`` over DLPack.
- ``torch_run``: a processor run with its VJPs, on a context or through the
  output hook of an enabled model (``run_on_context``, ``run_through_hook``).
- ``cases`` (synthetic contexts) and ``gpt_cases`` (a tiny Megatron GPT, on
  one process or ``tp`` gloo ranks).
- ``comparison`` (``cross_check``, tolerances) and ``report``
  (``CrossCheckReport``, its tables).
- ``examples`` and ``builtin_processors``: the processors ``hookcheck`` checks.
- ``hookcheck``: the command line.

Names load on first use, so that ``hookcheck`` can set JAX's flags first.
"""

from __future__ import annotations

from typing import Any

from hookspec.lazy import LazyNames

__all__ = [
    "TOLERANCES",
    "CrossCheckReport",
    "Row",
    "Tolerance",
    "TorchRun",
    "build_case_model",
    "case_batch",
    "combine",
    "compare_run",
    "cross_check",
    "cross_check_tensor_parallel",
    "reference_inputs",
    "run_on_context",
    "run_through_hook",
    "synthetic_context",
    "to_jax",
    "to_reference_tree",
    "to_torch",
]

_LAZY = LazyNames(
    __name__,
    {
        "TOLERANCES": ".comparison",
        "Tolerance": ".comparison",
        "compare_run": ".comparison",
        "cross_check": ".comparison",
        "cross_check_tensor_parallel": ".comparison",
        "reference_inputs": ".comparison",
        "to_reference_tree": ".comparison",
        "CrossCheckReport": ".report",
        "Row": ".report",
        "combine": ".report",
        "TorchRun": ".torch_run",
        "run_on_context": ".torch_run",
        "run_through_hook": ".torch_run",
        "synthetic_context": ".cases",
        "build_case_model": ".gpt_cases",
        "case_batch": ".gpt_cases",
        "to_jax": ".dlpack",
        "to_torch": ".dlpack",
    },
)


def __getattr__(name: str) -> Any:
    return _LAZY.load(name)


def __dir__() -> list[str]:
    return _LAZY.names()

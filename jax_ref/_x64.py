"""float64 for the references, in a scope rather than for the whole process.

``jax_enable_x64`` is off by default, and then JAX silently computes a float64
input in float32. Every entry point of ``jax_ref`` that computes (the harness,
``hookcheck``, the sharded reference) enters :func:`float64` for you; to call a
reference by hand, enter it yourself::

    with jax_ref.float64():
        out, vjp = jax.vjp(reference, hidden, weight, inputs)

The scope nests, and restores the previous setting on exit, so importing
``jax_ref`` changes nothing for the rest of a program's JAX code.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from hookspec import ContractError

__all__ = ["as_float64", "computing_in", "float64", "require_float64"]

_COMPUTE_DTYPE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "jax_ref_compute_dtype", default=None
)


@contextlib.contextmanager
def float64() -> Iterator[None]:
    """Run the body with ``jax_enable_x64`` on; restore the previous value after."""
    with jax.enable_x64(True):
        yield


def require_float64(where: str) -> None:
    """A :class:`ContractError` unless float64 is on (inside :func:`float64`)."""
    if not jax.config.jax_enable_x64:
        raise ContractError(
            where,
            expected="float64 enabled (jax_enable_x64)",
            actual="float32 only",
            hint="Call the references inside `with jax_ref.float64():`",
        )


def as_float64(x: Any, /, *, where: str = "jax_ref") -> jax.Array:
    """``jnp.asarray(x, float64)``, refusing to run where float64 is off.

    Inside :func:`computing_in` the references' floating inputs are cast to
    that dtype instead (the harness's plain low-precision baseline).
    """
    dtype = _COMPUTE_DTYPE.get()
    if dtype is not None:
        return jnp.asarray(x, dtype=dtype)
    require_float64(where)
    return jnp.asarray(x, dtype=jnp.float64)


@contextlib.contextmanager
def computing_in(dtype: Any) -> Iterator[None]:
    """Make :func:`as_float64` cast to ``dtype`` (e.g. float32) in the body: the
    references then run as the plain formulas in that precision."""
    token = _COMPUTE_DTYPE.set(dtype)
    try:
        yield
    finally:
        _COMPUTE_DTYPE.reset(token)

"""``hookspec.Collectives`` in JAX, over a named mesh axis inside ``shard_map``.

The contract's semantics map onto JAX's collectives with varying-value checks
on (``shard_map(..., check_vma=True)``, the default):

- ``all_reduce_sum(x)`` is ``lax.psum(x, axis)``. Its transpose is the identity
  broadcast, which is the contract's backward.
- ``all_reduce_max(x)`` is ``lax.pmax(lax.stop_gradient(x), axis)``: no gradient.
- ``gather_hidden_states(x)``: under sequence parallel ``lax.all_gather(x,
  axis, axis=0, tiled=True)`` (backward: reduce-scatter); otherwise
  ``lax.pcast(x, axis, to="varying")`` (forward identity, backward psum), so
  the hidden-state gradient sums every vocab shard's part.
- ``all_gather(x)``: the shards' values stacked on a new leading dim, no
  gradient (a ``lax.psum`` of one slot per shard, invariant over the axis).
- ``all_reduce_sum_context_parallel(x)`` is ``lax.psum(x, cp_axis_name)`` over
  the context-parallel mesh axis (identity without one). Its result is
  invariant along that axis; where each shard's own (varying) terms use it,
  their cotangents are summed over the axis, the contract's backward.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from hookspec import Collectives, ContractError, SingleProcessCollectives

__all__ = ["JaxCollectives", "gather_vocab", "vma_axes"]


def gather_vocab(collectives: Collectives, x: jax.Array) -> jax.Array:
    """``[..., V_local] -> [..., V]``: every vocabulary shard's columns in shard order, no
    gradient (``collectives.all_gather``; ``x`` itself in one process). Collectives without
    ``all_gather`` raise ``ContractError`` naming it."""
    if isinstance(collectives, SingleProcessCollectives):
        return lax.stop_gradient(x)
    fn = getattr(collectives, "all_gather", None)
    if not callable(fn):
        raise ContractError(
            "collectives.all_gather",
            expected="a Collectives with all_gather (spec 1.2)",
            actual=f"{type(collectives).__name__} without all_gather",
        )
    g = fn(lax.stop_gradient(x))  # [tp, ..., V_local]
    return jnp.concatenate([g[i] for i in range(g.shape[0])], axis=-1)


def vma_axes(x: Any) -> frozenset[str]:
    """The mesh axes along which ``x`` varies inside ``shard_map`` (empty outside)."""
    aval = jax.typeof(x) if hasattr(jax, "typeof") else getattr(x, "aval", None)
    return frozenset(getattr(aval, "vma", frozenset()))


class JaxCollectives:
    """The collectives over the mesh axis ``axis_name`` (the vocab-parallel axis)."""

    def __init__(
        self,
        axis_name: str = "tp",
        *,
        sequence_parallel: bool = False,
        cp_axis_name: str | None = None,
    ) -> None:
        self.axis_name = axis_name
        self.sequence_parallel = sequence_parallel
        self.cp_axis_name = cp_axis_name

    def all_reduce_sum(self, x: jax.Array, /) -> jax.Array:
        return lax.psum(x, self.axis_name)

    def all_reduce_max(self, x: jax.Array, /) -> jax.Array:
        return lax.pmax(lax.stop_gradient(x), self.axis_name)

    def gather_hidden_states(self, x: jax.Array, /) -> jax.Array:
        if self.sequence_parallel:
            return lax.all_gather(x, self.axis_name, axis=0, tiled=True)
        if self.axis_name in vma_axes(x):
            return x
        return lax.pcast(x, self.axis_name, to="varying")

    def all_gather(self, x: jax.Array, /) -> jax.Array:
        """``[tp, *x.shape]`` in shard order; no gradient. Each shard writes its slot
        and ``lax.psum`` sums them, so that the result is typed invariant over the
        axis (``lax.all_gather``'s is varying: a top-k of it would not be replicated)."""
        x = lax.stop_gradient(x)
        slots = jnp.zeros((lax.axis_size(self.axis_name), *x.shape), x.dtype)
        return lax.psum(slots.at[lax.axis_index(self.axis_name)].set(x), self.axis_name)

    def all_reduce_sum_context_parallel(self, x: jax.Array, /) -> jax.Array:
        if self.cp_axis_name is None:
            return x
        return lax.psum(x, self.cp_axis_name)

    def rank(self) -> jax.Array:
        """This shard's index along the axis (a traced scalar)."""
        return lax.axis_index(self.axis_name)

    def __repr__(self) -> str:
        cp = f", cp_axis_name={self.cp_axis_name!r}" if self.cp_axis_name is not None else ""
        return (
            f"JaxCollectives(axis_name={self.axis_name!r}, "
            f"sequence_parallel={self.sequence_parallel}{cp})"
        )

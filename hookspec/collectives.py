"""Collectives over the vocab-parallel group, as a framework-neutral protocol.

Each framework implements :class:`Collectives` once (``torch_impl`` over
Megatron's tensor-parallel group, ``jax_ref`` with ``lax.psum``/``lax.pmax``
inside ``shard_map``); processors call it and never name a process group.

The vocab-parallel recipe for a selected-token logprob, written with them::

    h = coll.gather_hidden_states(ctx.hidden_states)     # [s, b, h]
    z = h @ ctx.vocab_weight.T                           # [s, b, V/tp]
    m = coll.all_reduce_max(z.max(-1).detach())          # [s, b]
    lse = m + log(coll.all_reduce_sum(exp(z - m[..., None]).sum(-1)))
    local = (labels >= vocab.start) & (labels < vocab.end)
    z_y = coll.all_reduce_sum(where(local, z[..., labels - vocab.start], 0))
    logprob = z_y - lse                                  # [s, b], same on every rank
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

__all__ = [
    "Collectives",
    "SingleProcessCollectives",
]

A = TypeVar("A")


@runtime_checkable
class Collectives(Protocol):
    """Collectives over the group that shards the vocabulary (tensor parallel).

    Every result is replicated on every rank of the group.
    """

    def all_reduce_sum(self, x: A, /) -> A:
        """``sum_r x_r`` over the ranks. Differentiable: its backward passes the
        gradient through unchanged (the result is replicated, so each rank's loss
        already holds the whole dependence on its own ``x_r``)."""
        ...

    def all_reduce_max(self, x: A, /) -> A:
        """``max_r x_r`` over the ranks, elementwise. Not differentiable: use it
        for the stabilising shift of a logsumexp and detach its input."""
        ...

    def gather_hidden_states(self, x: A, /) -> A:
        """The full local-sequence hidden states ``[s, b, h]`` every vocab shard needs.

        Forward: all-gather along dim 0 under sequence parallelism (input
        ``[s/tp, b, h]``), identity otherwise. Backward: reduce-scatter under
        sequence parallelism, all-reduce (sum) otherwise, so the hidden-state
        gradient holds every vocab shard's contribution, not one rank's part.
        """
        ...


class SingleProcessCollectives:
    """The collectives of a group of one rank: every operation is the identity."""

    def all_reduce_sum(self, x: A, /) -> A:
        return x

    def all_reduce_max(self, x: A, /) -> A:
        return x

    def gather_hidden_states(self, x: A, /) -> A:
        return x

    def __repr__(self) -> str:
        return "SingleProcessCollectives()"

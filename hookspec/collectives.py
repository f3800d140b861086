"""Collectives over the vocab-parallel group, as a framework-neutral protocol.

Each framework implements :class:`Collectives` once (``torch_impl`` over
Megatron's tensor-parallel group, ``jax_ref`` with ``lax.psum``/``lax.pmax``
inside ``shard_map``); processors call it and never name a process group.

The vocab-parallel recipe for a selected-token logprob, written with them.
Logits are ``[b, s, V/tp]`` (the hidden states ``[s, b, h]`` are transposed
by the einsum) so that they line up with the ``[b, s]`` labels; remote and
ignored labels are clamped to a valid row and masked out. It runs as written
with numpy and one rank (a doctest in ``tests/test_hookspec.py``); a processor
does the same with torch and ``ctx.collectives``::

    >>> import numpy as np
    >>> from hookspec import IGNORE_INDEX, SingleProcessCollectives, VocabShard
    >>> coll, vocab = SingleProcessCollectives(), VocabShard(start=0, end=5, size=5)
    >>> rng = np.random.default_rng(0)
    >>> hidden = rng.standard_normal((3, 2, 4))                  # [s, b, h]
    >>> weight = rng.standard_normal((5, 4))                     # [V/tp, h], this rank's rows
    >>> labels = np.array([[0, 4, 2], [1, 3, IGNORE_INDEX]])     # [b, s], global ids
    >>> h = coll.gather_hidden_states(hidden)                    # [s, b, h]
    >>> z = np.einsum("sbh,vh->bsv", h, weight)                  # [b, s, V/tp]
    >>> m = coll.all_reduce_max(z.max(-1))                       # [b, s], detached in autograd
    >>> lse = m + np.log(coll.all_reduce_sum(np.exp(z - m[..., None]).sum(-1)))
    >>> local = (labels >= vocab.start) & (labels < vocab.end)   # [b, s]
    >>> idx = np.where(local, labels - vocab.start, 0)           # clamped to a valid local row
    >>> z_y = coll.all_reduce_sum(np.where(local, np.take_along_axis(z, idx[..., None], -1)[..., 0], 0.0))
    >>> logprob = np.where(labels == IGNORE_INDEX, 0.0, z_y - lse)   # [b, s], same on every rank
    >>> logprob.shape
    (2, 3)
    >>> full = z - np.log(np.exp(z).sum(-1, keepdims=True))      # log_softmax of the whole logits
    >>> want = np.take_along_axis(full, idx[..., None], -1)[..., 0]
    >>> bool(np.allclose(logprob[local], want[local]) and logprob[1, 2] == 0.0)
    True
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

"""Collectives over the vocab-parallel group, as a framework-neutral protocol.

Each framework implements :class:`Collectives` once (``torch_impl`` over
Megatron's tensor-parallel group, ``jax_ref`` with ``lax.psum``/``lax.pmax``
inside ``shard_map``); processors call it and never name a process group. One
method, ``all_reduce_sum_context_parallel`` (spec 1.2), sums over the
context-parallel group instead, for the per-sequence sums of a loss whose
sequences are split over its ranks.

The vocab-parallel recipe for a selected-token logprob, written with them.
Logits are ``[b, s, V_local]``, this rank's ``V_local = V / tp`` columns (the
hidden states ``[s, b, h]`` are transposed by the einsum) so that they line up
with the ``[b, s]`` labels; the input of ``all_reduce_max`` is detached in a
framework with autograd (``z.detach()`` in torch); remote and
ignored labels are clamped to a valid row and masked out. It runs as written
with numpy and one rank (a doctest in ``tests/test_hookspec.py``); a processor
does the same with torch and ``ctx.collectives``::

    >>> import numpy as np
    >>> from hookspec import IGNORE_INDEX, SingleProcessCollectives, VocabShard
    >>> coll, vocab = SingleProcessCollectives(), VocabShard(start=0, end=5, size=5)
    >>> rng = np.random.default_rng(0)
    >>> hidden = rng.standard_normal((3, 2, 4))                  # [s, b, h]
    >>> weight = rng.standard_normal((5, 4))                     # [V_local, h], this rank's rows
    >>> labels = np.array([[0, 4, 2], [1, 3, IGNORE_INDEX]])     # [b, s], global ids
    >>> h = coll.gather_hidden_states(hidden)                    # [s, b, h]
    >>> z = np.einsum("sbh,vh->bsv", h, weight)                  # [b, s, V_local]
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

from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = [
    "REQUIRED_COLLECTIVES",
    "Collectives",
    "SingleProcessCollectives",
]

A = TypeVar("A")


REQUIRED_COLLECTIVES: tuple[str, ...] = ("all_reduce_sum", "all_reduce_max", "gather_hidden_states")
"""The methods of spec 1.0, which every :class:`Collectives` has: ``isinstance(x,
Collectives)`` and ``validate_context`` ask for these only. Methods the protocol gained
later are optional: a collectives object written before them still validates, and a
processor that needs one checks for it where it calls it."""


@runtime_checkable
class Collectives(Protocol):
    """Collectives over the group that shards the vocabulary (tensor parallel).

    Every result is replicated on every rank of the group.

    Methods added in a minor version are optional at run time: an object written
    for an older minor still passes ``isinstance(x, Collectives)`` (which asks for
    the spec-1.0 methods only), and a processor that needs a newer method looks it
    up and raises ``ContractError`` naming it where it is missing.
    """

    @classmethod
    def __subclasshook__(cls, other: type) -> Any:  # True, or NotImplemented: the members decide
        if cls is not Collectives:
            return NotImplemented
        if all(callable(getattr(other, name, None)) for name in REQUIRED_COLLECTIVES):
            return True
        return NotImplemented

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

    def all_reduce_sum_context_parallel(self, x: A, /) -> A:
        """``sum_r x_r`` over the context-parallel group (each rank holds ``1/cp``
        of every sequence): a per-sequence partial sum made whole, say the masked
        token count ``n_k`` or GSPO's ``sum_t M_t (logp_t - old_t)``. Identity
        where the group has one rank.

        Differentiable, and unlike :meth:`all_reduce_sum` its backward *sums* the
        incoming gradient over the group: under context parallel each rank's loss
        is its own share (its tokens' terms, the shares summing to the loss), so
        the result feeds different losses on different ranks, and the gradient of
        ``x_r`` is the sum of what every rank's share asks of the result. (JAX's
        ``lax.psum`` does the same: its result is invariant and its varying uses
        sum their cotangents.)

        .. versionadded:: 1.2
        """
        ...

    def all_gather(self, x: A, /) -> A:
        """``stack([x_0, ..., x_{tp-1}])``: every rank's ``x`` (one shape and dtype on
        every rank) on a new leading dim ``[tp, *x.shape]``, in rank order, which is
        the order of the vocabulary shards. Not differentiable (for selections such
        as the candidates of a vocab-parallel top-k; their values are formed with
        :meth:`all_reduce_sum`). Needed only by processors that merge candidates
        across shards, at ``tp_size > 1``.

        .. versionadded:: 1.2
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

    def all_reduce_sum_context_parallel(self, x: A, /) -> A:
        return x

    def all_gather(self, x: A, /) -> A:
        return x[None]  # type: ignore[index, no-any-return]

    def __repr__(self) -> str:
        return "SingleProcessCollectives()"

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
with numpy and one rank (a doctest in ``tests/contract/test_hookspec.py``); a processor
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
    >>> z_y = coll.all_reduce_sum(
    ...     np.where(local, np.take_along_axis(z, idx[..., None], -1)[..., 0], 0.0)
    ... )
    >>> logprob = np.where(labels == IGNORE_INDEX, 0.0, z_y - lse)   # [b, s], same on every rank
    >>> logprob.shape
    (2, 3)
    >>> full = z - np.log(np.exp(z).sum(-1, keepdims=True))      # log_softmax of the whole logits
    >>> want = np.take_along_axis(full, idx[..., None], -1)[..., 0]
    >>> bool(np.allclose(logprob[local], want[local]) and logprob[1, 2] == 0.0)
    True
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from .arrays import dtype_name, format_shape, framework_of, is_array, shape_of
from .errors import ContractError

__all__ = [
    "OPTIONAL_COLLECTIVES",
    "REQUIRED_COLLECTIVES",
    "CheckedCollectives",
    "Collectives",
    "SingleProcessCollectives",
    "check_collective_result",
    "checked_collectives",
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


OPTIONAL_COLLECTIVES: tuple[str, ...] = ("all_reduce_sum_context_parallel", "all_gather")
"""The methods added in minor versions (spec 1.2): looked up where they are needed."""


class SingleProcessCollectives:
    """The collectives of a group of one rank: every operation is the identity."""

    checked_results: ClassVar[bool] = True
    """Its results follow the contract by construction: :func:`checked_collectives`
    leaves it as it is."""

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


def check_collective_result(
    method: str, x: Any, result: Any, /, *, tp_size: int, sequence_parallel: bool | None
) -> None:
    """``result = collectives.<method>(x)`` has the type, shape and dtype the
    contract declares, or raise ``ContractError("collectives.<method>", ...)``.

    Each result is an array of ``x``'s framework and dtype, of shape::

        all_reduce_sum, all_reduce_max, all_reduce_sum_context_parallel: x.shape
        gather_hidden_states: [s * tp_size, b, h] under sequence parallel, else x.shape
                              (x: [s, b, h])
        all_gather:           [tp_size, *x.shape]

    ``sequence_parallel=None`` (not known to the caller) takes either form of
    ``gather_hidden_states``. Reads metadata only (no device synchronisation).
    An ``x`` that is not an array is not checked.
    """
    if not is_array(x):
        return
    xs, dtype, framework = shape_of(x), dtype_name(x), framework_of(x)
    if method == "all_gather":
        allowed = [(tp_size, *xs)]
        why = f"; the {tp_size} ranks' inputs stacked in rank order"
    elif (
        method == "gather_hidden_states"
        and len(xs) >= 1
        and tp_size > 1
        and sequence_parallel is not False
    ):
        gathered = (xs[0] * tp_size, *xs[1:])
        allowed = [gathered] if sequence_parallel else [xs, gathered]
        why = f"; gathered over the {tp_size} ranks along dim 0 under sequence parallel"
    else:
        allowed = [xs]
        why = ""
    want = " or ".join(format_shape(a) for a in allowed)
    expected = (
        f"a {framework} array of shape {want} and dtype {dtype} "
        f"(its input: {format_shape(xs)}{why})"
    )
    field = f"collectives.{method}"
    if not is_array(result) or framework_of(result) != framework:
        kind = type(result).__name__
        shown = (
            f"{framework_of(result)} {kind} {format_shape(shape_of(result))}"
            if is_array(result)
            else kind
        )
        raise ContractError(field, expected=expected, actual=shown)
    rs = shape_of(result)
    if rs not in allowed:
        raise ContractError(field, expected=expected, actual=f"shape {format_shape(rs)}")
    if dtype_name(result) != dtype:
        raise ContractError(field, expected=expected, actual=f"dtype {dtype_name(result)}")


class CheckedCollectives:
    """``inner``, a :class:`Collectives`, with every result checked by
    :func:`check_collective_result` against a tensor-parallel group of
    ``tp_size`` ranks. Made by :func:`checked_collectives`.

    It has ``inner``'s methods, optional ones included only where ``inner``
    has them, so a processor's look-up of a newer method sees what ``inner``
    offers; other attributes (``size``, ``cp_size``, ``sequence_parallel``) and
    the ``repr`` are ``inner``'s.
    """

    checked_results: ClassVar[bool] = True

    def __init__(self, inner: Any, /, *, tp_size: int, sequence_parallel: bool | None) -> None:
        self.inner = inner
        self.tp_size = tp_size
        self.sequence_parallel_checked = sequence_parallel

    def _call(self, method: str, fn: Any, x: Any) -> Any:
        result = fn(x)
        check_collective_result(
            method,
            x,
            result,
            tp_size=self.tp_size,
            sequence_parallel=self.sequence_parallel_checked,
        )
        return result

    def all_reduce_sum(self, x: A, /) -> A:
        return self._call(  # type: ignore[no-any-return]
            "all_reduce_sum", self.inner.all_reduce_sum, x
        )

    def all_reduce_max(self, x: A, /) -> A:
        return self._call(  # type: ignore[no-any-return]
            "all_reduce_max", self.inner.all_reduce_max, x
        )

    def gather_hidden_states(self, x: A, /) -> A:
        return self._call(  # type: ignore[no-any-return]
            "gather_hidden_states", self.inner.gather_hidden_states, x
        )

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "tp_size", "sequence_parallel_checked"):  # not set yet (copy, pickle)
            raise AttributeError(name)
        value = getattr(self.inner, name)
        if name in OPTIONAL_COLLECTIVES and callable(value):
            return lambda x, /: self._call(name, value, x)
        return value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CheckedCollectives):
            return NotImplemented
        return self.inner is other.inner and (self.tp_size, self.sequence_parallel_checked) == (
            other.tp_size,
            other.sequence_parallel_checked,
        )

    def __hash__(self) -> int:
        return hash((id(self.inner), self.tp_size, self.sequence_parallel_checked))

    def __repr__(self) -> str:
        return repr(self.inner)


def checked_collectives(
    collectives: Any, /, *, tp_size: int, sequence_parallel: bool | None = None
) -> Any:
    """``collectives`` whose every result is checked for type, shape and dtype
    (:func:`check_collective_result`) over a tensor-parallel group of ``tp_size``
    ranks: a custom ``all_gather`` that returns ``x[None]`` while ``tp_size`` is
    2, or a list, raises ``ContractError("collectives.all_gather", ...)`` where
    it returns, not as a wrong answer or an error deep in a processor.

    Returned as it is: ``None``, an object that is not a :class:`Collectives`
    (validation names it), and an implementation whose class says
    ``checked_results = True`` (:class:`SingleProcessCollectives`,
    ``torch_impl.TorchCollectives``, an already checked one rewrapped only where
    ``tp_size`` or ``sequence_parallel`` differ). :class:`OutputContext` holds
    its ``collectives`` so; a function that takes ``collectives`` directly
    calls this where they enter.

    ``sequence_parallel=None`` (not known to the caller) keeps the mode an earlier
    check knew (``collectives`` already checked), else takes the mode the
    collectives declare (a bool ``sequence_parallel`` attribute, as
    ``torch_impl.TorchCollectives`` has), else either form of
    ``gather_hidden_states`` passes.
    """
    if isinstance(collectives, CheckedCollectives):
        if sequence_parallel is None:  # not known here: what the first check knew
            sequence_parallel = collectives.sequence_parallel_checked
        if (collectives.tp_size, collectives.sequence_parallel_checked) == (
            tp_size,
            sequence_parallel,
        ):
            return collectives
        collectives = collectives.inner
    if collectives is None or getattr(type(collectives), "checked_results", False) is True:
        return collectives
    if not isinstance(collectives, Collectives):
        return collectives
    if sequence_parallel is None:  # still unknown: the mode the collectives declare, if a bool
        declared = getattr(collectives, "sequence_parallel", None)
        sequence_parallel = declared if isinstance(declared, bool) else None
    return CheckedCollectives(collectives, tp_size=tp_size, sequence_parallel=sequence_parallel)

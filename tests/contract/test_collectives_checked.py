"""Every collective's result is checked for type, shape and dtype where it returns.

A custom ``Collectives`` whose ``all_gather`` returns ``x[None]`` while its group
has two ranks used to give the top-k wrong ids, values and gradients without a
word; a list, a ``torch.cat`` result or float ids from ``all_gather``, and a
flattened or 0-dim ``all_reduce_sum_context_parallel``, failed deep inside a
processor (``permute(sparse_coo)``, ``too many values to unpack``). Now each
raises ``ContractError("collectives.<method>", ...)`` naming the shape, dtype
and framework the contract declares.

Also here: the constructor arguments of ``TorchCollectives``, ``ParallelLayout``,
``VocabShard`` and ``Processor``; a context-parallel group of collectives that
differs from the layout's; ``TorchCollectives.all_gather`` a copy at one rank as
at many.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

import hookspec
from hookspec import (
    ContractError,
    OutputContext,
    ParallelLayout,
    SingleProcessCollectives,
    VocabShard,
)
from hookspec.collectives import CheckedCollectives, check_collective_result, checked_collectives
from tests.support.identity_collectives import identity_collectives
from torch_impl import TorchCollectives
from torch_impl.processors import PolicyBatch, PolicyLossConfig, policy_loss, topk_logprobs

V, H, B, S = 12, 4, 2, 8
TP = 2


class _Custom(identity_collectives("_Identity")):
    """A user's collectives over ``size`` tensor-parallel and ``cp_size``
    context-parallel ranks; each reduction returns its input (the values are not
    the point here), ``all_gather`` and the context-parallel sum as given."""

    sequence_parallel = False

    def __init__(
        self,
        all_gather: Callable[[torch.Tensor], Any] = lambda x: torch.stack([x, x]),
        cp_sum: Callable[[torch.Tensor], Any] = lambda x: x,
        *,
        size: int = TP,
        cp_size: int = 1,
    ) -> None:
        self._gather, self._cp_sum, self.size, self.cp_size = all_gather, cp_sum, size, cp_size

    def __repr__(self) -> str:
        return f"_Custom(size={self.size}, cp_size={self.cp_size})"

    def all_gather(self, x: Any, /) -> Any:
        return self._gather(x)

    def all_reduce_sum_context_parallel(self, x: Any, /) -> Any:
        return self._cp_sum(x)


def _tp2_context(coll: Any) -> OutputContext:
    g = torch.Generator().manual_seed(0)
    return OutputContext(
        hidden_states=torch.randn(S, B, H, generator=g),
        vocab_weight=torch.randn(V // TP, H, generator=g),
        labels=torch.randint(0, V, (B, S), generator=g),
        vocab=VocabShard(start=0, end=V // TP, size=V),
        parallel=ParallelLayout(tp_size=TP),
        collectives=coll,
    )


WRONG_GATHERS: dict[str, tuple[Callable[[torch.Tensor], Any], str]] = {
    "x[None] at two ranks": (lambda x: x[None], "shape [1, "),
    "torch.cat": (lambda x: torch.cat([x, x]), "shape ["),
    "a list": (lambda x: [x, x], "list"),
    "float ids": (lambda x: torch.stack([x, x]).float(), "dtype float32"),
    "a numpy array": (lambda x: np.stack([x.numpy(), x.numpy()]), "numpy ndarray"),
}


@pytest.mark.parametrize("name", list(WRONG_GATHERS))
def test_a_wrong_all_gather_is_named_in_the_topk_processor(name: str) -> None:
    gather, actual = WRONG_GATHERS[name]
    with pytest.raises(
        ContractError, match=r"collectives\.all_gather: expected a torch array of shape \[2, "
    ) as e:
        topk_logprobs(3)(_tp2_context(_Custom(all_gather=gather)))
    assert e.value.field == "collectives.all_gather"
    assert actual in str(e.value.actual)


def test_a_right_all_gather_passes_the_check() -> None:
    out = topk_logprobs(3)(_tp2_context(_Custom()))
    assert out["topk_ids"].shape == (B, S, 3)


def _cp2_context(coll: Any) -> OutputContext:
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, V, (B, S), generator=g)
    batch = PolicyBatch(
        old_logprobs=-torch.rand(B, S, generator=g) - 1.0,
        advantages=torch.randn(B, S, generator=g),
    )
    return OutputContext(
        hidden_states=torch.randn(S, B, H, generator=g),
        vocab_weight=torch.randn(V, H, generator=g),
        labels=labels,
        vocab=VocabShard(start=0, end=V, size=V),
        parallel=ParallelLayout(cp_size=2),
        collectives=coll,
        context=batch,
    )


WRONG_CP_SUMS: dict[str, Callable[[torch.Tensor], Any]] = {
    "a leading dim added": lambda x: x[None],
    "0-dim": lambda x: x.sum(),
    "flattened": lambda x: x.reshape(-1),
    "a list": lambda x: [x],
    "float16": lambda x: x.half(),
}


@pytest.mark.parametrize("name", list(WRONG_CP_SUMS))
def test_a_wrong_context_parallel_sum_is_named_in_gspo(name: str) -> None:
    coll = _Custom(cp_sum=WRONG_CP_SUMS[name], size=1, cp_size=2)
    config = PolicyLossConfig.gspo(clip_low=0.05, clip_high=0.08)
    with pytest.raises(ContractError) as e:
        policy_loss(config)(_cp2_context(coll))
    assert e.value.field == "collectives.all_reduce_sum_context_parallel"
    assert str(e.value.expected).startswith("a torch array of shape [")


def test_a_right_context_parallel_sum_passes_the_check() -> None:
    config = PolicyLossConfig.gspo(clip_low=0.05, clip_high=0.08)
    out = policy_loss(config)(_cp2_context(_Custom(size=1, cp_size=2)))
    assert out["loss"].shape == ()


# ------------------------------------------------------------------ the wrapper itself

METHODS = (
    "all_reduce_sum",
    "all_reduce_max",
    "gather_hidden_states",
    "all_reduce_sum_context_parallel",
    "all_gather",
)


def _want_shape(method: str, shape: tuple[int, ...], tp: int, sp: bool) -> tuple[int, ...]:
    if method == "all_gather":
        return (tp, *shape)
    if method == "gather_hidden_states" and sp:
        return (shape[0] * tp, *shape[1:])
    return shape


class _Echo:
    """Every method returns what ``make(method, x)`` makes."""

    def __init__(self, make: Callable[[str, Any], Any]) -> None:
        self.make = make

    def all_reduce_sum(self, x: Any, /) -> Any:
        return self.make("all_reduce_sum", x)

    def all_reduce_max(self, x: Any, /) -> Any:
        return self.make("all_reduce_max", x)

    def gather_hidden_states(self, x: Any, /) -> Any:
        return self.make("gather_hidden_states", x)

    def all_reduce_sum_context_parallel(self, x: Any, /) -> Any:
        return self.make("all_reduce_sum_context_parallel", x)

    def all_gather(self, x: Any, /) -> Any:
        return self.make("all_gather", x)


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
@pytest.mark.parametrize("module", [np, torch], ids=["numpy", "torch"])
@pytest.mark.parametrize("method", METHODS)
def test_every_method_right_passes_and_each_wrong_property_is_named(
    method: str, module: Any, sp: bool
) -> None:
    tp = 2
    x = module.zeros((4, 3, 5), dtype=module.float32)

    def right(name: str, v: Any) -> Any:
        return module.zeros(_want_shape(name, tuple(v.shape), tp, sp), dtype=module.float32)

    coll = checked_collectives(_Echo(right), tp_size=tp, sequence_parallel=sp)
    assert isinstance(coll, CheckedCollectives) and isinstance(coll, hookspec.Collectives)
    got = getattr(coll, method)(x)
    assert tuple(got.shape) == _want_shape(method, (4, 3, 5), tp, sp)

    want = _want_shape(method, (4, 3, 5), tp, sp)
    other = np if module is torch else torch
    wrongs: dict[str, Callable[[str, Any], Any]] = {
        "shape": lambda n, v: module.zeros((*want, 1), dtype=module.float32),
        "0-dim": lambda n, v: module.zeros((), dtype=module.float32),
        "dtype": lambda n, v: module.zeros(want, dtype=module.float64),
        "framework": lambda n, v: other.zeros(want, dtype=other.float32),
        "type": lambda n, v: [v],
    }
    for what, make in wrongs.items():
        bad = checked_collectives(_Echo(make), tp_size=tp, sequence_parallel=sp)
        with pytest.raises(ContractError) as e:
            getattr(bad, method)(x)
        assert e.value.field == f"collectives.{method}", what
        framework = "torch" if module is torch else "numpy"
        assert str(e.value.expected).startswith(
            f"a {framework} array of shape [{', '.join(map(str, want))}]"
        )
        assert "dtype float32" in str(e.value.expected), what


def test_gather_hidden_states_of_an_unknown_mode_takes_either_form() -> None:
    x = np.zeros((4, 3, 5), np.float32)
    for rows in (4, 8):
        check_collective_result(
            "gather_hidden_states",
            x,
            np.zeros((rows, 3, 5), np.float32),
            tp_size=2,
            sequence_parallel=None,
        )
    with pytest.raises(ContractError, match=r"shape \[4, 3, 5\] or \[8, 3, 5\]"):
        check_collective_result(
            "gather_hidden_states",
            x,
            np.zeros((12, 3, 5), np.float32),
            tp_size=2,
            sequence_parallel=None,
        )


def test_optional_methods_are_offered_only_where_the_inner_has_them() -> None:
    Spec10 = identity_collectives("Spec10", __repr__=lambda self: "Spec10()")

    coll = checked_collectives(Spec10(), tp_size=2)
    assert isinstance(coll, CheckedCollectives)
    assert getattr(coll, "all_gather", None) is None
    assert getattr(coll, "all_reduce_sum_context_parallel", None) is None
    assert getattr(coll, "size", None) is None
    assert repr(coll) == "Spec10()"


def test_the_shipped_collectives_and_the_checked_ones_are_held_as_given() -> None:
    single = SingleProcessCollectives()
    assert checked_collectives(single, tp_size=1) is single
    torch_coll = TorchCollectives(None, sequence_parallel=False)
    assert checked_collectives(torch_coll, tp_size=1) is torch_coll
    coll = _Custom()
    once = checked_collectives(coll, tp_size=2, sequence_parallel=False)
    assert checked_collectives(once, tp_size=2, sequence_parallel=False) is once
    again = checked_collectives(once, tp_size=4, sequence_parallel=False)
    assert isinstance(again, CheckedCollectives) and again.inner is coll and again.tp_size == 4
    assert checked_collectives(None, tp_size=2) is None


def test_the_context_holds_custom_collectives_checked_and_replace_rewraps() -> None:
    coll = _Custom()
    ctx = _tp2_context(coll)
    assert isinstance(ctx.collectives, CheckedCollectives) and ctx.collectives.inner is coll
    assert ctx.collectives.size == TP and repr(ctx.collectives) == repr(coll)
    assert ctx.collectives == _tp2_context(coll).collectives
    one = ctx.replace(parallel=ParallelLayout(), vocab=VocabShard(0, V, V))
    assert isinstance(one.collectives, CheckedCollectives) and one.collectives.inner is coll
    assert one.collectives.tp_size == 1


# --------------------------------------------------- the context-parallel group's size


@pytest.mark.parametrize("cp", [1, 4])
def test_collectives_over_another_context_parallel_group_are_refused(cp: int) -> None:
    """GSPO with ``parallel.cp_size=1`` and collectives over two CP ranks was
    accepted; so was any size the layout does not hold."""
    coll = _Custom(size=1, cp_size=2)
    ctx = _cp2_context(coll).replace(parallel=ParallelLayout(cp_size=cp))
    with pytest.raises(ContractError) as e:
        hookspec.validate_context(ctx)
    assert e.value.field == "collectives"
    assert f"parallel.cp_size={cp}" in str(e.value.expected)
    assert "over 2 context-parallel ranks" in str(e.value.actual)
    config = PolicyLossConfig.gspo(clip_low=0.05, clip_high=0.08)
    with pytest.raises(ContractError, match="over 2 context-parallel ranks"):
        policy_loss(config)(ctx)


def test_collectives_without_a_context_parallel_group_still_validate_at_cp2() -> None:
    hookspec.validate_context(_cp2_context(_Custom(size=1, cp_size=1)))
    hookspec.validate_context(_cp2_context(_Custom(size=1, cp_size=2)))


# ------------------------------------------------------------- constructor arguments


@pytest.mark.parametrize(
    ("kwargs", "field", "actual"),
    [
        ({"group": "tp", "sequence_parallel": False}, "group", "'tp'"),
        ({"group": 2, "sequence_parallel": False}, "group", "2"),
        ({"group": None, "sequence_parallel": False, "cp_group": 2}, "cp_group", "2"),
        ({"group": None, "sequence_parallel": False, "cp_group": object()}, "cp_group", "object"),
        ({"group": None, "sequence_parallel": "False"}, "sequence_parallel", "'False'"),
        ({"group": None, "sequence_parallel": 0}, "sequence_parallel", "0"),
    ],
)
def test_torch_collectives_names_a_wrong_constructor_argument(
    kwargs: dict[str, Any], field: str, actual: str
) -> None:
    group = kwargs.pop("group")
    with pytest.raises(ContractError) as e:
        TorchCollectives(group, **kwargs)
    assert e.value.field == field
    assert e.value.actual == actual


def test_torch_collectives_all_gather_at_one_rank_is_a_copy() -> None:
    x = torch.arange(6.0).view(2, 3).requires_grad_()
    got = TorchCollectives(None, sequence_parallel=False).all_gather(x)
    assert got.shape == (1, 2, 3) and not got.requires_grad
    assert got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    with torch.no_grad():
        x.add_(1.0)
    assert torch.equal(got[0], torch.arange(6.0).view(2, 3))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sequence_parallel": "False"}, "parallel.sequence_parallel"),
        ({"sequence_parallel": 1}, "parallel.sequence_parallel"),
        ({"tp_size": True}, "parallel.tp_size"),
        ({"tp_size": 2.0}, "parallel.tp_size"),
        ({"cp_rank": False}, "parallel.cp_rank"),
        ({"pp_size": "2"}, "parallel.pp_size"),
    ],
)
def test_parallel_layout_names_a_wrong_constructor_argument(
    kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ContractError) as e:
        ParallelLayout(**kwargs)
    assert e.value.field == field


def test_parallel_layout_and_vocab_shard_take_numpy_ints_as_ints() -> None:
    layout = ParallelLayout(tp_size=np.int64(2), tp_rank=np.int32(1))
    assert (layout.tp_size, layout.tp_rank) == (2, 1) and type(layout.tp_size) is int
    vocab = VocabShard(np.int64(4), np.int64(8), np.int64(8))
    assert (vocab.start, vocab.end, vocab.size) == (4, 8, 8) and type(vocab.start) is int


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((0.0, 4, 8), "vocab.start"),
        ((0, "4", 8), "vocab.end"),
        ((0, 4, True), "vocab.size"),
        ((0, 4, Fraction(8)), "vocab.size"),
    ],
)
def test_vocab_shard_names_a_wrong_constructor_argument(args: tuple[Any, ...], field: str) -> None:
    with pytest.raises(ContractError) as e:
        VocabShard(*args)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"fn": 3, "name": "p"}, "processor"), ({"fn": lambda ctx: ctx, "name": 3}, "processor name")],
)
def test_processor_names_a_wrong_constructor_argument(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ContractError) as e:
        hookspec.Processor(**kwargs)
    assert e.value.field == field


def test_a_wrong_all_gather_is_named_in_the_tensor_function() -> None:
    from torch_impl.processors import LinearOptions, linear_topk_logprobs

    ctx = _tp2_context(_Custom(all_gather=lambda x: x[None]))
    hidden = ctx.hidden_states.reshape(-1, H)  # type: ignore[union-attr]
    try:
        linear_topk_logprobs(
            hidden,
            ctx.vocab_weight,  # type: ignore[arg-type]
            k=3,
            options=LinearOptions(
                vocab=ctx.vocab, collectives=_Custom(all_gather=lambda x: x[None])
            ),
        )
    except ContractError as e:
        assert e.field == "collectives.all_gather"
    else:
        raise AssertionError("x[None] from all_gather at two ranks was taken")


# Two ranks' collectives whose ``gather_hidden_states`` forgets to gather under sequence
# parallel (returns this rank's ``[s/tp, ...]`` rows); says nothing of its mode.
_Ungathered = identity_collectives("_Ungathered", all_gather=lambda self, x: torch.stack([x, x]))


def test_a_second_check_keeps_the_sequence_parallel_mode_the_first_knew() -> None:
    """Found by the contract fuzzer: a tensor function checks the context's (already
    checked) collectives again with ``tp_size`` only; the rewrap forgot
    ``sequence_parallel=True`` and took an ungathered result as either form, so a
    processor failed later naming ``labels``."""
    once = checked_collectives(_Ungathered(), tp_size=TP, sequence_parallel=True)
    again = checked_collectives(once, tp_size=TP)
    assert again is once
    with pytest.raises(ContractError) as e:
        again.gather_hidden_states(torch.zeros(3, H))
    assert e.value.field == "collectives.gather_hidden_states" and "[6, 4]" in str(e.value.expected)
    g = torch.Generator().manual_seed(0)
    ctx = OutputContext(
        hidden_states=torch.randn(S // TP, B, H, generator=g),
        vocab_weight=torch.randn(V // TP, H, generator=g),
        labels=torch.randint(0, V, (B, S), generator=g),
        vocab=VocabShard(start=0, end=V // TP, size=V),
        parallel=ParallelLayout(tp_size=TP, sequence_parallel=True),
        collectives=_Ungathered(),
    )
    with pytest.raises(ContractError) as e:
        topk_logprobs(3)(ctx)
    assert e.value.field == "collectives.gather_hidden_states"


def test_a_check_of_collectives_alone_takes_the_mode_they_declare() -> None:
    """Where the caller does not know the mode (a tensor function's ``LinearOptions``),
    the collectives' own ``sequence_parallel`` (a bool, as ``TorchCollectives`` has)
    decides the form of ``gather_hidden_states``."""

    class Declared(_Ungathered):
        sequence_parallel = True

    with pytest.raises(ContractError, match=r"collectives\.gather_hidden_states"):
        checked_collectives(Declared(), tp_size=TP).gather_hidden_states(torch.zeros(3, H))
    checked_collectives(_Ungathered(), tp_size=TP).gather_hidden_states(
        torch.zeros(3, H)
    )  # either form

"""Every pairing of parallel layout, vocabulary shard and collectives in
``hookspec.validate_context``; every field of a processor's and an MTP
processor's result by dtype and shape; every integer of the context against int64.

A pairing that cannot give the right answer (a vocabulary sharded over two ranks
with reductions over one) is refused by name; every pairing that can passes.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

import hookspec
from hookspec import (
    ContractError,
    OutputContext,
    ParallelLayout,
    SingleProcessCollectives,
    VocabShard,
)
from tests.support.identity_collectives import identity_collectives

V, H, B, S = 16, 4, 2, 8


# A user's collectives written against the three methods of spec 1.0 (no ``size``, no
# later optional methods): it must keep validating.
_Group = identity_collectives("_Group")


class _Sized(_Group):
    """Collectives that say their group size and sequence-parallel mode, as
    ``torch_impl.TorchCollectives`` does."""

    def __init__(self, size: int, sequence_parallel: bool = False) -> None:
        self.size, self.sequence_parallel = size, sequence_parallel

    def __repr__(self) -> str:
        return f"_Sized(size={self.size}, sequence_parallel={self.sequence_parallel})"


class _NoMax:
    def all_reduce_sum(self, x: Any, /) -> Any:
        return x

    def gather_hidden_states(self, x: Any, /) -> Any:
        return x


def _ctx(
    tp: int, rank: int, vocab: VocabShard | None, collectives: Any, sp: bool = False
) -> OutputContext:
    rows = vocab.local_size if vocab is not None else V
    s_h = S // tp if sp else S
    return OutputContext(
        hidden_states=np.zeros((s_h, B, H), np.float32),
        labels=np.zeros((B, S), np.int64),
        vocab_weight=np.zeros((rows, H), np.float32),
        parallel=ParallelLayout(tp_size=tp, tp_rank=rank, sequence_parallel=sp),
        vocab=vocab,
        collectives=collectives,
    )


def _shard(tp: int, rank: int) -> VocabShard:
    local = V // tp
    return VocabShard(rank * local, (rank + 1) * local, V)


def test_the_reported_defect_tp2_with_single_process_collectives_is_refused() -> None:
    """``ParallelLayout(tp_size=2)`` with the default collectives used to pass."""
    ctx = OutputContext(
        hidden_states=np.zeros((S, B, H), np.float32),
        labels=np.zeros((B, S), np.int64),
        vocab_weight=np.zeros((V // 2, H), np.float32),
        parallel=ParallelLayout(tp_size=2),
        vocab=VocabShard(0, V // 2, V),
    )
    with pytest.raises(ContractError) as info:
        hookspec.validate_context(ctx)
    assert info.value.field == "collectives"
    assert "2 ranks" in str(info.value.expected)
    assert "SingleProcessCollectives" in str(info.value.actual)


def _expected_refusal(
    tp: int, rank: int, vocab: VocabShard | None, coll: Any, sp: bool
) -> tuple[str, str] | None:
    """The independent statement of the rule: ``(field, a phrase of the expected)``
    for the first broken pairing, else None."""
    if vocab is None:
        if tp > 1:
            return "vocab", "VocabShard"
    else:
        if vocab.local_size * tp != vocab.size:
            return "vocab", "tp_size"
        if vocab.start != rank * vocab.local_size:
            return "vocab", "tp_rank"
    if isinstance(coll, _NoMax):
        return "collectives", "all_reduce_max"
    if tp > 1 and isinstance(coll, SingleProcessCollectives):
        return "collectives", f"{tp} ranks"
    if isinstance(coll, _Sized):
        if coll.size != tp:
            return "collectives", f"tp_size={tp}"
        if tp > 1 and coll.sequence_parallel != sp:
            return "collectives", "sequence_parallel"
    return None


_COLLECTIVES = {
    "single": lambda tp, sp: SingleProcessCollectives(),
    "user-1.0": lambda tp, sp: _Group(),
    "sized-right": lambda tp, sp: _Sized(tp, sp),
    "sized-1": lambda tp, sp: _Sized(1, sp),
    "sized-4": lambda tp, sp: _Sized(4, sp),
    "sized-other-sp": lambda tp, sp: _Sized(tp, not sp),
    "no-max": lambda tp, sp: _NoMax(),
}
_VOCABS = {
    "none": lambda tp, rank: None,
    "right": _shard,
    "whole": lambda tp, rank: VocabShard(0, V, V),
    "half-at-0": lambda tp, rank: VocabShard(0, V // 2, V),
    "half-at-8": lambda tp, rank: VocabShard(V // 2, V, V),
    "quarter-at-4": lambda tp, rank: VocabShard(V // 4, V // 2, V),
}
_LAYOUTS = [(1, 0, False), (2, 0, False), (2, 1, False), (2, 1, True), (4, 3, False)]


@pytest.mark.parametrize(
    ("layout", "vocab_kind", "coll_kind"),
    list(itertools.product(_LAYOUTS, _VOCABS, _COLLECTIVES)),
    ids=lambda x: str(x),
)
def test_every_pairing_of_layout_shard_and_collectives(
    layout: tuple[int, int, bool], vocab_kind: str, coll_kind: str
) -> None:
    tp, rank, sp = layout
    vocab = _VOCABS[vocab_kind](tp, rank)
    coll = _COLLECTIVES[coll_kind](tp, sp)
    want = _expected_refusal(tp, rank, vocab, coll, sp)
    ctx = _ctx(tp, rank, vocab, coll, sp)
    if want is None:
        hookspec.validate_context(ctx)
        hookspec.validate_collectives(ctx)
        return
    with pytest.raises(ContractError) as info:
        hookspec.validate_context(ctx)
    assert info.value.field == want[0], info.value
    assert want[1] in str(info.value.expected), info.value


def test_a_sweep_pairing_that_is_right_on_every_rank_passes_on_every_rank() -> None:
    for tp in (1, 2, 4):
        for rank in range(tp):
            hookspec.validate_context(_ctx(tp, rank, _shard(tp, rank), _Sized(tp)))
            hookspec.validate_context(_ctx(tp, rank, _shard(tp, rank), _Group()))


def test_layout_and_vocab_of_the_wrong_type_are_named() -> None:
    ctx = _ctx(1, 0, _shard(1, 0), _Group())
    with pytest.raises(ContractError) as info:
        hookspec.validate_context(ctx.replace(parallel={"tp_size": 1}))
    assert info.value.field == "parallel"
    with pytest.raises(ContractError) as info:
        hookspec.validate_context(ctx.replace(vocab=(0, V, V)))
    assert info.value.field == "vocab"
    with pytest.raises(ContractError) as info:
        hookspec.validate_context("not a context")  # type: ignore[arg-type]
    assert info.value.field == "ctx"


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**70, 1.5, "-100", True, None])
def test_ignore_index_of_the_context_is_an_int64(value: Any) -> None:
    ctx = _ctx(1, 0, _shard(1, 0), _Group())
    with pytest.raises(ContractError) as info:
        hookspec.validate_context(ctx.replace(ignore_index=value))
    assert info.value.field == "ignore_index" and "int" in str(info.value.expected)


@pytest.mark.parametrize("value", [True, 1.0, -1, 2**63])
def test_mtp_depth_of_the_context_is_an_int_at_least_0(value: Any) -> None:
    ctx = _ctx(1, 0, _shard(1, 0), _Group())
    with pytest.raises(ContractError) as info:
        hookspec.validate_context(ctx.replace(mtp_depth=value))
    assert info.value.field == "mtp_depth"


@pytest.mark.parametrize("field", ["tp_size", "cp_size", "pp_size"])
def test_parallel_sizes_beyond_int64_are_named(field: str) -> None:
    layout = ParallelLayout(**{field: 2**70})
    ctx = _ctx(1, 0, _shard(1, 0), _Group()).replace(parallel=layout)
    with pytest.raises(ContractError) as info:
        hookspec.validate_context(ctx)
    assert info.value.field == f"parallel.{field}"


def test_check_int64_bounds() -> None:
    assert hookspec.check_int64("n", 2**63 - 1) == 2**63 - 1
    assert hookspec.check_int64("n", -(2**63)) == -(2**63)
    assert hookspec.check_int64("n", np.int64(-100)) == -100
    for bad in (2**63, -(2**63) - 1, 2**70, 1.0, np.float64(3), True, "3"):
        with pytest.raises(ContractError) as info:
            hookspec.check_int64("n", bad)
        assert info.value.field == "n" and "2**63 - 1" in str(info.value.expected)
    with pytest.raises(ContractError, match=r"in \[1, 2\*\*63 - 1\]"):
        hookspec.check_int64("chunk", 0, low=1)


# ---------------------------------------------------------------------------
# Results: every field by dtype and shape
# ---------------------------------------------------------------------------

_DTYPES_OK_MAIN = [np.float32, np.float64, np.float16, np.int64, np.int32, bool]
_DTYPES_BAD = [np.complex64, object, "U3"]


@pytest.mark.parametrize("dtype", _DTYPES_OK_MAIN)
@pytest.mark.parametrize("shape", [(B, S), ()])
def test_main_result_dtypes_and_shapes_that_pass(dtype: Any, shape: tuple[int, ...]) -> None:
    value = np.zeros(shape, dtype)
    hookspec.validate_result(value, batch=B, seq=S)
    hookspec.validate_result({"x": value}, batch=B, seq=S)


@pytest.mark.parametrize("dtype", _DTYPES_BAD)
def test_main_result_of_a_non_numeric_dtype_is_refused(dtype: Any) -> None:
    for result, field in (
        (np.zeros((B, S), dtype), "processor result"),
        ({"x": np.zeros((B, S), dtype)}, "processor result['x']"),
    ):
        with pytest.raises(ContractError) as info:
            hookspec.validate_result(result, batch=B, seq=S)
        assert info.value.field == field and "dtype" in str(info.value.expected)


@pytest.mark.parametrize("shape", [(B,), (S,), (S, B), (1, B, S), (B, S - 1), (S, B, 3)])
def test_main_result_of_another_shape_is_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(ContractError) as info:
        hookspec.validate_result(np.zeros(shape, np.float32), batch=B, seq=S)
    assert info.value.field == "processor result" and str(list(shape)).replace(" ", "") in str(
        info.value.actual
    ).replace(" ", "")


def test_mtp_accepted_must_be_bool_the_reported_defect() -> None:
    """A float ``accepted`` used to pass; MTP logging then counted every token."""
    loss = np.zeros((B, S), np.float32)
    with pytest.raises(ContractError) as info:
        hookspec.validate_mtp_result(
            {"loss": loss, "accepted": np.ones((B, S), np.float32)}, batch=B, seq=S
        )
    assert info.value.field == "mtp_processor result['accepted']"
    assert "bool" in str(info.value.expected) and info.value.actual == "float32"


_MTP_LOSS_DTYPES = {
    np.float16: True,
    np.float32: True,
    np.float64: True,
    np.int64: False,
    bool: False,
}
_MTP_ACCEPTED_DTYPES = {
    bool: True,
    np.float32: False,
    np.float64: False,
    np.int64: False,
    np.uint8: False,
}
_MTP_SHAPES = {(B, S): True, (): False, (B,): False, (S, B): False, (B, S, 1): False}


@pytest.mark.parametrize(
    ("loss_dtype", "loss_shape", "acc_dtype", "acc_shape"),
    [
        (ld, ls, ad, as_)
        for ld in _MTP_LOSS_DTYPES
        for ls in _MTP_SHAPES
        for ad in [None, *_MTP_ACCEPTED_DTYPES]
        for as_ in _MTP_SHAPES
        if (ad is None and as_ == (B, S)) or ad is not None
    ],
)
def test_every_field_of_the_mtp_result_by_dtype_and_shape(
    loss_dtype: Any, loss_shape: tuple[int, ...], acc_dtype: Any, acc_shape: tuple[int, ...]
) -> None:
    loss = np.zeros(loss_shape, loss_dtype)
    result: Any = (
        loss if acc_dtype is None else {"loss": loss, "accepted": np.zeros(acc_shape, acc_dtype)}
    )
    # the rule, stated independently: shapes first (loss, then accepted), then dtypes
    if not _MTP_SHAPES[loss_shape]:
        want = ("loss", "shape")
    elif acc_dtype is not None and not _MTP_SHAPES[acc_shape]:
        want = ("accepted", "shape")
    elif not _MTP_LOSS_DTYPES[loss_dtype]:
        want = ("loss", "floating")
    elif acc_dtype is not None and not _MTP_ACCEPTED_DTYPES[acc_dtype]:
        want = ("accepted", "bool")
    else:
        got = hookspec.validate_mtp_result(result, batch=B, seq=S)
        assert got[0] is loss and (got[1] is None) == (acc_dtype is None)
        return
    with pytest.raises(ContractError) as info:
        hookspec.validate_mtp_result(result, batch=B, seq=S)
    assert info.value.field == f"mtp_processor result[{want[0]!r}]"
    assert want[1] in str(info.value.expected), info.value

"""Validation at the contract boundary: one check each, one error type.

Every check raises :class:`~hookspec.ContractError` naming the field, the
expected and the actual shape, dtype or range. Value checks (label range) read
the array's contents, which costs one device synchronisation; the shape checks
read metadata only.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from .arrays import dtype_name, format_shape, is_array, is_floating, is_integer, shape_of
from .collectives import REQUIRED_COLLECTIVES, SingleProcessCollectives
from .context import OutputContext, ParallelLayout, VocabShard
from .errors import ContractError

__all__ = [
    "IGNORE_INDEX_OF_A_CONTEXT",
    "INT64_MAX",
    "INT64_MIN",
    "REQUIRED_COLLECTIVES",
    "check_int64",
    "check_labels",
    "labels_expected",
    "validate_collectives",
    "validate_context",
    "validate_mtp_result",
    "validate_result",
]

INT64_MIN: int = -(2**63)
INT64_MAX: int = 2**63 - 1
"""The range of an integer option: every one ends up in an int64 tensor or kernel argument."""


def check_int64(field: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int``: an integer (Python or NumPy, not ``bool``) in
    ``[low, high]`` and always within int64 (``[INT64_MIN, INT64_MAX]``), where
    every integer option of the contract ends up. Raises ``ContractError(field, ...)``::

        check_int64("ignore_index", -100)          # -100
        check_int64("chunk_size", 2**70, low=1)    # ContractError: ... in [1, 2**63 - 1]
    """
    lo = INT64_MIN if low is None else max(low, INT64_MIN)
    hi = INT64_MAX if high is None else min(high, INT64_MAX)

    def bound(x: int) -> str:
        return {INT64_MIN: "-2**63", INT64_MAX: "2**63 - 1"}.get(x, str(x))

    expected = f"an int in [{bound(lo)}, {bound(hi)}]" + (
        " (int64)" if low is None or high is None else ""
    )
    if isinstance(value, bool) or not _is_integral(value):
        shown = (
            repr(value)
            if isinstance(value, (str, int, float)) or value is None
            else type(value).__name__
        )
        raise ContractError(field, expected=expected, actual=shown)
    n = int(value)
    if not lo <= n <= hi:
        raise ContractError(field, expected=expected, actual=repr(n))
    return n


def _is_integral(value: Any) -> bool:
    return isinstance(value, numbers.Integral)


def _check_array(field: str, x: object) -> None:
    if not is_array(x):
        raise ContractError(
            field, expected="an array with shape and dtype", actual=type(x).__name__
        )


IGNORE_INDEX_OF_A_CONTEXT = (
    "the ignore index of a context: enable_output_processor(model, ignore_index=), "
    "or OutputContext(ignore_index=) built by hand"
)
"""Where a context's ``ignore_index`` is set, which a label error names (labels padded
with another value than the ignore index are refused as out of range)."""


def labels_expected(vocab_size: int, ignore_index: int, set_by: str) -> str:
    """The ``expected`` of a label error: the range, the ignore index and where it is set."""
    return f"token ids in [0, {vocab_size}) or ignore_index={ignore_index} ({set_by})"


def check_labels(
    labels: Any,
    vocab_size: int,
    *,
    ignore_index: int,
    field: str = "labels",
    set_by: str = IGNORE_INDEX_OF_A_CONTEXT,
) -> None:
    """Labels must be integers in ``[0, vocab_size)`` or equal to ``ignore_index``
    (``set_by``: where the caller sets it, named in the error).

    Reads the values (one synchronisation on an accelerator).
    """
    _check_array(field, labels)
    if not is_integer(labels):
        raise ContractError(field, expected="an integer dtype", actual=dtype_name(labels))
    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
    if bool(bad.any()):
        flat = labels[bad]
        lo, hi = int(flat.min()), int(flat.max())
        raise ContractError(
            field,
            expected=labels_expected(vocab_size, ignore_index, set_by),
            actual=f"{int(bad.sum())} ids outside it, in [{lo}, {hi}]",
        )


def validate_collectives(ctx: OutputContext) -> None:
    """The layout, the vocabulary shard and the collectives of ``ctx`` agree.

    - ``parallel`` is a :class:`ParallelLayout`, ``vocab`` a :class:`VocabShard`
      or ``None`` (then one rank: ``parallel.tp_size == 1``);
    - ``vocab``: ``(end - start) * tp_size == size`` and ``start == tp_rank *
      (end - start)`` (Megatron's ``VocabUtility`` split);
    - ``collectives`` has the :data:`REQUIRED_COLLECTIVES` methods; with
      ``tp_size > 1`` it is not :class:`SingleProcessCollectives` (whose
      reductions are identities: each rank would normalise over its own shard);
      where it says its group ``size`` (an int attribute, as
      ``torch_impl.TorchCollectives`` does) that is ``tp_size``, where it
      says ``sequence_parallel`` (a bool) that is ``parallel.sequence_parallel``,
      and where it says ``cp_size`` (an int) that is ``parallel.cp_size`` or 1
      (collectives without a context-parallel group, which a loss that needs
      its sum refuses by name).
    """
    layout = ctx.parallel
    if not isinstance(layout, ParallelLayout):
        raise ContractError(
            "parallel", expected="a hookspec.ParallelLayout", actual=type(layout).__name__
        )
    for group in ("tp", "cp", "pp"):
        check_int64(f"parallel.{group}_size", getattr(layout, f"{group}_size"), low=1)
        check_int64(f"parallel.{group}_rank", getattr(layout, f"{group}_rank"), low=0)
    vocab = ctx.vocab
    tp = layout.tp_size
    if vocab is not None and not isinstance(vocab, VocabShard):
        raise ContractError(
            "vocab", expected="a hookspec.VocabShard or None", actual=type(vocab).__name__
        )
    if vocab is None and tp > 1:
        raise ContractError(
            "vocab",
            expected=f"this rank's VocabShard (parallel.tp_size={tp}: the vocabulary is sharded)",
            actual="None (the whole vocab_weight taken as the vocabulary)",
        )
    if vocab is not None:
        for name in ("start", "end", "size"):
            check_int64(f"vocab.{name}", getattr(vocab, name), low=0)
        if vocab.local_size * tp != vocab.size:
            raise ContractError(
                "vocab",
                expected=f"(end - start) * tp_size == size with tp_size={tp}",
                actual=f"start={vocab.start}, end={vocab.end}, size={vocab.size}",
            )
        if vocab.start != layout.tp_rank * vocab.local_size:
            raise ContractError(
                "vocab",
                expected=f"start == tp_rank * (end - start) = {layout.tp_rank * vocab.local_size} "
                f"(tp_rank={layout.tp_rank} of {tp})",
                actual=f"start={vocab.start}, end={vocab.end}, size={vocab.size}",
            )
    coll = ctx.collectives
    missing = [name for name in REQUIRED_COLLECTIVES if not callable(getattr(coll, name, None))]
    if missing:
        raise ContractError(
            "collectives",
            expected=f"a hookspec.Collectives with {', '.join(REQUIRED_COLLECTIVES)}",
            actual=f"{type(coll).__name__} without {', '.join(missing)}",
        )
    if tp > 1 and isinstance(coll, SingleProcessCollectives):
        raise ContractError(
            "collectives",
            expected=(
                f"collectives over the {tp} ranks of the tensor-parallel group "
                f"(parallel.tp_size={tp})"
            ),
            actual="SingleProcessCollectives() (one rank: no reduction over the vocabulary shards)",
            hint=(
                "pass the group's collectives "
                "(torch_impl.TorchCollectives, jax_ref's JaxCollectives)"
            ),
        )
    size = getattr(coll, "size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size != tp:
        raise ContractError(
            "collectives",
            expected=f"a group of parallel.tp_size={tp} ranks",
            actual=f"{coll!r} over {size} ranks",
        )
    cp_size = getattr(coll, "cp_size", None)
    if (
        isinstance(cp_size, int)
        and not isinstance(cp_size, bool)
        and cp_size not in (1, layout.cp_size)
    ):
        raise ContractError(
            "collectives",
            expected=(
                f"a context-parallel group of parallel.cp_size={layout.cp_size} ranks (or none)"
            ),
            actual=f"{coll!r} over {cp_size} context-parallel ranks",
        )
    sp = getattr(coll, "sequence_parallel", None)
    if isinstance(sp, bool) and tp > 1 and sp != layout.sequence_parallel:
        raise ContractError(
            "collectives",
            expected=f"sequence_parallel={layout.sequence_parallel}, as parallel.sequence_parallel",
            actual=f"{coll!r}",
        )


def _batch_first(hs: tuple[int, ...], actual: tuple[int, ...], name: str, sp: int) -> None:
    """``hidden_states`` ``hs`` read as ``[b, s, h]`` against ``name`` ``[b, s]``: refused by
    their name and layout (not as ``name`` of the wrong shape)."""
    s_local = f"s={actual[1]}" if sp == 1 else f"s/tp={actual[1] // sp}"
    raise ContractError(
        "hidden_states",
        expected=f"the sequence-first layout [s, b, h] (Megatron's): [{s_local}, b={actual[0]}, "
        f"h={hs[2]}] for {name} [b={actual[0]}, s={actual[1]}]",
        actual=f"{format_shape(hs)}, batch-first [b, s, h]",
        hint="transpose them: hidden_states.transpose(0, 1)",
    )


def validate_context(ctx: OutputContext, *, check_values: bool = True) -> None:
    """Check the shapes of ``ctx`` against each other, the layout, vocabulary
    shard and collectives against each other (:func:`validate_collectives`),
    and the label range.

    ``hidden_states`` ``[s_h, b, h]`` with ``s_h * (tp if sequence_parallel else
    1) == s``; ``labels``, ``loss_mask`` and ``padding_mask`` ``[b, s]``;
    ``vocab_weight`` ``[vocab.end - vocab.start, h]``; ``hidden_states`` and
    ``vocab_weight`` of a floating dtype.
    """
    if not isinstance(ctx, OutputContext):
        raise ContractError("ctx", expected="a hookspec.OutputContext", actual=type(ctx).__name__)
    validate_collectives(ctx)
    _check_array("hidden_states", ctx.hidden_states)
    hs = shape_of(ctx.hidden_states)
    if len(hs) != 3:
        raise ContractError("hidden_states", expected="3 dims [s, b, h]", actual=format_shape(hs))
    if not is_floating(ctx.hidden_states):
        raise ContractError(
            "hidden_states", expected="a floating dtype", actual=dtype_name(ctx.hidden_states)
        )
    sp = ctx.parallel.tp_size if ctx.parallel.sequence_parallel else 1
    s_full, b, h = hs[0] * sp, hs[1], hs[2]
    sp_note = (
        f" (hidden_states {format_shape(hs)} x tp={sp} under sequence parallel)" if sp > 1 else ""
    )
    for name in ("labels", "loss_mask", "padding_mask"):
        value = getattr(ctx, name)
        if value is None:
            continue
        _check_array(name, value)
        actual = shape_of(value)
        if actual == (hs[0], hs[1] * sp) and actual != (b, s_full):
            _batch_first(hs, actual, name, sp)
        if actual != (b, s_full):
            raise ContractError(
                name,
                expected=f"shape [b={b}, s={s_full}]{sp_note}",
                actual=format_shape(actual),
            )
    if ctx.vocab_weight is not None:
        _check_array("vocab_weight", ctx.vocab_weight)
        if not is_floating(ctx.vocab_weight):
            raise ContractError(
                "vocab_weight", expected="a floating dtype", actual=dtype_name(ctx.vocab_weight)
            )
        ws = shape_of(ctx.vocab_weight)
        rows = ctx.vocab.local_size if ctx.vocab is not None else ws[0]
        if ws != (rows, h):
            raise ContractError(
                "vocab_weight", expected=f"shape [V_local={rows}, h={h}]", actual=format_shape(ws)
            )
    check_int64("mtp_depth", ctx.mtp_depth, low=0)
    check_int64("ignore_index", ctx.ignore_index)
    for flag in ("check_values", "labels_checked"):
        if not isinstance(getattr(ctx, flag), bool):
            raise ContractError(flag, expected="a bool", actual=repr(getattr(ctx, flag)))
    if check_values and ctx.labels is not None and ctx.vocab is not None:
        check_labels(ctx.labels, ctx.vocab.size, ignore_index=ctx.ignore_index)


def _check_result_array(field: str, value: object, batch: int, seq: int) -> None:
    if not is_array(value):
        raise ContractError(
            field,
            expected=f"an array of shape [b={batch}, s={seq}] or a scalar loss",
            actual=f"{type(value).__name__}",
        )
    shape = shape_of(value)  # type: ignore[arg-type]
    if shape != () and tuple(shape[:2]) != (
        batch,
        seq,
    ):  # [b, s, ...]: per token (top-k: [b, s, k])
        raise ContractError(
            field,
            expected=f"shape [b={batch}, s={seq}] or [b, s, ...] (per token) or [] (a loss)",
            actual=format_shape(shape),
        )
    if not (
        is_floating(value)  # type: ignore[arg-type]
        or is_integer(value)  # type: ignore[arg-type]
        or dtype_name(value) == "bool"  # type: ignore[arg-type]
    ):
        raise ContractError(
            field,
            expected="a floating, integer or bool dtype",
            actual=dtype_name(value),  # type: ignore[arg-type]
        )


def validate_result(
    result: object, *, batch: int, seq: int, field: str = "processor result"
) -> None:
    """A processor returns per-token values ``[b, s]`` (or ``[b, s, ...]``, such as
    top-k logprobs ``[b, s, k]``), a scalar loss ``[]``, or a non-empty mapping
    from ``str`` to either."""
    if isinstance(result, Mapping):
        if not result:
            raise ContractError(
                field, expected="a non-empty mapping of arrays", actual="an empty mapping"
            )
        for key, value in result.items():
            if not isinstance(key, str):
                raise ContractError(field, expected="str keys", actual=f"key {key!r}")
            _check_result_array(f"{field}[{key!r}]", value, batch, seq)
        return
    _check_result_array(field, result, batch, seq)


def validate_mtp_result(
    result: object,
    *,
    batch: int,
    seq: int,
    field: str = "mtp_processor result",
    array_kind: str = "an array",
) -> tuple[Any, Any]:
    """An MTP processor's result: the per-token loss ``[b, s]`` before masking,
    or a mapping ``{"loss": [b, s], "accepted": [b, s] bool}`` (``accepted``
    optional: whether the head's top-1 token equals the label, for acceptance
    logging). The loss has a floating dtype; any other key is refused.

    Returns ``(loss, accepted or None)``. ``array_kind`` names the array type
    the implementation expects in messages (``"a torch.Tensor"``).
    """
    accepted: object = None
    if isinstance(result, Mapping):
        keys = sorted(str(k) for k in result)
        if "loss" not in result or not set(keys) <= {"loss", "accepted"}:
            # an unknown key (a misspelt 'accepted') is refused, not dropped
            raise ContractError(
                field,
                expected="a mapping with a 'loss' [b, s] and optionally 'accepted'",
                actual=f"keys {keys}",
            )
        loss, accepted = result["loss"], result.get("accepted")
    else:
        loss = result
    for name, value in (("loss", loss), ("accepted", accepted)):
        if value is None and name == "accepted":
            continue
        if not is_array(value):
            raise ContractError(
                f"{field}[{name!r}]", expected=f"{array_kind} [b, s]", actual=type(value).__name__
            )
        if shape_of(value) != (batch, seq):  # type: ignore[arg-type]
            raise ContractError(
                f"{field}[{name!r}]",
                expected=f"per-token shape [b={batch}, s={seq}]",
                actual=format_shape(shape_of(value)),  # type: ignore[arg-type]
            )
    if not is_floating(loss):  # type: ignore[arg-type]
        raise ContractError(
            f"{field}['loss']", expected="a floating dtype", actual=dtype_name(loss)
        )  # type: ignore[arg-type]
    if accepted is not None and dtype_name(accepted) != "bool":  # type: ignore[arg-type]
        # a float or int 'accepted' would count every nonzero entry as an accepted token
        raise ContractError(
            f"{field}['accepted']",
            expected="a bool dtype [b, s] (whether the head's top-1 token equals the label)",
            actual=dtype_name(accepted),  # type: ignore[arg-type]
        )
    return loss, accepted

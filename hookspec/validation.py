"""Validation at the contract boundary: one check each, one error type.

Every check raises :class:`~hookspec.ContractError` naming the field, the
expected and the actual shape, dtype or range. Value checks (label range) read
the array's contents, which costs one device synchronisation; the shape checks
read metadata only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .arrays import dtype_name, format_shape, is_array, is_floating, is_integer, shape_of
from .context import OutputContext
from .errors import ContractError

__all__ = [
    "check_labels",
    "validate_context",
    "validate_mtp_result",
    "validate_result",
]


def _check_array(field: str, x: object) -> None:
    if not is_array(x):
        raise ContractError(field, expected="an array with shape and dtype", actual=type(x).__name__)


def check_labels(labels: Any, vocab_size: int, *, ignore_index: int, field: str = "labels") -> None:
    """Labels must be integers in ``[0, vocab_size)`` or equal to ``ignore_index``.

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
            expected=f"token ids in [0, {vocab_size}) or ignore_index={ignore_index}",
            actual=f"{int(bad.sum())} ids outside it, in [{lo}, {hi}]",
        )


def validate_context(ctx: OutputContext, *, check_values: bool = True) -> None:
    """Check the shapes of ``ctx`` against each other, and the label range.

    ``hidden_states`` ``[s_h, b, h]`` with ``s_h * (tp if sequence_parallel else
    1) == s``; ``labels``, ``loss_mask`` and ``padding_mask`` ``[b, s]``;
    ``vocab_weight`` ``[vocab.end - vocab.start, h]``.
    """
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
    sp_note = f" (hidden_states {format_shape(hs)} x tp={sp} under sequence parallel)" if sp > 1 else ""
    for name in ("labels", "loss_mask", "padding_mask"):
        value = getattr(ctx, name)
        if value is None:
            continue
        _check_array(name, value)
        actual = shape_of(value)
        if actual != (b, s_full):
            raise ContractError(
                name,
                expected=f"shape [b={b}, s={s_full}]{sp_note}",
                actual=format_shape(actual),
            )
    if ctx.vocab_weight is not None:
        _check_array("vocab_weight", ctx.vocab_weight)
        ws = shape_of(ctx.vocab_weight)
        rows = ctx.vocab.local_size if ctx.vocab is not None else ws[0]
        if ws != (rows, h):
            raise ContractError(
                "vocab_weight", expected=f"shape [V/tp={rows}, h={h}]", actual=format_shape(ws)
            )
    if ctx.vocab is not None and ctx.vocab.local_size * ctx.parallel.tp_size != ctx.vocab.size:
        raise ContractError(
            "vocab",
            expected=f"(end - start) * tp_size == size with tp_size={ctx.parallel.tp_size}",
            actual=f"start={ctx.vocab.start}, end={ctx.vocab.end}, size={ctx.vocab.size}",
        )
    if not (isinstance(ctx.mtp_depth, int) and ctx.mtp_depth >= 0):
        raise ContractError("mtp_depth", expected="an int >= 0", actual=repr(ctx.mtp_depth))
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
    if shape not in ((), (batch, seq)):
        raise ContractError(
            field,
            expected=f"shape [b={batch}, s={seq}] (per token) or [] (a loss)",
            actual=format_shape(shape),
        )


def validate_result(result: object, *, batch: int, seq: int, field: str = "processor result") -> None:
    """A processor returns per-token values ``[b, s]``, a scalar loss ``[]``, or a
    non-empty mapping from ``str`` to either."""
    if isinstance(result, Mapping):
        if not result:
            raise ContractError(field, expected="a non-empty mapping of arrays", actual="an empty mapping")
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
        raise ContractError(f"{field}['loss']", expected="a floating dtype", actual=dtype_name(loss))  # type: ignore[arg-type]
    return loss, accepted

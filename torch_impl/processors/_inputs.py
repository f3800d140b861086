"""What every processor reads from the hook's :class:`~hookspec.OutputContext`,
checked: the hidden rows, the vocab shard, the labels in row order, the
temperature, and the layout helpers between ``[b, s]`` and the rows.

Layout (Megatron's): ``ctx.hidden_states`` ``[s, b, h]`` (``[s/tp, b, h]`` under
sequence parallel), ``ctx.labels`` and every per-token input ``[b, s]``, every
per-token output ``[b, s]``. Inside, tokens are the rows of
``hidden_states.reshape(-1, h)``, i.e. ``s``-major.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import torch

from hookspec import ContractError, OutputContext, validate_context
from hookspec.arrays import format_shape

from ..value_checks import check_labels_deferred
from ._checks import (
    check_floating,
    check_int,
    check_temperature,
    context_field,
    context_logit_scale,
    resolve_vocab_chunk,
)

__all__ = [
    "HookInputs",
    "Tile",
    "from_tokens",
    "hook_inputs",
    "logit_scale",
    "resolve_temperature",
    "tile_options",
    "to_tokens",
]


def to_tokens(x: torch.Tensor) -> torch.Tensor:
    """``[b, s] -> [n]`` in the hidden states' row order (``s``-major)."""
    return x.transpose(0, 1).reshape(-1)


def from_tokens(v: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """``[n] -> [b, s]``, the inverse of :func:`to_tokens`."""
    return v.view(s, b).transpose(0, 1).contiguous()


@dataclasses.dataclass(frozen=True)
class HookInputs:
    """The hook's tensors as ``linear_logprobs`` takes them; ``kwargs`` its
    vocab-shard keywords."""

    hidden: torch.Tensor  # [n_local, h]
    weight: torch.Tensor  # [V_local, h]
    labels: torch.Tensor  # [n] global ids
    b: int
    s: int
    kwargs: dict[str, Any]  # vocab_start, vocab_size, collectives, ignore_index, logit_scale, check_values


def logit_scale(ctx: OutputContext, processor: str = "built-in") -> float:
    """The factor the model's ``scale_logits`` applies (MuP's output multiplier):
    a finite number > 0; a model option that changes the logits otherwise is
    refused by name (:func:`~torch_impl.processors._checks.context_logit_scale`)."""
    return context_logit_scale(ctx, processor=processor)


@dataclasses.dataclass(frozen=True)
class Tile:
    """The tile of ``linear_logprobs``'s torch path: vocab entries by tokens;
    ``None``: the default per device."""

    vocab_chunk_size: int | None = None
    token_chunk_size: int | None = None


def tile_options(
    *, vocab_chunk_size: Any, token_chunk_size: Any, chunk_size: Any, stacklevel: int = 3
) -> Tile:
    """A processor factory's tile options, checked where they enter: each
    ``None`` (the default per device) or an int >= 1. ``chunk_size`` is the
    deprecated name of ``vocab_chunk_size`` (one release: ``DeprecationWarning``;
    both given raises)."""
    if chunk_size is not None:
        vocab_chunk_size = check_int(
            "chunk_size", resolve_vocab_chunk(vocab_chunk_size, chunk_size, stacklevel=stacklevel), low=1
        )
    return Tile(
        vocab_chunk_size=None
        if vocab_chunk_size is None
        else check_int("vocab_chunk_size", vocab_chunk_size, low=1),
        token_chunk_size=None
        if token_chunk_size is None
        else check_int("token_chunk_size", token_chunk_size, low=1),
    )


def hook_inputs(ctx: OutputContext, name: str) -> HookInputs:
    """Check what processor ``name`` reads from ``ctx`` (shapes and types, no
    values: ``hookspec.validate_context(check_values=False)``, as the hook does
    before a call, so that a direct call is checked too) and return it as rows."""
    if not isinstance(ctx, OutputContext):
        raise ContractError(
            f"processor {name!r}", expected="a hookspec.OutputContext", actual=type(ctx).__name__
        )
    if ctx.labels is None:
        raise ContractError(
            "labels", expected=f"token ids [b, s] (processor {name!r} needs them)", actual="None"
        )
    if ctx.vocab_weight is None or ctx.vocab is None:
        raise ContractError("vocab_weight", expected="the output weight shard [V_local, h]", actual="None")
    hs = check_floating("hidden_states", ctx.hidden_states)
    # A direct call (not through the hook) gets the hook's shape checks too, and the
    # label range where the hook has not checked it (a hand-built context).
    validate_context(ctx, check_values=False)
    if isinstance(ctx.ignore_index, bool) or not isinstance(ctx.ignore_index, int):
        raise ContractError("ignore_index", expected="an int", actual=repr(ctx.ignore_index))
    if ctx.check_values and not ctx.labels_checked:
        check_labels_deferred(ctx.labels, ctx.vocab.size, ignore_index=ctx.ignore_index)
    b, s = int(ctx.labels.shape[0]), int(ctx.labels.shape[1])
    return HookInputs(
        hidden=hs.reshape(-1, hs.shape[-1]),
        weight=typing.cast(torch.Tensor, ctx.vocab_weight),
        labels=to_tokens(typing.cast(torch.Tensor, ctx.labels)),
        b=b,
        s=s,
        kwargs=dict(
            ignore_index=ctx.ignore_index,
            vocab_start=ctx.vocab.start,
            vocab_size=ctx.vocab.size,
            collectives=ctx.collectives,
            logit_scale=logit_scale(ctx, name),
            # each value is checked once: the labels above or in the hook, a
            # temperature by resolve_temperature
            check_values=False,
        ),
    )


def resolve_temperature(given: float | None, ctx: OutputContext, b: int, s: int) -> float | torch.Tensor:
    """The processor's ``temperature``, else the user context's ``temperature``
    (a number or ``[b, s]``; a mapping's key or an object's attribute), else 1.
    A ``[b, s]`` tensor's values are checked here when ``ctx.check_values``."""
    from_context = context_field(ctx.context, "temperature")
    if given is not None and from_context is not None:
        raise ContractError(
            "temperature",
            expected="one source: the processor's temperature= or the context's .temperature",
            actual=f"both ({given!r} and a {type(from_context).__name__})",
        )
    if from_context is None:
        return 1.0 if given is None else given
    if isinstance(from_context, torch.Tensor) and from_context.dim() > 0:
        if tuple(from_context.shape) != (b, s):
            raise ContractError(
                "context.temperature",
                expected=f"a number or shape [b={b}, s={s}]",
                actual=format_shape(from_context.shape),
            )
        return check_temperature(
            to_tokens(from_context), b * s, field="context.temperature", check_values=ctx.check_values
        )
    return check_temperature(from_context, b * s, field="context.temperature")

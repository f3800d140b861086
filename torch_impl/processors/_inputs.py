"""What every processor reads from the hook's :class:`~hookspec.OutputContext`,
checked, and the layout helpers between ``[b, s]`` and the rows: tokens are the rows
of ``hidden_states.reshape(-1, h)`` (``[s, b, h]``), ``s``-major (``docs/processors.md``).

The public part (``torch_impl.processors``): :func:`context_rows`, :func:`to_rows`,
:func:`from_rows` and :func:`context_options`, the same readings the built-in processors
make, for a processor of one's own (``docs/writing-processors.md``).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, NamedTuple

import torch

from hookspec import ContractError, OutputContext, validate_context
from hookspec.arrays import format_shape

from ..value_checks import (
    check_finite_deferred,
    check_labels_deferred,
    check_multiple_deferred,
    refuse_meta,
)
from ._checks import (
    check_floating,
    check_instance,
    check_shape,
    check_temperature,
    context_field,
    context_logit_scale,
    context_softcap,
)
from ._options import Backend, LinearOptions, refuse_function_transforms, refuse_unexpected

__all__ = [
    "ContextRows",
    "HookInputs",
    "context_options",
    "context_rows",
    "counted_mask",
    "factory_tiles",
    "from_rows",
    "from_tokens",
    "hook_inputs",
    "resolve_temperature",
    "sequence_ids",
    "to_rows",
    "to_tokens",
]


def to_tokens(x: torch.Tensor) -> torch.Tensor:
    """``[b, s, ...] -> [n, ...]`` in the hidden states' row order (``s``-major)."""
    return x.transpose(0, 1).reshape(-1, *x.shape[2:])


def from_tokens(v: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """``[n, ...] -> [b, s, ...]``, the inverse of :func:`to_tokens`."""
    return v.view(s, b, *v.shape[1:]).transpose(0, 1).contiguous()


@dataclasses.dataclass(frozen=True)
class HookInputs:
    """The hook's tensors as the tensor functions take them, and their options."""

    hidden: torch.Tensor  # [n_local, h]
    weight: torch.Tensor  # [V_local, h]
    labels: torch.Tensor | None  # [n] global ids
    b: int
    s: int
    options: LinearOptions  # vocab, collectives, ignore_index, logit_scale; values checked here

    @property
    def acc_dtype(self) -> torch.dtype:
        """The dtype of per-token weights and masks: float64 where an input is, else float32."""
        return (
            torch.float64
            if torch.float64 in (self.hidden.dtype, self.weight.dtype)
            else torch.float32
        )

    @property
    def token_labels(self) -> torch.Tensor:
        """The labels ``[n]``, for a processor that required them."""
        assert self.labels is not None, "hook_inputs(needs_labels=True) checked them"
        return self.labels

    def tensor_options(
        self, tiles: LinearOptions, temperature: float | torch.Tensor = 1.0
    ) -> LinearOptions:
        """:attr:`options` with the processor's temperature and its factory's
        ``tile_rows``, ``tile_cols``, ``compute_dtype`` and ``backend`` (``tiles``)."""
        return dataclasses.replace(
            self.options,
            temperature=temperature,
            tile_rows=tiles.tile_rows,
            tile_cols=tiles.tile_cols,
            compute_dtype=tiles.compute_dtype,
            backend=tiles.backend,
        )

    def per_token(self, **out: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """A processor's result: the rows ``[n, ...]`` as ``[b, s, ...]``, ``None`` left out."""
        return {key: from_tokens(v, self.b, self.s) for key, v in out.items() if v is not None}


def factory_tiles(
    name: str,
    unexpected: dict[str, Any],
    temperature: float | None,
    rows: int | None,
    cols: int | None,
) -> LinearOptions:
    """A processor factory's first lines: refuse its ``unexpected`` keywords, check a
    given ``temperature``, and return its tiles (:meth:`HookInputs.tensor_options`)."""
    refuse_unexpected(name, unexpected)
    if temperature is not None:
        check_temperature(temperature, 1)
    return LinearOptions(tile_rows=rows, tile_cols=cols)


def counted_mask(ctx: OutputContext, inputs: HookInputs, given: Any, field: str) -> torch.Tensor:
    """The mask ``M`` ``[b, s]`` of the tokens a loss counts: ``given`` (``None``: every
    token), 0 where the label is the ignore index. Its values are checked finite and
    ``>= 0`` when ``ctx.check_values``; an entry that is not becomes NaN, so the loss
    shows it."""
    device, dtype = inputs.hidden.device, inputs.acc_dtype
    if given is None:
        mask = torch.ones(inputs.b, inputs.s, dtype=dtype, device=device)
    else:
        check_shape(field, given, (inputs.b, inputs.s), f"[b={inputs.b}, s={inputs.s}] like labels")
        if ctx.check_values:
            check_finite_deferred(given, field=field, nonnegative=True)
        mask = given.detach().to(device=device, dtype=dtype)
        mask = torch.where(torch.isfinite(mask) & (mask >= 0), mask, float("nan"))
    if ctx.labels is not None:
        labels = typing.cast(torch.Tensor, ctx.labels).to(device)
        mask = torch.where(labels == ctx.ignore_index, mask * 0.0, mask)
    return mask


def hook_inputs(ctx: OutputContext, name: str, *, needs_labels: bool = True) -> HookInputs:
    """The one prologue of every processor: check what processor ``name`` reads from
    ``ctx`` (``hookspec.validate_context(check_values=False)``, so that a direct call
    is checked too; the labels' range where the hook has not) and return it as rows."""
    check_instance(f"processor {name!r}", ctx, OutputContext, "a hookspec.OutputContext")
    if ctx.labels is None and needs_labels:
        raise ContractError(
            "labels", expected=f"token ids [b, s] (processor {name!r} needs them)", actual="None"
        )
    if ctx.vocab_weight is None:
        raise ContractError(
            "vocab_weight", expected="the output weight shard [V_local, h]", actual="None"
        )
    if ctx.vocab is None:
        raise ContractError(
            "vocab", expected="the weight's VocabShard (start, end, size)", actual="None"
        )
    hs = check_floating("hidden_states", ctx.hidden_states)
    refuse_function_transforms(hidden_states=hs, vocab_weight=ctx.vocab_weight, labels=ctx.labels)
    validate_context(ctx, check_values=False)
    # a tensor on the meta device (the context's fields, the user context's entries)
    # is refused by name before torch fails deep inside
    user = ctx.context
    if dataclasses.is_dataclass(user) and not isinstance(user, type):
        user = {f.name: getattr(user, f.name) for f in dataclasses.fields(user)}
    named = (
        [(f"context.{k}", v) for k, v in user.items()] if isinstance(user, typing.Mapping) else []
    )
    for field, value in named + [(f.name, getattr(ctx, f.name)) for f in dataclasses.fields(ctx)]:
        refuse_meta(value, field=field)
    if ctx.labels is not None and ctx.check_values and not ctx.labels_checked:
        check_labels_deferred(ctx.labels, ctx.vocab.size, ignore_index=ctx.ignore_index)
    # labels [b, s] where given (validate_context checked them against the hidden states)
    b, s = _batch_seq(ctx, hs)
    return HookInputs(
        hidden=hs.reshape(-1, hs.shape[-1]),
        weight=typing.cast(torch.Tensor, ctx.vocab_weight),
        labels=None if ctx.labels is None else to_tokens(typing.cast(torch.Tensor, ctx.labels)),
        b=b,
        s=s,
        options=LinearOptions(
            ignore_index=ctx.ignore_index,
            vocab=ctx.vocab,
            collectives=ctx.collectives,
            logit_scale=context_logit_scale(
                ctx, processor=name
            ),  # MuP's factor, or refused by name
            softcap=context_softcap(ctx),
            # checked once: the labels above or in the hook, a temperature on resolving
            check_values=False,
        ),
    )


def _batch_seq(ctx: OutputContext, hs: torch.Tensor) -> tuple[int, int]:
    """``(b, s)`` of hidden states ``hs`` ``[s, b, h]`` (``[s/tp, b, h]`` under sequence
    parallel, whose rows the tensor functions gather)."""
    s = int(hs.shape[0]) * (ctx.parallel.tp_size if ctx.parallel.sequence_parallel else 1)
    return int(hs.shape[1]), s


class ContextRows(NamedTuple):
    """The hook's tensors as the tensor functions take them, in their order
    (``linear_logprobs(*rows, options=...)``, ``fused_token_loss(*rows, loss, ...)``)::

        hidden = hidden_states.reshape(-1, h)   # [n_local, h]: [s, b, h] rows, s-major
        weight = vocab_weight                   # [V_local, h]: ids [vocab.start, vocab.end)
        labels = to_rows(labels)                # [n] global ids (ignore_index: no label)

    Row ``i * b + j`` is token ``(j, i)`` (batch ``j``, position ``i``); ``n = b * s`` rows
    once gathered (under sequence parallel ``hidden`` holds this rank's ``s/tp`` positions,
    which the tensor functions gather). ``labels`` is ``None`` where the context has none.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor | None


def context_rows(ctx: OutputContext) -> ContextRows:
    """The hidden rows, the weight shard and the label rows of ``ctx`` (:class:`ContextRows`),
    checked as a built-in processor checks them (``hookspec.validate_context``, the labels'
    range where ``ctx.check_values`` and the hook has not): a ``hookspec.ContractError``
    names the field (``vocab_weight``, ``vocab``, ``hidden_states``, ``labels``...)."""
    check_instance("ctx", ctx, OutputContext, "a hookspec.OutputContext")
    inputs = hook_inputs(ctx, "context_rows", needs_labels=False)
    return ContextRows(inputs.hidden, inputs.weight, inputs.labels)


def context_options(
    ctx: OutputContext,
    /,
    *,
    temperature: float | None = None,
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    backend: Backend = "auto",
    compute_dtype: torch.dtype | None = None,
) -> LinearOptions:
    """The options a built-in processor passes its tensor function for the hook's context
    ``ctx``, for the rows of :func:`context_rows`::

        vocab, collectives = ctx.vocab, ctx.collectives  # this rank's shard, its group
        ignore_index = ctx.ignore_index
        logit_scale = c        # ctx.scale_logits is z -> c * z (MuP's output multiplier)
        softcap = ctx.config.final_logit_softcapping     # None where unset
        temperature = T        # temperature=, else ctx.context's "temperature"
                               # ([b, s] -> [n] rows, or a number), else 1; both: refused
        check_values = False   # checked here instead, where ctx.check_values: the
                               # labels' range (unless the hook did) and T > 0

    so that ``z = hidden @ weight_full.T * logit_scale / T`` is the model's logits tempered,
    and ``linear_logprobs(*context_rows(ctx), options=context_options(ctx))`` equals
    ``selected_logprobs()`` in the rows' order.

    Args:
        ctx: the hook's ``hookspec.OutputContext``.
        temperature: the sampling temperature, where the user context holds none.
        tile_rows, tile_cols, backend, compute_dtype: as :class:`LinearOptions`' fields.

    Returns:
        The :class:`LinearOptions`. A field of ``ctx`` that is missing or wrong
        (``vocab_weight``, ``vocab``, ``hidden_states``, ``context.temperature``, a
        ``scale_logits`` that is not ``z -> c * z``...) raises ``hookspec.ContractError``
        naming it.
    """
    check_instance("ctx", ctx, OutputContext, "a hookspec.OutputContext")
    if temperature is not None:
        check_temperature(temperature, 1)
    tiles = LinearOptions(
        tile_rows=tile_rows, tile_cols=tile_cols, backend=backend, compute_dtype=compute_dtype
    )
    inputs = hook_inputs(ctx, "context_options", needs_labels=False)
    return inputs.tensor_options(tiles, resolve_temperature(temperature, ctx, inputs.b, inputs.s))


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """``[b, s, ...] -> [b * s, ...]`` in the rows' order (``s``-major: row ``i * b + j`` is
    ``x[j, i]``), for a per-token input (a mask, a weight, a temperature) of the rows of
    :func:`context_rows`; :func:`from_rows` is its inverse."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ContractError(
            "x", expected="a torch.Tensor [b, s, ...] (at least 2 dims)", actual=_described(x)
        )
    return to_tokens(x)


def from_rows(values: torch.Tensor, ctx: OutputContext) -> torch.Tensor:
    """``[n, ...] -> [b, s, ...]``: a tensor function's result on the rows of
    :func:`context_rows` as the processor's per-token output (``out[j, i] = values[i * b +
    j]``; ``n = b * s``, ``b`` and ``s`` of ``ctx``, ``s`` gathered under sequence
    parallel); differentiable, contiguous."""
    check_instance("ctx", ctx, OutputContext, "a hookspec.OutputContext")
    b, s = _batch_seq(ctx, check_floating("hidden_states", ctx.hidden_states))
    if not isinstance(values, torch.Tensor) or values.dim() < 1 or values.shape[0] != b * s:
        raise ContractError(
            "values",
            expected=f"a torch.Tensor [n={b * s}, ...] (one per row: b={b} x s={s})",
            actual=_described(values),
        )
    return from_tokens(values, b, s)


def _described(x: Any) -> str:
    return format_shape(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def sequence_ids(
    ctx: OutputContext, b: int, s: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """``(segments [b, s], count)``: each token's sequence. A row per sequence, or,
    for packed (THD) input, the sequences of ``packed_seq_params``
    (``cu_seqlens_q_padded``, else ``cu_seqlens_q``); tokens past the last boundary
    form one more segment. Under context parallel each rank holds chunks ``r`` and
    ``2 cp - 1 - r`` of every sequence (Megatron's split): its boundaries are
    ``cu / cp``, every ``cu`` a multiple of ``2 cp`` (checked with ``check_values``)."""
    psp = ctx.packed_seq_params
    if psp is None:
        return torch.arange(b, device=device)[:, None].expand(b, s), b
    name = (
        "cu_seqlens_q"
        if getattr(psp, "cu_seqlens_q_padded", None) is None
        else "cu_seqlens_q_padded"
    )
    cu = getattr(psp, name, None)
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or b != 1:
        raise ContractError(
            "packed_seq_params",
            expected="cu_seqlens_q (a 1-D tensor) with batch 1 (THD)",
            actual=f"batch {b}, cu_seqlens {cu}",
        )
    cp = ctx.parallel.cp_size
    if cp > 1 and ctx.check_values:
        check_multiple_deferred(
            cu,
            2 * cp,
            field=f"packed_seq_params.{name}",
            why=f" (2 * cp_size: each sequence is split into 2 * {cp} equal chunks; pad it, "
            "as cu_seqlens_q_padded does)",
        )
    bounds = (cu.to(device=device, dtype=torch.long) // cp)[1:]
    seg = torch.bucketize(torch.arange(s, device=device), bounds, right=True)
    return seg[None, :], int(bounds.numel()) + 1


def resolve_temperature(
    given: float | None, ctx: OutputContext, b: int, s: int
) -> float | torch.Tensor:
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
        check_shape("context.temperature", from_context, (b, s), f"[b={b}, s={s}] (or a number)")
        return check_temperature(
            to_tokens(from_context),
            b * s,
            field="context.temperature",
            check_values=ctx.check_values,
        )
    return check_temperature(from_context, b * s, field="context.temperature")

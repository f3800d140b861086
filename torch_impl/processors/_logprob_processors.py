"""The logprob processors: selected-token logprobs (and entropy) and Megatron's
cross entropy (per token, or reduced through :func:`fused_token_loss`), each
computed from the hidden states and the vocab shard (layout: :mod:`._inputs`).
The policy loss is in :mod:`._policy`.
"""

from __future__ import annotations

import typing
from typing import Any, Literal, Never

import torch

from hookspec import Aggregation, ContractError, OutputContext, Processor, processor
from hookspec.arrays import format_shape

from ..value_checks import check_finite_deferred, checked_call
from ._checks import check_bool, check_finite_number, check_temperature, context_field
from ._fused import fused_token_loss
from ._inputs import (
    HookInputs,
    counted_mask,
    from_tokens,
    hook_inputs,
    resolve_temperature,
    to_tokens,
)
from ._logprobs import linear_logprobs
from ._loss_math import weights_of
from ._options import LinearOptions, refuse_unexpected

Reduction = Literal["none", "sum", "mean"]
REDUCTIONS: tuple[Reduction, ...] = ("none", "sum", "mean")

__all__ = [
    "cross_entropy_loss",
    "selected_logprobs",
]


def selected_logprobs(
    *,
    temperature: float | None = None,
    entropy: bool = False,
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    **unexpected: Never,
) -> Processor:
    """A processor returning ``{"logprobs": [b, s], "entropy": [b, s]}`` (fp32)::

        z = hidden_states @ vocab_weight.T / T          # never materialised
        logprobs = log_softmax(z)[labels]               # 0 where labels == ignore_index
        entropy = logsumexp(z) - sum(softmax(z) * z)    # only with entropy=True

    ``T``: ``temperature`` if given, else the user context's ``temperature``
    when it has one that is not ``None`` (a number or ``[b, s]`` per token; the
    key of a mapping such as veRL's, or the attribute of an object such as
    :class:`PolicyBatch`), else 1. Both given is an error. Tiles of ``tile_rows``
    x ``tile_cols`` (:class:`LinearOptions`' names; ``None``: the default per device).
    """
    refuse_unexpected("selected_logprobs", unexpected)
    if temperature is not None:
        check_temperature(temperature, 1)
    check_bool("entropy", entropy)
    tile = LinearOptions(tile_rows=tile_rows, tile_cols=tile_cols)

    @checked_call()
    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        x = hook_inputs(ctx, "selected_logprobs")
        res = linear_logprobs(
            x.hidden,
            x.weight,
            x.token_labels,
            options=x.tensor_options(tile, resolve_temperature(temperature, ctx, x.b, x.s)),
            with_entropy=entropy,
        )
        out = {"logprobs": from_tokens(res.logprobs, x.b, x.s)}
        if res.entropy is not None:
            out["entropy"] = from_tokens(res.entropy, x.b, x.s)
        return out

    return processor(fn, name="selected_logprobs")


def _check_reduction(value: Any) -> Reduction:
    if not isinstance(value, str) or value not in REDUCTIONS:
        raise ContractError("reduction", expected=f"one of {list(REDUCTIONS)}", actual=repr(value))
    return typing.cast(Reduction, value)


def _global_tokens(ctx: OutputContext, reduction: Reduction) -> float | None:
    """The user context's ``global_tokens``: a finite number > 0 read by ``"mean"``
    only (refused, not ignored, with ``"sum"``)."""
    value = context_field(ctx.context, "global_tokens")
    if value is None:
        return None
    if reduction != "mean":
        raise ContractError(
            "context.global_tokens",
            expected=f"None with reduction={reduction!r}, which divides by no count",
            actual=repr(value),
        )
    return check_finite_number("context.global_tokens", value, low=0.0, low_open=True)


def _class_weights_of(ctx: OutputContext, x: HookInputs, class_weights: torch.Tensor) -> torch.Tensor:
    """``cw[labels]`` ``[n]`` (acc dtype, rows' order; 0 where the label is ignored), the
    weights checked ``[V]`` here and finite and ``>= 0`` (deferred on a GPU) when
    ``ctx.check_values``."""
    size = ctx.vocab.size if ctx.vocab is not None else 0
    if tuple(class_weights.shape) != (size,):
        raise ContractError(
            "class_weights",
            expected=f"a tensor [V={size}] (the whole vocabulary)",
            actual=format_shape(class_weights.shape),
        )
    if ctx.check_values:
        check_finite_deferred(class_weights, field="class_weights", nonnegative=True)
    cw = class_weights.detach().to(device=x.hidden.device, dtype=x.acc_dtype)
    cw = torch.where(torch.isfinite(cw) & (cw >= 0), cw, float("nan"))
    y = x.token_labels
    ignored = y == ctx.ignore_index
    return torch.where(ignored, 0.0, cw[torch.where(ignored, 0, y).clamp(0, max(size - 1, 0))])


def _smoothing_of(
    ctx: OutputContext, x: HookInputs, class_weights: torch.Tensor | None
) -> tuple[torch.Tensor | None, float | torch.Tensor]:
    """``(c, mean(cw))``: the shard's column weights of the mean logit (``None``: each 1)
    and the mean class weight (1 without class weights), for label smoothing's
    ``eps / V * sum_j cw[j] (lse - z_j) = eps * (mean(cw) * lse - mean_logit)``."""
    if class_weights is None or ctx.vocab is None:
        return None, 1.0
    cw = class_weights.detach().to(device=x.hidden.device, dtype=x.acc_dtype)
    cw = torch.where(torch.isfinite(cw) & (cw >= 0), cw, float("nan"))  # checked in _class_weights_of
    return cw[ctx.vocab.start : ctx.vocab.end], cw.mean()


def _token_weights(
    ctx: OutputContext, x: HookInputs, reduction: Reduction, cwy: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w [n], wz [n], M [n])`` in row order with ``loss = -sum(w * logprobs) +
    z_loss * sum(wz * lse ** 2)``: ``M`` is ``loss_mask`` (every token when ``None``;
    checked ``>= 0`` and finite), 0 at an ignored label; ``wz = M`` (sum) or the token
    mean's ``M / count`` of :func:`~torch_impl.processors.aggregation_weights`,
    ``count`` the context's ``global_tokens`` else ``sum(M)`` (an exactly-0 ``sum(M)``
    gives 0); ``w = wz``, or with ``cwy`` (the class weight of each row's label) the
    same of ``M * cwy`` (the mean then divides by ``sum(M * cwy)``)."""
    m = to_tokens(counted_mask(ctx, x, ctx.loss_mask, "loss_mask"))
    count = _global_tokens(ctx, reduction)
    if cwy is not None and count is not None:
        raise ContractError(
            "context.global_tokens",
            expected="None with class_weights (the mean divides by the counted tokens' class weights)",
            actual=repr(count),
        )
    if reduction == "sum":
        return (m if cwy is None else m * cwy), m, m
    if count is None and ctx.parallel.cp_size > 1:
        raise ContractError(
            "context.global_tokens",
            expected=f"the token count over the context-parallel group (parallel.cp_size="
            f"{ctx.parallel.cp_size}) for reduction='mean'",
            actual="None",
            hint="or use reduction='sum' and divide by the count yourself",
        )
    segments = torch.zeros(m.shape, dtype=torch.long, device=m.device)

    def mean_weights(v: torch.Tensor) -> torch.Tensor:
        return weights_of(v, segments, 1, Aggregation.TOKEN_MEAN, global_tokens=count, global_sequences=None)

    wz = mean_weights(m)
    return (wz if cwy is None else mean_weights(m * cwy)), wz, m


def _reduced(
    ctx: OutputContext,
    reduction: Reduction,
    temperature: float | None,
    tile: LinearOptions,
    z_loss: float,
    class_weights: torch.Tensor | None,
    eps: float,
) -> dict[str, torch.Tensor]:
    """``cross_entropy_loss(reduction="sum" | "mean")`` on one context."""
    x = hook_inputs(ctx, "cross_entropy_loss")
    temp = resolve_temperature(temperature, ctx, x.b, x.s)
    # the z-loss unweighted by the class weights, as Liger-Kernel's
    cwy = None if class_weights is None else _class_weights_of(ctx, x, class_weights)
    w, wz, m = _token_weights(ctx, x, reduction, cwy)
    c, cw_mean = _smoothing_of(ctx, x, class_weights)
    ws = w  # label smoothing's token weights: M, divided by sum(M * cw[y]) for the mean
    if cwy is not None and reduction == "mean":
        count = (m * cwy).sum()
        ws = torch.where(count != 0, m / torch.where(count != 0, count, 1.0), 0.0)
    elif cwy is not None:
        ws = m

    def tile_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        wr = w[rows].to(lp.dtype)
        return -(1.0 - eps) * (torch.where(wr != 0, lp, 0.0) * wr).sum()

    def lse_loss(lse: torch.Tensor, rows: slice) -> torch.Tensor:
        wr, sr = wz[rows].to(lse.dtype), ws[rows].to(lse.dtype)
        zl = (torch.where(wr != 0, lse.square(), 0.0) * wr).sum()
        return z_loss * zl + eps * (torch.where(sr != 0, lse, 0.0) * sr).sum() * cw_mean

    def mean_loss(mean: torch.Tensor, rows: slice) -> torch.Tensor:
        sr = ws[rows].to(mean.dtype)
        return -eps * (torch.where(sr != 0, mean, 0.0) * sr).sum()

    options = x.tensor_options(tile, temp)
    res = fused_token_loss(
        x.hidden,
        x.weight,
        x.token_labels,
        tile_loss,
        options=options,
        entropy_grad=False,
        lse_loss=lse_loss if z_loss != 0.0 or eps != 0.0 else None,
        mean_logit_loss=mean_loss if eps != 0.0 else None,
        mean_logit_weights=c if eps != 0.0 else None,
    )
    # + 0 * sum(entropy): NaN where a hidden state or the weight holds NaN/inf,
    # even at an uncounted token (its gradient would be NaN anyway)
    return {"loss": res.loss + 0.0 * res.entropy.sum(), "tokens": m.sum().to(torch.float32)}


def cross_entropy_loss(
    *,
    reduction: Reduction = "none",
    temperature: float | None = None,
    z_loss: float = 0.0,
    class_weights: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    **unexpected: Never,
) -> Processor:
    """Megatron's ``compute_language_model_loss``, per token or reduced, with an
    optional z-loss.

    ``reduction="none"`` (the default): the per-token loss ``[b, s]`` (fp32),
    unreduced and without the loss mask, like Megatron's (apply ``loss_mask`` as
    you do to Megatron's output)::

        loss = -log_softmax(scale_logits(hidden_states @ vocab_weight.T) / T)[labels]

    One difference: where ``labels == ctx.ignore_index`` the loss is ``0`` with a
    zero gradient (Megatron returns the logsumexp there, which the loss mask
    then removes). With ``z_loss`` (a finite weight ``>= 0``; default 0: none) each
    counted token adds ``z_loss * lse ** 2``, ``lse = logsumexp(z)`` the
    log-partition of the same tempered logits (all shards), 0 where the label is
    ignored (``hookspec.conventions``)::

        loss = -log_softmax(z)[labels] + z_loss * logsumexp(z) ** 2

    ``T`` is ``temperature`` (default 1); a user context holding
    a ``temperature`` or ``global_tokens`` that is not ``None`` raises rather than
    being ignored (Megatron's loss has neither). Logits recomputed in backward
    (:func:`linear_logprobs`, tiles of ``tile_rows`` x ``tile_cols``):
    four GEMM-equivalents ``2 n h V`` forward plus backward.

    ``reduction="sum"`` or ``"mean"``: ``{"loss": [], "tokens": []}`` (fp32)::

        M = loss_mask * (labels != ignore_index)      # [b, s]; loss_mask None: ones
        w = M                                         # "sum"
        w = M / (global_tokens or sum(M))             # "mean" (token-mean weights)
        loss = sum(w * (-logprobs + z_loss * lse ** 2))   # logprobs, lse as above, at T
        tokens = sum(M)                               # this rank's counted tokens, detached

    through :func:`fused_token_loss`: the gradient formed in the forward pass,
    three GEMM-equivalents on both backends with or without the z-loss, no logits recomputed
    (tiles of ``tile_rows`` whole rows; ``None``: the default per device). ``T``:
    ``temperature``, else the user context's ``temperature`` (a number or
    ``[b, s]``), else 1; both given raises. ``global_tokens`` (the user
    context's key or attribute, a finite number > 0) replaces ``sum(M)``,
    for a loss split over ranks; with ``"sum"`` it is refused, and under
    context parallel ``"mean"`` requires it. A mask summing to exactly 0
    gives ``loss = 0`` with a zero gradient (never NaN); a ``loss_mask``
    entry that is NaN, infinite or negative raises ``ContractError``
    (``loss_mask``). A NaN or inf in the hidden states or weight makes the
    loss NaN.

    ``class_weights`` (``[V]``, finite, ``>= 0``; ``None``: every class 1), as
    ``torch.nn.functional.cross_entropy(weight=)`` and Liger-Kernel's ``ce_weight``
    define them: the cross-entropy term of each token is weighted by ``cw[labels]``,
    the mean divides it by ``sum(M * cw[labels])``; the z-loss term keeps the
    unweighted ``w`` (``hookspec.conventions``)::

        loss = -cw[labels] * logprobs + z_loss * lse ** 2      # "none"; 0 where ignored
        loss = sum(M * cw[y] * -logprobs) / sum(M * cw[y]) + z_loss * sum(M * lse ** 2) / sum(M)   # "mean"

    (``global_tokens`` with class weights and ``"mean"`` is refused.)

    ``label_smoothing`` (``eps`` in ``[0, 1]``; default 0), as
    ``torch.nn.functional.cross_entropy(label_smoothing=)``: the cross-entropy term
    of each counted token becomes ``(1 - eps) * -logprobs + eps * (lse - mean_logit)``,
    ``mean_logit = z.mean(-1)`` over the whole vocabulary (``hookspec.conventions``;
    the reduced forms read each tile twice, no GEMM more). With ``class_weights``, as
    PyTorch (and Liger-Kernel) weight it: ``(1 - eps) * cw[y] * -logprobs + eps / V *
    sum_j cw[j] (lse - z_j)``, the mean divided by ``sum(M * cw[y])``.
    """
    refuse_unexpected("cross_entropy_loss", unexpected)
    reduction = _check_reduction(reduction)
    if temperature is not None:
        check_temperature(temperature, 1)
    z_loss = check_finite_number("z_loss", z_loss, low=0.0)
    eps = check_finite_number("label_smoothing", label_smoothing, low=0.0, high=1.0)
    if class_weights is not None and (
        not isinstance(class_weights, torch.Tensor)
        or class_weights.dim() != 1
        or not class_weights.dtype.is_floating_point
    ):
        actual = (
            f"a {str(class_weights.dtype).removeprefix('torch.')} tensor {format_shape(class_weights.shape)}"
            if isinstance(class_weights, torch.Tensor)
            else type(class_weights).__name__
        )
        raise ContractError("class_weights", expected="None or a floating tensor [V]", actual=actual)
    tile = LinearOptions(tile_rows=tile_rows, tile_cols=tile_cols)

    @checked_call()
    def fn(ctx: OutputContext) -> torch.Tensor:
        x = hook_inputs(ctx, "cross_entropy_loss")
        for name in ("temperature", "global_tokens"):  # read by a reduction only: refused, not ignored
            value = context_field(ctx.context, name)
            if value is not None:
                raise ContractError(
                    f"context.{name}",
                    expected="none: cross_entropy_loss() is Megatron's per-token loss, which takes no "
                    f"{name} (a reduction reads it; selected_logprobs takes a temperature)",
                    actual=f"a {type(value).__name__}",
                )
        cwy = None if class_weights is None else _class_weights_of(ctx, x, class_weights)
        c, cw_mean = _smoothing_of(ctx, x, class_weights)
        res = linear_logprobs(
            x.hidden,
            x.weight,
            x.token_labels,
            options=x.tensor_options(tile, 1.0 if temperature is None else temperature),
            with_mean_logit=eps != 0.0,
            mean_logit_weights=c if eps != 0.0 else None,
        )
        loss = -res.logprobs
        if cwy is not None:
            loss = loss * cwy
        if res.mean_logit is not None:
            smooth = torch.where(x.token_labels == ctx.ignore_index, 0.0, cw_mean * res.lse - res.mean_logit)
            loss = (1.0 - eps) * loss + eps * smooth
        if z_loss != 0.0:
            loss = loss + z_loss * torch.where(x.token_labels == ctx.ignore_index, 0.0, res.lse.square())
        return from_tokens(loss, x.b, x.s)

    @checked_call()
    def reduced(ctx: OutputContext) -> dict[str, torch.Tensor]:
        return _reduced(ctx, reduction, temperature, tile, z_loss, class_weights, eps)

    if reduction == "none":
        return processor(fn, name="cross_entropy_loss")
    return processor(reduced, name="cross_entropy_loss")

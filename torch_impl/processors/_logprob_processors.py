"""The logprob processors: selected-token logprobs (and entropy) and Megatron's
cross entropy (per token, or reduced through :func:`fused_token_loss`), each
computed from the hidden states and the vocab shard (layout: :mod:`._inputs`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Never

import torch

from hookspec import Aggregation, ContractError, OutputContext, Processor, processor
from hookspec.arrays import format_shape

from ..value_checks import check_finite_deferred, checked_call
from ._checks import check_bool, check_finite_number, context_field, describe_tensor
from ._fused import fused_token_loss
from ._inputs import (
    HookInputs,
    counted_mask,
    factory_tiles,
    from_tokens,
    hook_inputs,
    resolve_temperature,
    to_tokens,
)
from ._logprobs import linear_logprobs
from ._loss_math import weighted_sum, weights_of
from ._options import LinearOptions
from ._sampling import SamplingSupport, context_support, factory_support

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
    support: SamplingSupport | None = None,
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    **unexpected: Never,
) -> Processor:
    """A processor returning ``{"logprobs": [b, s], "entropy": [b, s]}`` (fp32)::

        z = hidden_states @ vocab_weight.T / T          # never materialised
        logprobs = log_softmax(z)[labels]               # 0 where labels == ignore_index
        entropy = logsumexp(z) - sum(softmax(z) * z)    # only with entropy=True

    Args:
        temperature: ``T``; ``None``: the user context's ``temperature`` (a number or
            ``[b, s]``), else 1. Both given raises.
        entropy: also return ``"entropy"``.
        support: sampling replay: a :class:`SamplingSupport` of numbers; ``None``: the user
            context's ``sampling_support`` (``[b, s, K]`` kept ids or ``[b, s]`` parameters),
            if any. Both given raises. The logprobs and entropy are then those of the kept
            distribution (``linear_logprobs``').
        tile_rows, tile_cols: the tiles, by :class:`LinearOptions`' names (``None``: per device).

    Returns:
        The processor (pass it as ``output_processor=``): called by the hook, it returns the
        dictionary above, ``"entropy"`` only with ``entropy=True``.
    """
    tile = factory_tiles("selected_logprobs", unexpected, temperature, tile_rows, tile_cols)
    check_bool("entropy", entropy)
    support = factory_support(support)

    @checked_call()
    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        inputs = hook_inputs(ctx, "selected_logprobs")
        res = linear_logprobs(
            inputs.hidden,
            inputs.weight,
            inputs.token_labels,
            options=inputs.tensor_options(
                tile, resolve_temperature(temperature, ctx, inputs.b, inputs.s)
            ),
            with_entropy=entropy,
            support=context_support(support, ctx, inputs.b, inputs.s),
        )
        return inputs.per_token(logprobs=res.logprobs, entropy=res.entropy)

    return processor(fn, name="selected_logprobs")


def _class_weights_of(
    ctx: OutputContext, inputs: HookInputs, class_weights: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, float | torch.Tensor]:
    """``(cw[labels] [n], c [V_local], mean(cw))``: each row's label weight (acc dtype;
    0 where ignored), the shard's column weights of the mean logit and the mean class
    weight, for label smoothing's ``eps / V * sum_j cw[j] (lse - z_j) = eps * (mean(cw)
    * lse - mean_logit)``; ``(None, None, 1.0)`` without class weights."""
    if class_weights is None:
        return None, None, 1.0
    vocab = ctx.vocab
    assert vocab is not None, "hook_inputs checked it"
    if tuple(class_weights.shape) != (vocab.size,):
        raise ContractError(
            "class_weights",
            expected=f"a tensor [V={vocab.size}] (the whole vocabulary)",
            actual=format_shape(class_weights.shape),
        )
    if ctx.check_values:
        check_finite_deferred(class_weights, field="class_weights", nonnegative=True)
    cw = class_weights.detach().to(device=inputs.hidden.device, dtype=inputs.acc_dtype)
    cw = torch.where(torch.isfinite(cw) & (cw >= 0), cw, float("nan"))
    y = inputs.token_labels  # an ignored label clamped into range, then its weight 0
    cwy = torch.where(y == ctx.ignore_index, 0.0, cw[y.clamp(0, max(vocab.size - 1, 0))])
    return cwy, cw[vocab.start : vocab.end], cw.mean()


def _token_weights(
    ctx: OutputContext, inputs: HookInputs, reduction: Reduction, cwy: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w, wz, ws, M)`` ``[n]`` in row order with ``loss = -(1 - eps) * sum(w * logprobs)
    + z_loss * sum(wz * lse ** 2) + eps * sum(ws * (mean(cw) * lse - mean_logit))``: ``M``
    :func:`~._inputs.counted_mask` of ``loss_mask``; ``wz = M`` (sum) or the token mean's
    ``M / (global_tokens or sum(M))`` (0 where ``sum(M) == 0``); ``w = ws = wz``, or with
    ``cwy = cw[y]`` ``w`` the same of ``M * cwy``, ``ws`` of ``M``, the mean's over
    ``sum(M * cwy)``."""
    m = to_tokens(counted_mask(ctx, inputs, ctx.loss_mask, "loss_mask"))
    count = context_field(ctx.context, "global_tokens")  # read by "mean" without class weights only
    if count is not None and (reduction != "mean" or cwy is not None):
        why = "class_weights (the mean divides by the counted tokens' class weights)"
        if reduction != "mean":
            why = f"reduction={reduction!r}, which divides by no count"
        raise ContractError(
            "context.global_tokens", expected=f"None with {why}", actual=repr(count)
        )
    if count is not None:
        count = check_finite_number("context.global_tokens", count, low=0.0, low_open=True)
    if reduction == "sum":
        return (m if cwy is None else m * cwy), m, m, m
    if count is None and ctx.parallel.cp_size > 1:
        raise ContractError(
            "context.global_tokens",
            expected=f"the token count over the context-parallel group (parallel.cp_size="
            f"{ctx.parallel.cp_size}) for reduction='mean'",
            actual="None",
            hint="or use reduction='sum' and divide by the count yourself",
        )
    segments = torch.zeros(m.shape, dtype=torch.long, device=m.device)
    wz = weights_of(
        m, segments, 1, Aggregation.TOKEN_MEAN, global_tokens=count, global_sequences=None
    )
    if cwy is None:
        return wz, wz, wz, m
    total = (m * cwy).sum()  # count is None here: refused with class weights
    nonzero = torch.where(total != 0, total, 1.0)
    return m * cwy / nonzero, wz, torch.where(total != 0, m / nonzero, 0.0), m


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
    optional z-loss, class weights and label smoothing (``hookspec.conventions``; the
    last two as ``torch.nn.functional.cross_entropy``'s ``weight`` and ``label_smoothing``)::

        z = scale_logits(hidden_states @ vocab_weight.T) / T    # T: temperature (default 1)
        lse, logprobs = logsumexp(z), log_softmax(z)[labels]    # over the whole vocabulary
        ce = (1 - eps) * cw[y] * -logprobs + eps / V * sum_j cw[j] (lse - z_j)
        # eps: label_smoothing in [0, 1]; cw: class_weights [V], finite, >= 0 (None: ones)

    Args:
        reduction: ``"none"`` (the default), ``"sum"`` or ``"mean"``: the results below.
        temperature: ``T``; with ``"sum"`` or ``"mean"``, as :func:`selected_logprobs`'.
        z_loss, class_weights, label_smoothing: ``z_loss`` (finite, ``>= 0``), ``cw``, ``eps``.
        tile_rows, tile_cols: the tiles, by :class:`LinearOptions`' names.

    ``reduction="none"``: ``loss = ce + z_loss * lse ** 2`` ``[b, s]`` (fp32), without the loss
    mask, like Megatron's, except 0 with a zero gradient where the label is ignored (Megatron
    returns the logsumexp there). A user context's ``temperature`` or ``global_tokens`` raises
    (Megatron's loss has neither). Logits recomputed in backward: four GEMM-equivalents ``2 n h V``.

    ``reduction="sum"`` or ``"mean"``: ``{"loss": [], "tokens": []}`` (fp32), the
    gradient formed in the forward pass (:func:`fused_token_loss`, three GEMM-equivalents)::

        M = loss_mask * (labels != ignore_index)      # [b, s]; loss_mask None: ones
        w = M                                         # "sum"
        w = M / (global_tokens or sum(M))             # "mean" (token-mean weights)
        loss = sum(w * (ce + z_loss * lse ** 2))      # except "mean" with class_weights:
        loss = sum(M * ce) / sum(M * cw[y]) + z_loss * sum(M * lse ** 2) / sum(M)
        tokens = sum(M)                               # this rank's counted tokens, detached

    ``global_tokens`` (the user context's, a finite number > 0) is read by ``"mean"`` only (refused
    with ``"sum"`` or class weights; required under context parallel). A mask summing to exactly 0
    gives 0 with a zero gradient; a NaN, infinite or negative ``loss_mask`` entry raises
    ``ContractError``; a NaN or inf in the hidden states or weight makes the loss NaN.

    Returns:
        The processor: ``loss`` ``[b, s]`` (``"none"``), else ``{"loss", "tokens"}`` (above).
    """
    tile = factory_tiles("cross_entropy_loss", unexpected, temperature, tile_rows, tile_cols)
    loss = _CrossEntropy.checked(
        reduction, temperature, z_loss, label_smoothing, class_weights, tile
    )
    path = _per_token_cross_entropy if reduction == "none" else _reduced_cross_entropy

    @checked_call()
    def fn(ctx: OutputContext) -> torch.Tensor | dict[str, torch.Tensor]:
        return path(ctx, loss)

    return processor(fn, name="cross_entropy_loss")


@dataclasses.dataclass(frozen=True)
class _CrossEntropy:
    """The checked options of one :func:`cross_entropy_loss` processor (``eps``: the label
    smoothing; ``tile``: the factory's tiles)."""

    reduction: Reduction
    temperature: float | None
    z_loss: float
    eps: float
    class_weights: torch.Tensor | None
    tile: LinearOptions

    @classmethod
    def checked(
        cls,
        reduction: Reduction,
        temperature: float | None,
        z_loss: float,
        label_smoothing: float,
        class_weights: torch.Tensor | None,
        tile: LinearOptions,
    ) -> _CrossEntropy:
        """The factory's arguments checked (``ContractError`` naming the argument)."""
        if not isinstance(reduction, str) or reduction not in REDUCTIONS:
            raise ContractError(
                "reduction", expected=f"one of {list(REDUCTIONS)}", actual=repr(reduction)
            )
        z_loss = check_finite_number("z_loss", z_loss, low=0.0)
        eps = check_finite_number("label_smoothing", label_smoothing, low=0.0, high=1.0)
        if class_weights is not None and not (
            isinstance(class_weights, torch.Tensor)
            and class_weights.dim() == 1
            and class_weights.dtype.is_floating_point
        ):
            raise ContractError(
                "class_weights",
                expected="None or a floating tensor [V]",
                actual=describe_tensor(class_weights),
            )
        return cls(reduction, temperature, z_loss, eps, class_weights, tile)


def _per_token_cross_entropy(ctx: OutputContext, loss: _CrossEntropy) -> torch.Tensor:
    """``reduction="none"``: ``ce + z_loss * lse ** 2`` ``[b, s]`` (0 where the label is
    ignored) through :func:`linear_logprobs`, the logits recomputed in backward. It exists
    beside :func:`_reduced_cross_entropy` because a per-token loss has no scalar whose
    gradient could be formed in the forward pass."""
    inputs = hook_inputs(ctx, "cross_entropy_loss")
    _refuse_reduction_fields(ctx)
    eps = loss.eps
    cwy, c, cw_mean = _class_weights_of(ctx, inputs, loss.class_weights)
    temperature = 1.0 if loss.temperature is None else loss.temperature
    result = linear_logprobs(
        inputs.hidden,
        inputs.weight,
        inputs.token_labels,
        options=inputs.tensor_options(loss.tile, temperature),
        with_mean_logit=eps != 0.0,
        mean_logit_weights=c if eps != 0.0 else None,
    )
    ignored = inputs.token_labels == ctx.ignore_index
    ce = -result.logprobs if cwy is None else -result.logprobs * cwy
    if result.mean_logit is not None:
        smooth = torch.where(ignored, 0.0, cw_mean * result.lse - result.mean_logit)
        ce = (1.0 - eps) * ce + eps * smooth
    if loss.z_loss != 0.0:
        ce = ce + loss.z_loss * torch.where(ignored, 0.0, result.lse.square())
    return from_tokens(ce, inputs.b, inputs.s)


def _refuse_reduction_fields(ctx: OutputContext) -> None:
    """The per-token loss reads neither a ``temperature`` nor ``global_tokens`` of the user
    context (a reduction reads them): refused, not ignored."""
    for name in ("temperature", "global_tokens"):
        value = context_field(ctx.context, name)
        if value is not None:
            raise ContractError(
                f"context.{name}",
                expected="none: cross_entropy_loss() is Megatron's per-token loss, which takes "
                f"no {name} (a reduction reads it; selected_logprobs takes a temperature)",
                actual=f"a {type(value).__name__}",
            )


def _reduced_cross_entropy(ctx: OutputContext, loss: _CrossEntropy) -> dict[str, torch.Tensor]:
    """``reduction="sum"`` or ``"mean"``: ``{"loss", "tokens"}`` through
    :func:`fused_token_loss`, the gradient formed in the forward pass (three
    GEMM-equivalents); the loss's three parts, each a weighted sum of a row vector
    (:func:`_token_weights`)::

        loss = -(1 - eps) sum(w * logprobs) + z_loss sum(wz * lse**2)
               + eps sum(ws * (mean(cw) * lse - mean_logit))
    """
    inputs = hook_inputs(ctx, "cross_entropy_loss")
    temperature = resolve_temperature(loss.temperature, ctx, inputs.b, inputs.s)
    cwy, c, cw_mean = _class_weights_of(ctx, inputs, loss.class_weights)
    # the z-loss unweighted by the class weights (wz), as Liger-Kernel's
    w, wz, ws, counted = _token_weights(ctx, inputs, loss.reduction, cwy)
    eps, z_loss = loss.eps, loss.z_loss

    def tile_loss(logp: torch.Tensor, entropy: torch.Tensor, rows: slice) -> torch.Tensor:
        return -(1.0 - eps) * weighted_sum(logp, w[rows].to(logp.dtype))

    def lse_loss(lse: torch.Tensor, rows: slice) -> torch.Tensor:
        squares = weighted_sum(lse.square(), wz[rows].to(lse.dtype))
        return z_loss * squares + eps * weighted_sum(lse, ws[rows].to(lse.dtype)) * cw_mean

    def mean_loss(mean: torch.Tensor, rows: slice) -> torch.Tensor:
        return -eps * weighted_sum(mean, ws[rows].to(mean.dtype))

    result = fused_token_loss(
        inputs.hidden,
        inputs.weight,
        inputs.token_labels,
        tile_loss,
        options=inputs.tensor_options(loss.tile, temperature),
        entropy_grad=False,
        lse_loss=lse_loss if z_loss != 0.0 or eps != 0.0 else None,
        mean_logit_loss=mean_loss if eps != 0.0 else None,
        mean_logit_weights=c if eps != 0.0 else None,
    )
    # + 0 * sum(entropy): NaN where a hidden state or the weight holds NaN/inf,
    # even at an uncounted token (its gradient would be NaN anyway)
    total = result.loss + 0.0 * result.entropy.sum()
    return {"loss": total, "tokens": counted.sum().to(torch.float32)}

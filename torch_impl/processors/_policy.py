"""The policy-loss processor: :class:`PolicyBatch` (its user context) and
:func:`policy_loss`, on the formulas of :mod:`._loss_math`.

What each input may hold (the mask at every token, the batch's values at counted
tokens only, the model's outputs at every token, numbers where they enter): the
table "What each input may hold" in ``docs/processors.md``
(``tests/test_validation_processors.py``).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Never

import torch

from hookspec import (
    Aggregation,
    ContractError,
    KLEstimator,
    OutputContext,
    Processor,
    SingleProcessCollectives,
    processor,
)

from ..value_checks import check_finite_deferred, checked_call
from ._checks import check_floating, check_shape
from ._fused import fused_token_loss
from ._inputs import (
    HookInputs,
    counted_mask,
    from_tokens,
    hook_inputs,
    resolve_temperature,
    sequence_ids,
    to_tokens,
)
from ._logprobs import linear_logprobs
from ._loss_math import (
    PolicyLossConfig,
    RatioLevel,
    check_counts,
    global_counts,
    kl_terms,
    masked_mean,
    ppo_token_loss,
    segment_sum,
    sequence_ratio_of,
    sequence_sums,
    weighted_sum,
    weights_of,
)
from ._options import LinearOptions, refuse_unexpected

__all__ = ["PolicyBatch", "TokenTerms", "context_parallel_sum", "policy_loss"]


@dataclasses.dataclass(frozen=True)
class PolicyBatch:
    """The user context of :func:`policy_loss` (pass it as ``output_processor_context``).

    Per-token fields are ``[b, s]``, like ``labels``:

    - ``old_logprobs``: the behaviour policy's logprobs (ratio denominator).
    - ``advantages``: per token (broadcast a per-sequence advantage yourself).
    - ``mask``: which tokens count, as weights (bool, or numbers ``>= 0``);
      ``None``: the model's ``loss_mask``, else every token. Tokens labelled
      ``ignore_index`` never count. A NaN, infinite or negative entry raises
      ``ContractError`` (never "empty"; see the module docstring).
    - ``ref_logprobs``: the reference policy's logprobs, needed when ``kl_coef != 0``.
    - ``temperature``: the sampling temperature, a number or ``[b, s]``.
    - ``global_tokens`` / ``global_sequences``: the token / sequence counts of
      the whole loss split over ranks, finite numbers ``> 0`` (not tensors): they
      replace the local ``sum(mask)`` / number of sequences, so that the ranks'
      losses sum to the global loss. Give the one the aggregation reads (the
      other is refused); under context parallel they are optional (the group's
      sums are taken): give them for the data-parallel ranks beyond it.

    ``old_logprobs``, ``advantages`` and ``ref_logprobs`` are read at counted
    tokens only.
    """

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    temperature: float | torch.Tensor | None = None
    global_tokens: float | None = None
    global_sequences: float | None = None

    def validate(self, b: int, s: int, *, need_ref: bool) -> None:
        """Shapes ``[b, s]``, floating dtypes; ``ref_logprobs`` when ``need_ref``;
        the counts finite and ``> 0``. Reads no tensor values."""
        for name in ("old_logprobs", "advantages", "ref_logprobs"):
            value = getattr(self, name)
            if value is None:
                if name == "ref_logprobs" and need_ref:
                    raise ContractError(
                        "context.ref_logprobs", expected="a tensor [b, s] (kl_coef != 0)", actual="None"
                    )
                continue
            check_floating(f"context.{name}", value)
            check_shape(f"context.{name}", value, (b, s), f"[b={b}, s={s}] like labels")
        if self.mask is not None:
            if not isinstance(self.mask, torch.Tensor):
                raise ContractError(
                    "context.mask", expected="a tensor [b, s]", actual=type(self.mask).__name__
                )
            check_shape("context.mask", self.mask, (b, s), f"[b={b}, s={s}] like labels")
        check_counts(None, **global_counts(self), prefix="context.")


def _policy_batch(ctx: OutputContext) -> PolicyBatch:
    batch = ctx.context
    if not isinstance(batch, PolicyBatch):
        raise ContractError(
            "context",
            expected="a torch_impl.processors.PolicyBatch (output_processor_context=)",
            actual=type(batch).__name__,
            hint="A mapping is not read as one: pass PolicyBatch(**mapping)"
            if isinstance(batch, Mapping)
            else "",
        )
    return batch


CpSum = Callable[[torch.Tensor], torch.Tensor]
_Sequences = tuple[torch.Tensor, torch.Tensor, int, CpSum | None]
"""The checked mask ``M`` ``[b, s]`` (NaN where an entry is bad), each token's
sequence ``segments`` ``[b, s]``, their ``count``, and the context-parallel sum
(``None``: the sums here are whole)."""


def context_parallel_sum(config: PolicyLossConfig, batch: PolicyBatch, ctx: OutputContext) -> CpSum | None:
    """The sum over the context-parallel group the loss makes its per-sequence
    sums whole with (``ctx.collectives.all_reduce_sum_context_parallel``), or
    ``None`` at ``cp_size`` 1.

    Collectives without the method (spec 1.1), or the one-rank
    :class:`~hookspec.SingleProcessCollectives`, are taken where the loss does not
    need it (token-mean with ``global_tokens``, seq-mean-token-sum with
    ``global_sequences``); GSPO and seq-mean-token-mean then raise
    ``ContractError`` naming the method, as does a ``cp_size`` that is not
    ``parallel.cp_size``.
    """
    cp = ctx.parallel.cp_size
    if cp == 1:
        return None
    coll = ctx.collectives
    declared = getattr(coll, "cp_size", None)
    if isinstance(declared, int) and not isinstance(declared, bool) and declared not in (1, cp):
        raise ContractError(
            "collectives",
            expected=f"a context-parallel group of parallel.cp_size={cp} ranks",
            actual=f"{declared} ranks ({coll!r})",
        )
    method = getattr(coll, "all_reduce_sum_context_parallel", None)
    if callable(method) and not isinstance(coll, SingleProcessCollectives) and declared != 1:
        return typing.cast(CpSum, method)
    need = "global_tokens" if config.aggregation == Aggregation.TOKEN_MEAN else "global_sequences"
    if config.ratio == RatioLevel.SEQUENCE:
        what = "GSPO's sequence ratio (each sequence's mean log-ratio spans the ranks)"
    elif config.aggregation == Aggregation.SEQ_MEAN_TOKEN_MEAN:
        what = "seq-mean-token-mean (each sequence's token count spans the ranks)"
    elif getattr(batch, need) is None:
        what = f"{config.aggregation.value} without context.{need}"
    else:
        return None
    raise ContractError(
        "collectives",
        expected=f"all_reduce_sum_context_parallel over the context-parallel group "
        f"(parallel.cp_size={cp}; hookspec.Collectives, spec 1.2) for {what}",
        actual=f"{coll!r}, which has none" if not callable(method) else f"{coll!r} (one rank)",
        hint=f"torch_impl builds it from Megatron's context-parallel group; or give context.{need}"
        if what.endswith(need)
        else "torch_impl builds it from Megatron's context-parallel group",
    )


# ---------------------------------------------------------------- per-token terms


@dataclasses.dataclass(frozen=True)
class TokenRows:
    """The batch as hidden-state rows ``[n]`` (``s``-major), checked.

    ``mask``: ``M`` (NaN where an entry is bad); ``weights``: the aggregation's
    ``w`` with ``loss = sum(w * L)``; ``old``, ``adv``, ``ref``: detached,
    ``adv`` 0 where ``M == 0`` (never read there).
    """

    mask: torch.Tensor
    weights: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    ref: torch.Tensor | None

    def take(self, rows: slice) -> TokenRows:
        """The rows ``rows`` of every field."""
        fields: dict[str, typing.Any] = {k: None if v is None else v[rows] for k, v in vars(self).items()}
        return TokenRows(**fields)


@dataclasses.dataclass(frozen=True)
class TokenTerms:
    """Per-token terms ``[n]`` of ``L = pg + kl_coef * kl - entropy_coef * entropy``.

    ``loss``: ``L``; ``pg``: the clipped policy-gradient term; ``kl``: the KL
    estimator to the reference (``None`` without ``ref_logprobs``);
    ``clipped``: the clip branch taken (bool); ``dual``: the dual-clip bound
    taken (bool, ``None`` without ``dual_clip``); ``log_ratio``: the clamped
    ``log(ratio)`` (0 at uncounted tokens for the token ratio).
    """

    loss: torch.Tensor
    pg: torch.Tensor
    kl: torch.Tensor | None
    clipped: torch.Tensor
    dual: torch.Tensor | None
    log_ratio: torch.Tensor


def token_terms(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    rows: TokenRows,
    config: PolicyLossConfig,
    log_ratio: torch.Tensor | None = None,
) -> TokenTerms:
    """:class:`TokenTerms` of ``logp`` and ``entropy`` ``[r]`` against ``rows``
    (``log_ratio``: GSPO's sequence log-ratio; default the token one)."""
    live = rows.mask > 0
    if log_ratio is None:
        log_ratio = torch.where(live, logp - rows.old.to(logp.dtype), 0.0)
        if config.log_ratio_clamp is not None:
            log_ratio = log_ratio.clamp(-config.log_ratio_clamp, config.log_ratio_clamp)
    pg, clipped, dual = ppo_token_loss(log_ratio, rows.adv.to(logp.dtype), config)
    total = pg
    kl = None
    if rows.ref is not None:
        ref = torch.where(live, rows.ref.to(logp.dtype), logp.detach())
        kl = kl_terms(logp, ref, config.kl_estimator, clamp=config.log_ratio_clamp)
        if config.kl_coef != 0.0:
            total = total + config.kl_coef * kl
    if config.entropy_coef != 0.0:
        total = total - config.entropy_coef * entropy
    return TokenTerms(loss=total, pg=pg, kl=kl, clipped=clipped, dual=dual, log_ratio=log_ratio)


# ---------------------------------------------------------------- the processor


@dataclasses.dataclass(frozen=True)
class _Pass:
    """What one pass (fused or autograd) returns: the loss, its per-token inputs
    ``[n]`` (detached or not) and terms."""

    loss: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    terms: TokenTerms


def _checked_mask(ctx: OutputContext, x: HookInputs, batch: PolicyBatch) -> torch.Tensor:
    """``M`` ``[b, s]``; with ``ctx.check_values``, the mask's values at every
    token and the batch's at the counted ones checked (deferred on a GPU)."""
    from_batch = batch.mask is not None
    given = batch.mask if from_batch else ctx.loss_mask
    mask = counted_mask(ctx, x, given, "context.mask" if from_batch else "loss_mask")
    if ctx.check_values:
        counted = mask > 0
        for name in ("old_logprobs", "advantages", "ref_logprobs"):
            value = getattr(batch, name)
            if value is not None:
                check_finite_deferred(value, field=f"context.{name}", where=counted)
    return mask


def _rows(
    seqs: _Sequences, batch: PolicyBatch, config: PolicyLossConfig, totals: torch.Tensor | None
) -> TokenRows:
    """The batch as rows, with the aggregation's weights (``totals``: each
    sequence's ``n_k`` summed over the context-parallel group, or ``None``)."""
    mask, segments, count, _ = seqs
    device = mask.device
    weights = weights_of(mask, segments, count, config.aggregation, **global_counts(batch), totals=totals)
    mask_t = to_tokens(mask)
    return TokenRows(
        mask=mask_t,
        weights=to_tokens(weights),
        old=to_tokens(batch.old_logprobs).detach().to(device),
        adv=torch.where(mask_t > 0, to_tokens(batch.advantages).detach().to(device), 0.0),
        ref=None if batch.ref_logprobs is None else to_tokens(batch.ref_logprobs).detach().to(device),
    )


def _fused_pass(x: HookInputs, rows: TokenRows, config: PolicyLossConfig, options: LinearOptions) -> _Pass:
    """Gradients formed in the forward pass, tile by tile (``fused_token_loss``)."""

    def tile_loss(lp: torch.Tensor, ent: torch.Tensor, sl: slice) -> torch.Tensor:
        part = rows.take(sl)
        return (token_terms(lp, ent, part, config).loss * part.weights.to(lp.dtype)).sum()

    res = fused_token_loss(
        x.hidden,
        x.weight,
        x.token_labels,
        tile_loss,
        options=options,
        entropy_grad=config.entropy_coef != 0.0,
    )
    terms = token_terms(res.logprobs, res.entropy, rows, config)
    return _Pass(loss=res.loss, logp=res.logprobs, entropy=res.entropy, terms=terms)


def _logprobs(x: HookInputs, options: LinearOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` ``[n]`` by ``linear_logprobs`` (logits recomputed in backward)."""
    lr = linear_logprobs(x.hidden, x.weight, x.token_labels, options=options, with_entropy=True)
    return lr.logprobs, typing.cast(torch.Tensor, lr.entropy)


def _autograd_pass(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    rows: TokenRows,
    config: PolicyLossConfig,
    log_ratio: torch.Tensor | None = None,
) -> _Pass:
    """Autograd through ``logp`` and ``entropy`` (``log_ratio``: GSPO's)."""
    terms = token_terms(logp, entropy, rows, config, log_ratio=log_ratio)
    loss = (terms.loss * rows.weights.to(logp.dtype)).sum()
    return _Pass(loss=loss, logp=logp, entropy=entropy, terms=terms)


def _sequence_pass(
    x: HookInputs, seqs: _Sequences, batch: PolicyBatch, config: PolicyLossConfig, options: LinearOptions
) -> tuple[_Pass, TokenRows, torch.Tensor | None]:
    """GSPO: ``(pass, rows, totals)``. Each sequence's ``sum M (logp - old)`` and
    ``n_k`` are summed over the context-parallel group in one collective, so
    that the ratio and the weights are the whole sequence's::

        num, n = cp_sum(stack([sum_k M (logp - old), sum_k M]))    # [2, count]
        log_ratio = clamp(num / n)[segments]
    """
    mask, segments, count, cp_sum = seqs
    logp, entropy = _logprobs(x, options)
    old = batch.old_logprobs.to(device=logp.device, dtype=logp.dtype)
    num, den = sequence_sums(from_tokens(logp, x.b, x.s), old, mask, segments, count)
    totals = None
    if cp_sum is not None:
        num, den = cp_sum(torch.stack([num, den])).unbind(0)
        totals = den.detach()
    log_ratio = to_tokens(sequence_ratio_of(num, den, segments, clamp=config.log_ratio_clamp))
    rows = _rows(seqs, batch, config, totals)
    return _autograd_pass(logp, entropy, rows, config, log_ratio), rows, totals


def _metrics(
    p: _Pass, rows: TokenRows, config: PolicyLossConfig, totals: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The loss (NaN when a model output anywhere is: see the module docstring)
    and the detached metrics; ``totals``: the sequences' ``n_k`` over the
    context-parallel group, whose sum the means divide by (each rank's metric
    is then its share: the ranks' metrics sum to the whole micro-batch's)."""
    w = rows.weights.to(p.logp.dtype)
    m = rows.mask.to(p.logp.dtype)
    total = None if totals is None else totals.sum().to(m.dtype)
    logp, old = p.logp.detach(), rows.old.to(p.logp.dtype)
    approx_kl = kl_terms(logp, old, KLEstimator.K3, clamp=config.log_ratio_clamp)
    out = {
        # + 0 * sum(entropy): exact for a finite entropy; NaN where a hidden state
        # or the weight holds NaN/inf, even at an uncounted token.
        "loss": p.loss + 0.0 * p.entropy.detach().sum(),
        "pg_loss": weighted_sum(p.terms.pg.detach(), w),
        "entropy": masked_mean(p.entropy.detach(), m, total),
        "clip_fraction": masked_mean(p.terms.clipped, m, total),
        "approx_kl": masked_mean(approx_kl, m, total),
    }
    if p.terms.kl is not None:
        out["kl"] = weighted_sum(p.terms.kl.detach(), w)
    if p.terms.dual is not None:
        out["dual_clip_fraction"] = masked_mean(p.terms.dual, m, total)
    return out


def policy_loss(
    config: PolicyLossConfig | None = None,
    /,
    *,
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    **unexpected: Never,
) -> Processor:
    """A processor returning the policy loss and its metrics, each a scalar::

        {"loss", "pg_loss", "kl", "entropy", "clip_fraction", "dual_clip_fraction",
         "approx_kl"}

    ``loss`` is :class:`PolicyLossConfig`'s formula aggregated with its
    ``aggregation`` over the tokens of ``PolicyBatch.mask`` (the user context) whose
    label is not the ignore index; ``pg_loss`` and ``kl`` (with ``ref_logprobs``) are
    its terms aggregated alike. The rest are detached token means over the mask:
    ``entropy``, ``clip_fraction``, ``dual_clip_fraction`` (with ``dual_clip``),
    ``approx_kl`` = ``exp(old - logp) - (old - logp) - 1``.

    With ``config.fused`` and a token ratio, the gradients are formed in the forward
    pass (tiles of ``tile_rows`` whole rows, by default ``TILE_BYTES`` of fp32 logits,
    32 MiB on a CPU and 256 MiB on CUDA); otherwise autograd goes through
    :func:`linear_logprobs` (tiles of ``tile_rows`` x ``tile_cols``). ``None``: the
    default per device (:class:`LinearOptions`).
    """
    config = PolicyLossConfig() if config is None else config
    if not isinstance(config, PolicyLossConfig):
        raise ContractError("config", expected="a PolicyLossConfig", actual=type(config).__name__)
    refuse_unexpected("policy_loss", unexpected)
    tile = LinearOptions(tile_rows=tile_rows, tile_cols=tile_cols)
    fused = config.fused and config.ratio == RatioLevel.TOKEN

    @checked_call()
    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        x = hook_inputs(ctx, "policy_loss")
        batch = _policy_batch(ctx)
        batch.validate(x.b, x.s, need_ref=config.kl_coef != 0.0)
        check_counts(config.aggregation, **global_counts(batch), prefix="context.")
        cp_sum = context_parallel_sum(config, batch, ctx)
        mask = _checked_mask(ctx, x, batch)
        segments, count = sequence_ids(ctx, x.b, x.s, mask.device)
        seqs = (mask, segments, count, cp_sum)
        options = x.tensor_options(tile, resolve_temperature(None, ctx, x.b, x.s))
        if config.ratio == RatioLevel.SEQUENCE:
            p, rows, totals = _sequence_pass(x, seqs, batch, config, options)
        else:
            # one collective: each sequence's token count over the context-parallel group
            totals = None if cp_sum is None else cp_sum(segment_sum(mask, segments, count))
            rows = _rows(seqs, batch, config, totals)
            if fused:
                p = _fused_pass(x, rows, config, options)
            else:
                p = _autograd_pass(*_logprobs(x, options), rows, config)
        return _metrics(p, rows, config, totals)

    return processor(fn, name="policy_loss")

"""The policy-loss processor: :class:`PolicyBatch` (its user context) and :func:`policy_loss`,
on the formulas of :mod:`._loss_math` (what each input may hold: ``docs/processors.md``)."""

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
from ._checks import check_floating, check_instance, check_shape
from ._fused import fused_token_loss
from ._inputs import (
    HookInputs,
    counted_mask,
    factory_tiles,
    from_tokens,
    hook_inputs,
    resolve_temperature,
    sequence_ids,
    to_tokens,
)
from ._logprobs import linear_logprobs
from ._loss_math import (
    KLOptions,
    PolicyLossConfig,
    RatioLevel,
    check_counts,
    count_read,
    global_counts,
    kl_terms,
    masked_mean,
    segment_sum,
    symmetric_clamp,
    weighted_sum,
    weights_of,
)
from ._options import LinearOptions
from ._policy_terms import Batchwide, CpSum, TokenRows, pg_terms
from ._rollout import RolloutCorrection, WeightLevel, rollout_correction
from ._sampling import SamplingSupport, context_support

__all__ = ["PolicyBatch", "TokenTerms", "context_parallel_sum", "policy_loss"]


@dataclasses.dataclass(frozen=True)
class PolicyBatch:
    """The user context of :func:`policy_loss` (pass it as ``output_processor_context``).

    Per-token fields are ``[b, s]``, like ``labels``:

    - ``old_logprobs``: the behaviour policy's logprobs (ratio denominator).
    - ``advantages``: per token (broadcast a per-sequence advantage yourself).
    - ``mask``: which tokens count, as weights (bool, or numbers ``>= 0``); ``None``: the
      model's ``loss_mask``, else every token. Tokens labelled ``ignore_index`` never
      count. A NaN, infinite or negative entry raises ``ContractError`` (never "empty").
    - ``ref_logprobs``: the reference policy's logprobs, needed when ``kl_coef != 0``.
    - ``temperature``: the sampling temperature, a number or ``[b, s]``.
    - ``global_tokens`` / ``global_sequences``: the token / sequence counts of the
      whole loss split over ranks, finite numbers ``> 0`` (not tensors), replacing
      the local ``sum(mask)`` / number of sequences so that the ranks' losses sum to
      the global loss. Give the one the aggregation reads (the other is refused);
      optional under context parallel (give them for the data-parallel ranks).

    - ``rollout_logprobs``: the rollout engine's logprobs of the sampled tokens (vLLM,
      SGLang), needed by ``PolicyLossConfig.rollout_correction``; in its bypass mode they
      are the ratio's denominator and ``old_logprobs`` is not read (pass them twice).

    - ``sampling_support``: the tokens the rollout's sampler kept (sampling replay), a
      :class:`SamplingSupport` of ``[b, s, K]`` kept ids or of vLLM's parameters (numbers
      or ``[b, s]``): the current policy's logprob and entropy are then of the sampler's
      distribution renormalised over them (``old_logprobs`` and ``rollout_logprobs`` taken
      on the same support), the reference compared over the whole vocabulary
      (:class:`PolicyLossConfig`'s ``reference_on_support``). A counted token whose label
      is outside the support (the current logprob ``-inf``; or ``old_logprobs`` or
      ``rollout_logprobs`` ``-inf`` there, which a support allows) leaves the loss and its
      normalisation, as a rejected token; ``support/outside_fraction`` is their share.

    ``old_logprobs``, ``advantages``, ``ref_logprobs`` and ``rollout_logprobs`` are read at
    counted tokens only.
    """

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    temperature: float | torch.Tensor | None = None
    global_tokens: float | None = None
    global_sequences: float | None = None
    rollout_logprobs: torch.Tensor | None = None
    sampling_support: SamplingSupport | None = None

    def validate(self, b: int, s: int, *, need_ref: bool, need_rollout: bool = False) -> None:
        """Shapes ``[b, s]``, floating dtypes; ``ref_logprobs`` when ``need_ref``;
        the counts finite and ``> 0``. Reads no tensor values (the mask is checked where read)."""
        if need_ref and self.ref_logprobs is None:
            raise ContractError(
                "context.ref_logprobs", expected="a tensor [b, s] (kl_coef != 0)", actual="None"
            )
        if need_rollout and self.rollout_logprobs is None:
            raise ContractError(
                "context.rollout_logprobs",
                expected="a tensor [b, s] (the config has a rollout_correction)",
                actual="None",
            )
        for name in ("old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs"):
            value = getattr(self, name)
            if value is not None:
                check_floating(f"context.{name}", value)
                check_shape(f"context.{name}", value, (b, s), f"[b={b}, s={s}] like labels")
        check_counts(None, **global_counts(self), prefix="context.")


def _policy_batch(ctx: OutputContext, b: int, s: int, config: PolicyLossConfig) -> PolicyBatch:
    """The user context, a :class:`PolicyBatch` validated for ``config`` (its shapes and counts)."""
    batch, expected = ctx.context, "a torch_impl.processors.PolicyBatch (output_processor_context=)"
    hint = (
        "A mapping is not read as one: pass PolicyBatch(**mapping)"
        if isinstance(batch, Mapping)
        else ""
    )
    check_instance("context", batch, PolicyBatch, expected, hint)
    need_rollout = config.rollout_correction is not None
    batch.validate(b, s, need_ref=config.kl_coef != 0.0, need_rollout=need_rollout)
    check_counts(config.aggregation, **global_counts(batch), prefix="context.")
    return batch


def context_parallel_sum(
    config: PolicyLossConfig, batch: PolicyBatch, ctx: OutputContext
) -> CpSum | None:
    """The sum over the context-parallel group the loss makes its per-sequence
    sums whole with (``ctx.collectives.all_reduce_sum_context_parallel``), or
    ``None`` at ``cp_size`` 1. Collectives without it, or of one rank, raise
    ``ContractError`` only where the loss needs the sum (``docs/processors.md``)."""
    cp = ctx.parallel.cp_size
    if cp == 1:
        return None
    coll = ctx.collectives
    method = getattr(coll, "all_reduce_sum_context_parallel", None)
    one_rank = isinstance(coll, SingleProcessCollectives) or getattr(coll, "cp_size", None) == 1
    if callable(method) and not one_rank:
        return typing.cast(CpSum, method)
    need = count_read(config.aggregation)
    hint = "torch_impl builds it from Megatron's context-parallel group"
    if config.ratio == RatioLevel.SEQUENCE:
        what = "GSPO's sequence ratio (each sequence's mean log-ratio spans the ranks)"
    elif config.aggregation == Aggregation.SEQ_MEAN_TOKEN_MEAN:
        what = "seq-mean-token-mean (each sequence's token count spans the ranks)"
    elif need is not None and getattr(batch, need) is None:
        what = f"{config.aggregation.value} without context.{need}"
        hint += f"; or give context.{need}"
    else:
        return None
    raise ContractError(
        "collectives",
        expected=f"all_reduce_sum_context_parallel over the context-parallel group "
        f"(parallel.cp_size={cp}; hookspec.Collectives, spec 1.2) for {what}",
        actual=f"{coll!r}, which has none" if not callable(method) else f"{coll!r} (one rank)",
        hint=hint,
    )


def _rows(
    mask: torch.Tensor,
    weights: torch.Tensor,
    batch: PolicyBatch,
    *,
    old: torch.Tensor,
    is_weights: torch.Tensor | None,
) -> TokenRows:
    """The rows of ``mask``, ``weights``, the batch's tensors, the ratio's denominator
    ``old`` and the rollout correction's weights (each ``[b, s]``)."""
    device = mask.device
    mask_t = to_tokens(mask)
    return TokenRows(
        mask=mask_t,
        weights=to_tokens(weights),
        old=to_tokens(old).detach().to(device),
        is_weights=None if is_weights is None else to_tokens(is_weights).to(device),
        adv=torch.where(mask_t > 0, to_tokens(batch.advantages).detach().to(device), 0.0),
        ref=None
        if batch.ref_logprobs is None
        else to_tokens(batch.ref_logprobs).detach().to(device),
    )


@dataclasses.dataclass(frozen=True)
class TokenTerms:
    """The terms ``[r]`` of ``L = pg + kl_coef * kl - entropy_coef * entropy``, the
    ``logp`` and ``entropy`` they are of, and ``loss = sum(w * L)``. ``kl``: ``None``
    without ``ref_logprobs``; ``indicators``: the mode's per-token metric values
    (:class:`~._policy_terms.PgTerms`)."""

    loss: torch.Tensor
    pg: torch.Tensor
    kl: torch.Tensor | None
    indicators: dict[str, torch.Tensor]
    logp: torch.Tensor
    entropy: torch.Tensor


def token_terms(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    rows: TokenRows,
    config: PolicyLossConfig,
    whole: Batchwide | None = None,
    kl_logp: torch.Tensor | None = None,
) -> TokenTerms:
    """:class:`TokenTerms` of ``logp``, ``entropy`` ``[r]`` against ``rows`` by
    :class:`PolicyLossConfig`'s formula; ``whole``: what the modes reading other rows read
    (``None`` for the token-local modes, tile by tile); ``kl_logp``: the current logprob
    the KL reads (``None``: ``logp``; with a sampling support, the whole vocabulary's)."""
    terms = pg_terms(logp, rows, config, whole)
    pg = terms.pg
    if rows.is_weights is not None:  # the rollout correction's weights, detached
        pg = pg * rows.is_weights.to(logp.dtype)
    total = pg
    kl = None
    if rows.ref is not None:
        current = logp if kl_logp is None else kl_logp
        ref = torch.where(rows.mask > 0, rows.ref.to(logp.dtype), current.detach())
        kl = kl_terms(current, ref, config.kl_options)
        if config.kl_coef != 0.0:
            total = total + config.kl_coef * kl
    if config.entropy_coef != 0.0:
        total = total - config.entropy_coef * entropy
    loss = (total * rows.weights.to(logp.dtype)).sum()
    return TokenTerms(loss, pg, kl, terms.indicators, logp, entropy)


def _sequence_log_ratio(
    logp: torch.Tensor,
    old: torch.Tensor,
    mask: torch.Tensor,
    segments: torch.Tensor,
    count: int,
    cp_sum: CpSum | None,
    clamp: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GSPO's log-ratio ``[n]`` (``old``, ``mask``, ``segments``: ``[b, s]``) and, under context
    parallel, each sequence's ``n_k`` ``[count]`` over the group, made whole in one collective::

        num = segment_sum(M * (logp - old))    # [count]; logp - old not read where M == 0
        num, n = cp_sum(stack([num, segment_sum(M)]))
        log_ratio = clamp(num / n)[segments]   # 0 where n == 0
    """
    mask, segments = to_tokens(mask), to_tokens(segments)
    diff = (
        torch.where(mask > 0, logp - to_tokens(old).to(device=logp.device, dtype=logp.dtype), 0.0)
        * mask
    )
    num = segment_sum(diff, segments, count)
    den = segment_sum(mask.to(num.dtype), segments, count)
    if cp_sum is not None:
        num, den = cp_sum(torch.stack([num, den])).unbind(0)
    per_seq = num / torch.where(den == 0, 1.0, den)
    return symmetric_clamp(per_seq[segments], clamp), None if cp_sum is None else den.detach()


def _metrics(
    t: TokenTerms, rows: TokenRows, config: PolicyLossConfig, totals: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The loss and the detached metrics; ``totals``: the sequences' ``n_k`` over the
    context-parallel group, whose sum the means divide by (each rank's is its share)."""
    w, m = rows.weights.to(t.logp.dtype), rows.mask.to(t.logp.dtype)
    total = None if totals is None else totals.sum().to(m.dtype)
    logp, old = t.logp.detach(), rows.old.to(t.logp.dtype)
    approx_kl = kl_terms(logp, old, KLOptions(KLEstimator.K3, config.log_ratio_clamp))
    out = {
        # + 0 * sum(entropy): exact for a finite entropy; NaN where a hidden state
        # or the weight holds NaN/inf, even at an uncounted token.
        "loss": t.loss + 0.0 * t.entropy.detach().sum(),
        "pg_loss": weighted_sum(t.pg.detach(), w),
        "entropy": masked_mean(t.entropy.detach(), m, total),
        "approx_kl": masked_mean(approx_kl, m, total),
    }
    for name, values in t.indicators.items():
        out[name] = masked_mean(values.detach(), m, total)
    if t.kl is not None:
        out["kl"] = weighted_sum(t.kl.detach(), w)
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

        {"loss", "pg_loss", "kl", "entropy", "approx_kl", "ppo_kl", "clip_fraction",
         "dual_clip_fraction", "clip_fraction_lower"}

    ``loss`` is :class:`PolicyLossConfig`'s formula aggregated with its
    ``aggregation`` over the tokens of ``PolicyBatch.mask`` (the user context) whose
    label is not the ignore index; ``pg_loss`` and ``kl`` (with ``ref_logprobs``) are
    its terms aggregated alike. The rest are detached token means over the mask:
    ``entropy``, ``approx_kl`` = ``exp(old - logp) - (old - logp) - 1`` and the metrics veRL
    logs for the mode, where it has them: ``ppo_kl`` (``old - logp``; kl_cov ``|logp - old|``),
    ``clip_fraction`` (veRL's ``pg_clipfrac``), ``dual_clip_fraction`` (vanilla with
    ``dual_clip``) or ``clip_fraction_lower`` (dppo, geo_mean: veRL's ``pg_clipfrac_lower``).

    Args:
        config: a :class:`PolicyLossConfig`: the mode, clipping, KL, aggregation, rollout
            correction (``None``: ``PolicyLossConfig()``). The batch comes with each call, as
            the user context: a :class:`PolicyBatch`.
        tile_rows, tile_cols: the tiles, by :class:`LinearOptions`' names (``None``: the
            default per device); ``tile_cols`` only where autograd goes through
            :func:`linear_logprobs` (below).

    Returns:
        The processor (pass it as ``output_processor=``, with the :class:`PolicyBatch` as
        ``output_processor_context=``): called by the hook, it returns the dictionary of
        scalars above (each metric where the mode has it), with the ``rollout_corr/``
        metrics under a rollout correction and ``support/outside_fraction`` under a
        sampling support (:class:`PolicyBatch`).

    With ``config.fused``, a token-local mode and no sampling support (whose
    renormalisation needs the whole sweep first), the gradients are formed in the forward
    pass (tiles of ``tile_rows`` whole rows, by default ``TILE_BYTES`` of fp32 logits,
    32 MiB on a CPU and 256 MiB on CUDA); otherwise autograd goes through
    :func:`linear_logprobs` (tiles of ``tile_rows`` x ``tile_cols``). ``None``: the
    default per device (:class:`LinearOptions`).
    """
    config = PolicyLossConfig() if config is None else config
    check_instance("config", config, PolicyLossConfig, "a PolicyLossConfig")
    tile = factory_tiles("policy_loss", unexpected, None, tile_rows, tile_cols)

    @checked_call()
    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        call = _policy_call(ctx, config, tile)
        return _loss_path(config, replay=call.support is not None)(call, config)

    return processor(fn, name="policy_loss")


LossPath = Callable[["PolicyCall", PolicyLossConfig], dict[str, torch.Tensor]]


def _loss_path(config: PolicyLossConfig, *, replay: bool) -> LossPath:
    """The path a call takes: GSPO's sequence ratio (it reads whole sequences, through
    autograd); else the fused pass where :func:`takes_fused_path` and no sampling support
    is replayed (``replay``: its renormalisation needs the whole sweep), else autograd."""
    if config.ratio == RatioLevel.SEQUENCE:
        return _sequence_ratio_loss
    return _fused_loss if takes_fused_path(config) and not replay else _autograd_loss


def takes_fused_path(config: PolicyLossConfig) -> bool:
    """Whether the gradients are formed in the forward pass: ``config.fused``, a mode whose
    token term reads the token's own logprob alone (:attr:`PolicyLossConfig.is_token_local`:
    not GSPO's sequence ratio, Clip-Cov, KL-Cov, GMPO) and no bypass-mode correction (its
    weights and rejection read the current logprobs, which the fused pass forms tile by tile)."""
    bypass = config.rollout_correction is not None and config.rollout_correction.bypass_mode
    return config.fused and config.is_token_local and not bypass


@dataclasses.dataclass(frozen=True)
class PolicyCall:
    """One call's checked inputs, built once by :func:`_policy_call` for either path:
    the hook's tensors ``inputs``, the user context ``batch``, the context-parallel sum (or
    ``None``), the counted mask ``M`` ``[b, s]``, each token's sequence and their count,
    the tensor functions' options and the sampling support as rows (or ``None``)."""

    inputs: HookInputs
    batch: PolicyBatch
    cp_sum: CpSum | None
    mask: torch.Tensor
    segments: torch.Tensor
    count: int
    options: LinearOptions
    support: SamplingSupport | None = None


def _policy_call(ctx: OutputContext, config: PolicyLossConfig, tile: LinearOptions) -> PolicyCall:
    """1. the hook's tensors; 2. the user context, validated for ``config``; 3. the
    context-parallel sum the aggregation needs; 4. the counted mask (the context's, else
    the model's ``loss_mask``), the batch's values checked where counted (with a sampling
    support, ``old_logprobs`` and ``rollout_logprobs`` may be ``-inf``: outside it); 5. the
    sequences; 6. the options (temperature from the context); 7. the support as rows."""
    inputs = hook_inputs(ctx, "policy_loss")
    batch = _policy_batch(ctx, inputs.b, inputs.s, config)
    cp_sum = context_parallel_sum(config, batch, ctx)
    if batch.mask is None:
        given, field = ctx.loss_mask, "loss_mask"
    else:
        given, field = batch.mask, "context.mask"
    mask = counted_mask(ctx, inputs, given, field)
    replay = batch.sampling_support is not None
    if ctx.check_values:  # the mask's values at every token (above), the batch's where counted
        for name in ("old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs"):
            if (value := getattr(batch, name)) is not None:
                read = mask > 0
                if replay and name in ("old_logprobs", "rollout_logprobs"):
                    read = read & ~torch.isneginf(value.detach().to(read.device))
                check_finite_deferred(value, field=f"context.{name}", where=read)
    segments, count = sequence_ids(ctx, inputs.b, inputs.s, mask.device)
    options = inputs.tensor_options(tile, resolve_temperature(None, ctx, inputs.b, inputs.s))
    support = context_support(None, ctx, inputs.b, inputs.s)
    return PolicyCall(inputs, batch, cp_sum, mask, segments, count, options, support)


@dataclasses.dataclass(frozen=True)
class Corrected:
    """The mask after the rollout correction's rejection (``[b, s]``), the importance
    weights (``[b, s]``, detached; ``None``: none), the correction's metrics."""

    mask: torch.Tensor
    is_weights: torch.Tensor | None
    metrics: dict[str, torch.Tensor]


def _corrected(
    call: PolicyCall, config: PolicyLossConfig, current: torch.Tensor | None = None
) -> Corrected:
    """The rollout correction of ``config`` (none: the mask as it is). The decoupled PPO
    compares ``old_logprobs`` with ``rollout_logprobs``; bypass mode the ``current``
    logprobs ``[b, s]`` (detached) with ``rollout_logprobs``."""
    correction = config.rollout_correction
    if correction is None:
        return Corrected(call.mask, None, {})
    if call.cp_sum is not None and spans_sequences(correction):
        raise ContractError(
            "rollout_correction",
            expected="token-level weights and rejection under context parallel (a sequence's "
            "tokens are split over the ranks)",
            actual=f"rollout_is={correction.rollout_is}, "
            f"rollout_rs={sorted(correction.rollout_rs)}",
        )
    rollout = typing.cast(torch.Tensor, call.batch.rollout_logprobs).to(call.mask.device)
    behaviour = current if correction.bypass_mode else call.batch.old_logprobs
    behaviour = typing.cast(torch.Tensor, behaviour).detach().to(call.mask.device)
    result = rollout_correction(
        behaviour, rollout, call.mask, call.segments, call.count, correction
    )
    mask = call.mask * result.keep.to(call.mask.dtype)
    metrics = {f"rollout_corr/{k}": v.detach() for k, v in result.metrics.items()}
    # bypass PPO-clip: the ratio is already pi / pi_rollout; weights would count it twice
    clip_only = correction.bypass_mode and correction.loss_type == "ppo_clip"
    return Corrected(mask, None if clip_only else result.weights, metrics)


def spans_sequences(correction: RolloutCorrection) -> bool:
    """Whether a weight or a rejection statistic reads a whole sequence."""
    level = correction.rollout_is
    by_sequence = level is not None and level != WeightLevel.TOKEN
    return by_sequence or any(not name.startswith("token") for name in correction.rollout_rs)


def _token_rows(
    call: PolicyCall,
    config: PolicyLossConfig,
    corrected: Corrected,
    totals: torch.Tensor | None,
) -> TokenRows:
    """The aggregation's weights over the corrected mask, and the batch as rows."""
    mask, batch = corrected.mask, call.batch
    weights = weights_of(
        mask,
        call.segments,
        call.count,
        config.aggregation,
        **global_counts(batch),
        totals=totals,
        loss_scale_factor=config.loss_scale_factor,
    )
    return _rows(
        mask, weights, batch, old=behaviour_logprobs(batch, config), is_weights=corrected.is_weights
    )


def behaviour_logprobs(batch: PolicyBatch, config: PolicyLossConfig) -> torch.Tensor:
    """The ratio's denominator: ``old_logprobs``, or ``rollout_logprobs`` in bypass mode."""
    correction = config.rollout_correction
    if correction is not None and correction.bypass_mode:
        return typing.cast(torch.Tensor, batch.rollout_logprobs)
    return typing.cast(torch.Tensor, batch.old_logprobs)


def _token_totals(call: PolicyCall, mask: torch.Tensor) -> torch.Tensor | None:
    """Under context parallel, each sequence's token count over the group (one collective)."""
    if call.cp_sum is None:
        return None
    return call.cp_sum(segment_sum(mask, call.segments, call.count))


def _fused_loss(call: PolicyCall, config: PolicyLossConfig) -> dict[str, torch.Tensor]:
    """The fused path: a token-local mode, the correction read from the batch alone, the
    gradients formed in the forward pass tile by tile (three GEMM-equivalents). It exists
    because it saves the fourth GEMM, the logits' recomputation in backward."""
    corrected = _corrected(call, config)
    totals = _token_totals(call, corrected.mask)
    rows = _token_rows(call, config, corrected, totals)

    def tile_loss(logp: torch.Tensor, entropy: torch.Tensor, tile: slice) -> torch.Tensor:
        return token_terms(logp, entropy, rows.take(tile), config).loss

    inputs = call.inputs
    result = fused_token_loss(
        inputs.hidden,
        inputs.weight,
        inputs.token_labels,
        tile_loss,
        options=call.options,
        entropy_grad=config.entropy_coef != 0.0,
    )
    terms = token_terms(result.logprobs, result.entropy, rows, config)
    terms = dataclasses.replace(terms, loss=result.loss)  # the loss with the fused gradients
    return _metrics(terms, rows, config, totals) | corrected.metrics


def _autograd_loss(call: PolicyCall, config: PolicyLossConfig) -> dict[str, torch.Tensor]:
    """The autograd path of a token ratio through :func:`linear_logprobs` (four
    GEMM-equivalents, the logits recomputed in backward). It exists for the modes reading
    other tokens (``gspo``, ``clip_cov``, ``kl_cov``, ``geo_mean``), for a bypass-mode correction
    (its weights and rejection read the current logprobs before the loss), for a sampling
    support (its renormalisation needs the whole sweep) and for ``fused=False``."""
    call, current, outside = _inside_support(call, _current_logprobs(call, config))
    logp, inputs = current.logp, call.inputs
    corrected = _corrected(call, config, current=from_tokens(logp.detach(), inputs.b, inputs.s))
    totals = _token_totals(call, corrected.mask)
    whole = Batchwide(to_tokens(call.segments), call.count, call.cp_sum)
    rows = _token_rows(call, config, corrected, totals)
    terms = token_terms(logp, current.entropy, rows, config, whole, current.kl_logp)
    return _metrics(terms, rows, config, totals) | corrected.metrics | outside


def _sequence_ratio_loss(call: PolicyCall, config: PolicyLossConfig) -> dict[str, torch.Tensor]:
    """GSPO's path (``RatioLevel.SEQUENCE``), through :func:`linear_logprobs` as
    :func:`_autograd_loss`. It exists because the sequence ratio reads every token of a
    sequence: under context parallel one collective makes each sequence's log-ratio sum
    and token count whole (:func:`_sequence_log_ratio`), and the counts then weigh the
    aggregation."""
    call, current, outside = _inside_support(call, _current_logprobs(call, config))
    logp, inputs = current.logp, call.inputs
    corrected = _corrected(call, config, current=from_tokens(logp.detach(), inputs.b, inputs.s))
    old = behaviour_logprobs(call.batch, config)
    log_ratio, totals = _sequence_log_ratio(
        logp, old, corrected.mask, call.segments, call.count, call.cp_sum, config.log_ratio_clamp
    )
    whole = Batchwide(to_tokens(call.segments), call.count, call.cp_sum, log_ratio)
    rows = _token_rows(call, config, corrected, totals)
    terms = token_terms(logp, current.entropy, rows, config, whole, current.kl_logp)
    return _metrics(terms, rows, config, totals) | corrected.metrics | outside


@dataclasses.dataclass(frozen=True)
class Current:
    """The current policy's logprobs and entropies ``[n]``, differentiable (on the sampling
    support where there is one), and the logprobs the KL reads (``None``: the same)."""

    logp: torch.Tensor
    entropy: torch.Tensor
    kl_logp: torch.Tensor | None = None


def _current_logprobs(call: PolicyCall, config: PolicyLossConfig) -> Current:
    """The current policy, the logits recomputed in backward: the one place the autograd
    paths form it (with a support, the whole vocabulary's logprob from the same sweep)."""
    inputs = call.inputs
    result = linear_logprobs(
        inputs.hidden,
        inputs.weight,
        inputs.token_labels,
        options=call.options,
        with_entropy=True,
        support=call.support,
    )
    entropy = typing.cast(torch.Tensor, result.entropy)
    if call.support is None or config.reference_on_support:
        return Current(result.logprobs, entropy)
    return Current(result.logprobs, entropy, result.vocab_logprobs)


def _inside_support(
    call: PolicyCall, current: Current
) -> tuple[PolicyCall, Current, dict[str, torch.Tensor]]:
    """With a sampling support: the call whose mask leaves out the counted tokens outside
    it (the current logprob ``-inf``, or ``old_logprobs`` or ``rollout_logprobs``), the
    current policy with 0 for its ``-inf`` (no longer read; no gradient there), and their
    share of the counted tokens, ``support/outside_fraction``. Without one, as they are."""
    if call.support is None:
        return call, current, {}
    inputs, batch, counted = call.inputs, call.batch, call.mask > 0
    missing = torch.isneginf(current.logp.detach())
    outside = from_tokens(missing, inputs.b, inputs.s).to(counted.device)
    for given in (batch.old_logprobs, batch.rollout_logprobs):
        if given is not None:
            outside = outside | torch.isneginf(given.detach().to(counted.device))
    outside = outside & counted
    fraction = masked_mean(outside.to(current.logp.dtype), call.mask.to(current.logp.dtype))
    call = dataclasses.replace(call, mask=torch.where(outside, 0.0, call.mask))
    logp = torch.where(missing, 0.0, current.logp)
    kl_logp = None if current.kl_logp is None else torch.where(missing, 0.0, current.kl_logp)
    return call, Current(logp, current.entropy, kl_logp), {"support/outside_fraction": fraction}

"""The policy-loss processor: :class:`PolicyBatch` (its user context) and
:func:`policy_loss`, on the formulas of :mod:`._policy_math`.

What each input may hold, one rule per kind of input (tested in
``tests/test_validation_processors.py``):

- The mask ``M`` (``PolicyBatch.mask``, else the model's ``loss_mask``) is read
  at every token: an entry that is NaN, infinite or negative, wherever it is,
  makes the loss and every metric NaN. Only a mask summing to exactly 0 is
  empty (loss 0, zero gradient).
- The batch's per-token values (``old_logprobs``, ``advantages``,
  ``ref_logprobs``) are read at counted tokens only (``M > 0`` and a label
  that is not the ignore index): a NaN or inf elsewhere changes nothing; at a
  counted token it makes the loss NaN.
- The model's outputs (hidden states, output weight) are read at every token:
  a NaN or inf anywhere, counted or not, makes the loss NaN (its gradient
  would be NaN anyway: the tile products reach every row of the weight).
- Numbers (``global_tokens``, ``global_sequences``, a scalar temperature) and
  a per-token temperature are checked where they enter: ``ContractError``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping

import torch

from hookspec import Aggregation, ContractError, KLEstimator, OutputContext, Processor, processor
from hookspec.arrays import format_shape

from ._checks import check_finite_number, check_floating, check_int
from ._fused import FUSED_TILE_ELEMENTS, fused_token_loss
from ._inputs import HookInputs, Tile, from_tokens, hook_inputs, resolve_temperature, tile_options, to_tokens
from ._logprobs import linear_logprobs
from ._policy_math import (
    PolicyLossConfig,
    RatioLevel,
    check_unused_count,
    kl_terms,
    ppo_token_loss,
    sequence_log_ratio,
    weights_of,
)

__all__ = [
    "PolicyBatch",
    "TokenTerms",
    "policy_loss",
    "sequence_ids",
]


@dataclasses.dataclass(frozen=True)
class PolicyBatch:
    """The user context of :func:`policy_loss` (pass it as ``output_processor_context``).

    Per-token fields are ``[b, s]``, like ``labels``:

    - ``old_logprobs``: the behaviour policy's logprobs (ratio denominator).
    - ``advantages``: per token (broadcast a per-sequence advantage yourself).
    - ``mask``: which tokens count, as weights (bool, or numbers ``>= 0``);
      ``None``: the model's ``loss_mask``, else every token. Tokens labelled
      ``ignore_index`` never count. A NaN, infinite or negative entry makes
      the loss NaN (never "empty").
    - ``ref_logprobs``: the reference policy's logprobs, needed when ``kl_coef != 0``.
    - ``temperature``: the sampling temperature, a number or ``[b, s]``.
    - ``global_tokens`` / ``global_sequences``: the token / sequence counts of
      the whole loss when it is split over ranks (context or data parallel),
      finite numbers ``> 0`` (Python or NumPy, not tensors: ``.item()``):
      they replace the local ``sum(mask)`` / number of sequences in the
      aggregation, so that the ranks' losses sum to the global loss. Give the
      one the aggregation reads (token-mean: ``global_tokens``; the sequence
      means: ``global_sequences``): the other is refused, not ignored.

    The values of ``old_logprobs``, ``advantages`` and ``ref_logprobs`` at
    tokens that do not count are never read.
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
            _check_bs(f"context.{name}", value, b, s)
        if self.mask is not None:
            if not isinstance(self.mask, torch.Tensor):
                raise ContractError(
                    "context.mask", expected="a tensor [b, s]", actual=type(self.mask).__name__
                )
            _check_bs("context.mask", self.mask, b, s)
        for name in ("global_tokens", "global_sequences"):
            value = getattr(self, name)
            if value is not None:
                check_finite_number(f"context.{name}", value, low=0.0, low_open=True)


def _check_bs(field: str, value: torch.Tensor, b: int, s: int) -> None:
    if tuple(value.shape) != (b, s):
        raise ContractError(
            field, expected=f"shape [b={b}, s={s}] like labels", actual=format_shape(value.shape)
        )


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


def sequence_ids(ctx: OutputContext, b: int, s: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """``(segments [b, s], count)``: each token's sequence. A row per sequence,
    or, for packed (THD) input, the sequences of ``packed_seq_params``
    (``cu_seqlens_q_padded``, else ``cu_seqlens_q``, divided by the context
    parallel size: each rank holds ``1/cp`` of every sequence); tokens past the
    last boundary form one more segment."""
    psp = ctx.packed_seq_params
    if psp is None:
        return torch.arange(b, device=device)[:, None].expand(b, s), b
    cu = getattr(psp, "cu_seqlens_q_padded", None)
    if cu is None:
        cu = getattr(psp, "cu_seqlens_q", None)
    if cu is None or b != 1:
        raise ContractError(
            "packed_seq_params",
            expected="cu_seqlens_q with batch 1 (THD)",
            actual=f"batch {b}, cu_seqlens {cu}",
        )
    bounds = (cu.to(device=device, dtype=torch.long) // ctx.parallel.cp_size)[1:]
    seg = torch.bucketize(torch.arange(s, device=device), bounds, right=True)
    return seg[None, :], int(bounds.numel()) + 1


def _check_cp(config: PolicyLossConfig, batch: PolicyBatch, cp: int) -> None:
    if cp == 1:
        return
    if config.ratio == RatioLevel.SEQUENCE or config.aggregation == Aggregation.SEQ_MEAN_TOKEN_MEAN:
        raise ContractError(
            "parallel.cp_size",
            expected="1 for GSPO and seq-mean-token-mean (they need whole sequences)",
            actual=cp,
        )
    need = "global_tokens" if config.aggregation == Aggregation.TOKEN_MEAN else "global_sequences"
    if getattr(batch, need) is None:
        raise ContractError(
            f"context.{need}",
            expected=f"the count over the context-parallel ranks (cp={cp}), so that their losses sum",
            actual="None",
        )


def _counted(
    given: torch.Tensor | None, labels: torch.Tensor, ignore_index: int, dtype: torch.dtype
) -> torch.Tensor:
    """The mask ``M`` ``[b, s]``: ``given`` (every token when ``None``), 0 where the
    label is the ignore index. An entry that is not a finite number ``>= 0`` becomes
    NaN, wherever it is (also at an ignored label), so that the loss shows it."""
    if given is None:
        ones = torch.ones(labels.shape, dtype=dtype, device=labels.device)
        return torch.where(labels == ignore_index, 0.0, ones)
    m = given.to(device=labels.device, dtype=dtype)
    m = torch.where(torch.isfinite(m) & (m >= 0), m, float("nan"))
    return torch.where(labels == ignore_index, m * 0.0, m)


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
        return TokenRows(
            mask=self.mask[rows],
            weights=self.weights[rows],
            old=self.old[rows],
            adv=self.adv[rows],
            ref=None if self.ref is None else self.ref[rows],
        )


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


def _weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum(w * x)``, ``x`` not read where ``w == 0`` (a NaN weight gives NaN)."""
    return (torch.where(w != 0, x, 0.0) * w).sum()


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``sum(x * m) / sum(m)`` over ``m > 0``; ``0`` when ``sum(m)`` is exactly 0.
    ``x`` where ``m == 0`` is not read; NaN at a counted token, or in ``m``, gives NaN."""
    total = m.sum()
    x = torch.where(m > 0, x.to(m.dtype), 0.0)
    return (x * m).sum() / torch.where(total == 0, 1.0, total)


# ---------------------------------------------------------------- the processor


@dataclasses.dataclass(frozen=True)
class _Pass:
    """What one pass (fused or autograd) returns: the loss, its per-token inputs
    ``[n]`` (detached or not) and terms."""

    loss: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    terms: TokenTerms


def _rows(
    ctx: OutputContext, x: HookInputs, config: PolicyLossConfig, batch: PolicyBatch
) -> tuple[TokenRows, torch.Tensor, torch.Tensor, int]:
    """``(rows, M [b, s], segments [b, s], count)`` of a checked batch."""
    device = x.hidden.device
    given = batch.mask if batch.mask is not None else typing.cast("torch.Tensor | None", ctx.loss_mask)
    acc = torch.float64 if x.hidden.dtype == torch.float64 else torch.float32
    mask = _counted(given, typing.cast(torch.Tensor, ctx.labels).to(device), ctx.ignore_index, acc)
    segments, count = sequence_ids(ctx, x.b, x.s, device)
    check_unused_count(
        config.aggregation,
        global_tokens=batch.global_tokens,
        global_sequences=batch.global_sequences,
        prefix="context.",
    )
    weights = weights_of(
        mask,
        segments,
        count,
        config.aggregation,
        global_tokens=batch.global_tokens,
        global_sequences=batch.global_sequences,
    )
    mask_t = to_tokens(mask)
    rows = TokenRows(
        mask=mask_t,
        weights=to_tokens(weights),
        old=to_tokens(batch.old_logprobs).detach().to(device),
        adv=torch.where(mask_t > 0, to_tokens(batch.advantages).detach().to(device), 0.0),
        ref=None if batch.ref_logprobs is None else to_tokens(batch.ref_logprobs).detach().to(device),
    )
    return rows, mask, segments, count


def _fused_pass(
    x: HookInputs,
    rows: TokenRows,
    config: PolicyLossConfig,
    temperature: float | torch.Tensor,
    tile_elements: int,
) -> _Pass:
    """Gradients formed in the forward pass, tile by tile (``fused_token_loss``)."""

    def tile_loss(lp: torch.Tensor, ent: torch.Tensor, sl: slice) -> torch.Tensor:
        part = rows.take(sl)
        return (token_terms(lp, ent, part, config).loss * part.weights.to(lp.dtype)).sum()

    res = fused_token_loss(
        x.hidden,
        x.weight,
        x.labels,
        tile_loss,
        temperature=temperature,
        tile_elements=tile_elements,
        **x.kwargs,
    )
    terms = token_terms(res.logprobs, res.entropy, rows, config)
    return _Pass(loss=res.loss, logp=res.logprobs, entropy=res.entropy, terms=terms)


def _autograd_pass(
    x: HookInputs,
    rows: TokenRows,
    config: PolicyLossConfig,
    temperature: float | torch.Tensor,
    tile: Tile,
    seq: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None,
) -> _Pass:
    """Autograd through ``linear_logprobs`` (logits recomputed in backward);
    ``seq``: ``(old [b, s], M [b, s], segments, count)`` for GSPO's sequence ratio."""
    lr = linear_logprobs(
        x.hidden,
        x.weight,
        x.labels,
        temperature=temperature,
        with_entropy=True,
        vocab_chunk_size=tile.vocab_chunk_size,
        token_chunk_size=tile.token_chunk_size,
        **x.kwargs,
    )
    logp, entropy = lr.logprobs, typing.cast(torch.Tensor, lr.entropy)
    log_ratio = None
    if seq is not None:
        old, mask, segments, count = seq
        log_ratio = to_tokens(
            sequence_log_ratio(
                from_tokens(logp, x.b, x.s),
                old.to(device=logp.device, dtype=logp.dtype),
                mask,
                segments,
                count,
                clamp=config.log_ratio_clamp,
            )
        )
    terms = token_terms(logp, entropy, rows, config, log_ratio=log_ratio)
    loss = (terms.loss * rows.weights.to(logp.dtype)).sum()
    return _Pass(loss=loss, logp=logp, entropy=entropy, terms=terms)


def _metrics(p: _Pass, rows: TokenRows, config: PolicyLossConfig) -> dict[str, torch.Tensor]:
    """The loss (NaN when a model output anywhere is: see the module docstring)
    and the detached metrics."""
    w = rows.weights.to(p.logp.dtype)
    m = rows.mask.to(p.logp.dtype)
    logp, old = p.logp.detach(), rows.old.to(p.logp.dtype)
    approx_kl = kl_terms(logp, old, KLEstimator.K3, clamp=config.log_ratio_clamp)
    out = {
        # + 0 * sum(entropy): exact for a finite entropy; NaN where a hidden state
        # or the weight holds NaN/inf, even at an uncounted token.
        "loss": p.loss + 0.0 * p.entropy.detach().sum(),
        "pg_loss": _weighted_sum(p.terms.pg.detach(), w),
        "entropy": _masked_mean(p.entropy.detach(), m),
        "clip_fraction": _masked_mean(p.terms.clipped, m),
        "approx_kl": _masked_mean(approx_kl, m),
    }
    if p.terms.kl is not None:
        out["kl"] = _weighted_sum(p.terms.kl.detach(), w)
    if p.terms.dual is not None:
        out["dual_clip_fraction"] = _masked_mean(p.terms.dual, m)
    return out


def policy_loss(
    config: PolicyLossConfig | None = None,
    /,
    *,
    vocab_chunk_size: int | None = None,
    token_chunk_size: int | None = None,
    fused_tile_elements: int = FUSED_TILE_ELEMENTS,
    chunk_size: int | None = None,
) -> Processor:
    """A processor returning the policy loss and its metrics, each a scalar::

        {"loss", "pg_loss", "kl", "entropy", "clip_fraction", "dual_clip_fraction",
         "approx_kl"}

    ``loss`` is :class:`PolicyLossConfig`'s formula aggregated with its
    ``aggregation``, over the tokens of ``PolicyBatch.mask`` (the user context)
    whose label is not the ignore index. ``pg_loss`` and ``kl`` are its terms,
    aggregated the same way (``kl`` only with ``ref_logprobs``). The metrics are
    token means over the mask, detached: ``entropy``; ``clip_fraction`` (the
    clipped branch taken); ``dual_clip_fraction`` (with ``dual_clip``);
    ``approx_kl`` = k3 between the old and the current policy,
    ``exp(old - logp) - (old - logp) - 1``.

    With ``config.fused`` and a token ratio, the gradients are formed in the
    forward pass (no logits recomputed, ``fused_tile_elements`` logits a
    tile); otherwise logprobs and entropy come from :func:`linear_logprobs`
    (tile ``vocab_chunk_size`` x ``token_chunk_size``, default per device;
    ``chunk_size``: the deprecated name of ``vocab_chunk_size``) and autograd
    goes through them. Bad values: see this module's docstring.
    """
    config = PolicyLossConfig() if config is None else config
    if not isinstance(config, PolicyLossConfig):
        raise ContractError("config", expected="a PolicyLossConfig", actual=type(config).__name__)
    tile = tile_options(
        vocab_chunk_size=vocab_chunk_size, token_chunk_size=token_chunk_size, chunk_size=chunk_size
    )
    tile_elements = check_int("fused_tile_elements", fused_tile_elements, low=1)
    fused = config.fused and config.ratio == RatioLevel.TOKEN

    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        x = hook_inputs(ctx, "policy_loss")
        batch = _policy_batch(ctx)
        batch.validate(x.b, x.s, need_ref=config.kl_coef != 0.0)
        _check_cp(config, batch, ctx.parallel.cp_size)
        rows, mask, segments, count = _rows(ctx, x, config, batch)
        temperature = resolve_temperature(None, ctx, x.b, x.s)
        if fused:
            p = _fused_pass(x, rows, config, temperature, tile_elements)
        else:
            seq = (batch.old_logprobs, mask, segments, count) if config.ratio == RatioLevel.SEQUENCE else None
            p = _autograd_pass(x, rows, config, temperature, tile, seq)
        return _metrics(p, rows, config)

    return processor(fn, name="policy_loss")

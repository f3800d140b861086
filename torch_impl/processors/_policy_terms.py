"""The policy-gradient term ``pg`` of each :class:`PolicyLossMode`, per token row, with the
per-token indicators whose masked means are the metrics veRL logs for it (the formulas:
``hookspec.conventions``). The token-local modes read each row's own logprob only, so the
fused path calls them tile by tile; the others read the rows together (:class:`Batchwide`)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable

import torch

from ._loss_math import (
    PolicyLossConfig,
    PolicyLossMode,
    masked_mean,
    segment_sum,
    symmetric_clamp,
)

__all__ = ["Batchwide", "CpSum", "PgTerms", "TokenRows", "pg_terms"]

CpSum = Callable[[torch.Tensor], torch.Tensor]

BINARY_KL_EPS = 1e-8
"""DPPO-KL's ``eps`` in ``log((1 - p_old + eps) / (1 - p + eps))`` (veRL's; finite at ``p = 1``)."""


@dataclasses.dataclass(frozen=True)
class TokenRows:
    """The batch as hidden-state rows ``[n]`` (``s``-major), checked and detached:
    ``mask`` ``M`` (NaN where an entry is bad), ``weights`` ``w`` (``loss = sum(w * L)``),
    ``old``, ``adv`` (0 where ``M == 0``), ``ref``, the rollout correction's weights."""

    mask: torch.Tensor
    weights: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    ref: torch.Tensor | None
    is_weights: torch.Tensor | None = None

    def take(self, rows: slice) -> TokenRows:
        """The rows ``rows`` of every field."""
        fields: dict[str, typing.Any] = {
            k: None if v is None else v[rows] for k, v in vars(self).items()
        }
        return TokenRows(**fields)


@dataclasses.dataclass(frozen=True)
class Batchwide:
    """What a mode reading other rows needs: each row's sequence ``segments`` ``[n]`` and
    their ``count``, the context-parallel sum (``None`` at cp 1), and vanilla's sequence
    log-ratio ``[n]`` (``RatioLevel.SEQUENCE``; ``None``: the token one)."""

    segments: torch.Tensor
    count: int
    cp_sum: CpSum | None = None
    log_ratio: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class PgTerms:
    """``pg`` ``[r]``, and ``indicators``: per-token values ``[r]`` whose token means over
    ``M`` are the mode's metrics (``clip_fraction``, ``ppo_kl``, ...)."""

    pg: torch.Tensor
    indicators: dict[str, torch.Tensor]


Mode = Callable[[torch.Tensor, TokenRows, PolicyLossConfig, Batchwide | None], PgTerms]


def pg_terms(
    logp: torch.Tensor, rows: TokenRows, config: PolicyLossConfig, whole: Batchwide | None
) -> PgTerms:
    """The mode's ``pg`` of ``logp`` ``[r]`` against ``rows``; ``whole`` is read by the
    modes that are not token-local (``None`` on the fused path, which never takes them)."""
    correction = config.rollout_correction
    if correction is not None and correction.loss_type == "reinforce":
        return _gpg(logp, rows, config, whole)  # bypass REINFORCE: -A * logp, weighted
    return MODES[config.loss_mode](logp, rows, config, whole)


def _diff(logp: torch.Tensor, rows: TokenRows) -> torch.Tensor:
    """``logp - old``, 0 where ``M == 0`` (not read there)."""
    return torch.where(rows.mask > 0, logp - rows.old.to(logp.dtype), 0.0)


def _clip_branches(
    ratio: torch.Tensor, adv: torch.Tensor, config: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``."""
    low, high = 1.0 - config.clip_low, 1.0 + config.effective_clip_high
    return -adv * ratio, -adv * ratio.clamp(low, high)


def _vanilla(
    logp: torch.Tensor, rows: TokenRows, config: PolicyLossConfig, whole: Batchwide | None
) -> PgTerms:
    """``pg = max(-A r, -A clip(r))``, then ``min(pg, -A * dual_clip)`` where ``A < 0``."""
    diff = _diff(logp, rows)
    log_ratio = None if whole is None else whole.log_ratio
    log_ratio = symmetric_clamp(diff, config.log_ratio_clamp) if log_ratio is None else log_ratio
    adv = rows.adv.to(logp.dtype)
    pg1, pg2 = _clip_branches(torch.exp(log_ratio), adv, config)
    pg = torch.maximum(pg1, pg2)
    out = {"clip_fraction": pg2 > pg1, "ppo_kl": -log_ratio.detach()}
    if config.dual_clip is not None:
        pg3 = -adv * config.dual_clip
        out["dual_clip_fraction"] = (adv < 0) & (pg > pg3)
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
    return PgTerms(pg, out)


def _gspo_token(
    logp: torch.Tensor, rows: TokenRows, config: PolicyLossConfig, whole: Batchwide | None
) -> PgTerms:
    """GSPO-token: ``log s = sg(seq_mean_M(logp - old)) + logp - sg(logp)`` (clamped),
    ``pg = max(-A s, -A clip(s))``; the gradient per token is its own ``-A s dlogp``."""
    whole = typing.cast(Batchwide, whole)
    diff = _diff(logp, rows)
    m = rows.mask.to(logp.dtype)
    num = segment_sum(diff.detach() * m, whole.segments, whole.count)
    den = segment_sum(m, whole.segments, whole.count)
    if whole.cp_sum is not None:
        num, den = whole.cp_sum(torch.stack([num, den])).unbind(0)
    seq = (num / den.clamp_min(1.0))[whole.segments]
    log_s = symmetric_clamp(logp - logp.detach() + seq, config.log_ratio_clamp)
    pg1, pg2 = _clip_branches(torch.exp(log_s), rows.adv.to(logp.dtype), config)
    return PgTerms(torch.maximum(pg1, pg2), {"clip_fraction": pg2 > pg1, "ppo_kl": -diff.detach()})


def _dppo(
    logp: torch.Tensor, rows: TokenRows, config: PolicyLossConfig, whole: Batchwide | None
) -> PgTerms:
    """DPPO: ``pg = -A * sg(min(r, c)) * logp * valid``, ``valid`` (detached) where the step
    stays in the trust region: ``dppo_tv`` ``p - p_old <= clip_high`` (``A > 0``) or
    ``>= -clip_low``; ``dppo_kl`` the binary KL ``<= clip_high`` or ``p <= p_old`` (``A > 0``),
    ``<= clip_low`` or ``p >= p_old`` (else). ``c``: :attr:`PolicyLossConfig.dppo_truncation`."""
    live, diff = rows.mask > 0, _diff(logp, rows)
    log_ratio = symmetric_clamp(diff, config.log_ratio_clamp).detach()
    ratio, adv = torch.exp(log_ratio), rows.adv.to(logp.dtype)
    lp, old = logp.detach(), rows.old.to(logp.dtype)
    p, p_old = torch.exp(lp), torch.exp(old)
    high, low = config.effective_clip_high, config.clip_low
    if config.loss_mode == PolicyLossMode.DPPO_TV:
        up, down = p - p_old <= high, p - p_old >= -low
    else:
        eps = BINARY_KL_EPS
        binary_kl = p_old * (old - lp) + (1 - p_old) * torch.log((1 - p_old + eps) / (1 - p + eps))
        up, down = (binary_kl <= high) | (p <= p_old), (binary_kl <= low) | (p >= p_old)
    valid = torch.where(adv > 0, up, down).to(logp.dtype)
    c = config.dppo_truncation
    pg = -adv * ratio.clamp(max=c) * torch.where(live, logp, 0.0) * valid
    out = {"clip_fraction": 1.0 - valid, "clip_fraction_lower": (ratio > c) * valid}
    return PgTerms(pg, out | {"ppo_kl": -log_ratio})


def _sapo(
    logp: torch.Tensor, rows: TokenRows, config: PolicyLossConfig, whole: Batchwide | None
) -> PgTerms:
    """SAPO: ``pg = -A * sigmoid(tau * (r - 1)) * 4 / tau``, ``tau = tau_pos`` where
    ``A > 0`` else ``tau_neg``."""
    diff = _diff(logp, rows)
    log_ratio = symmetric_clamp(diff, config.log_ratio_clamp)
    adv = rows.adv.to(logp.dtype)
    tau_pos, tau_neg = (torch.full_like(adv, t) for t in (config.tau_pos, config.tau_neg))
    tau = torch.where(adv > 0, tau_pos, tau_neg)  # in adv's dtype (two scalars: float32)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    return PgTerms(-gate * adv, {"ppo_kl": -log_ratio.detach()})


def _gpg(
    logp: torch.Tensor, rows: TokenRows, config: PolicyLossConfig, whole: Batchwide | None
) -> PgTerms:
    """GPG (and bypass-mode REINFORCE): ``pg = -A * logp``, no ratio, no clip."""
    live, diff = rows.mask > 0, _diff(logp, rows)
    pg = -rows.adv.to(logp.dtype) * torch.where(live, logp, 0.0)
    return PgTerms(pg, {"ppo_kl": -diff.detach()})


def _dro(
    logp: torch.Tensor, rows: TokenRows, config: PolicyLossConfig, whole: Batchwide | None
) -> PgTerms:
    """DRO: ``pg = -(A * logp - dro_beta / 2 * (logp - old) ** 2)``."""
    live, diff = rows.mask > 0, _diff(logp, rows)
    beta = typing.cast(float, config.dro_beta)
    adv = rows.adv.to(logp.dtype)
    pg = -(adv * torch.where(live, logp, 0.0) - 0.5 * beta * diff.square())
    return PgTerms(pg, {"ppo_kl": -diff.detach()})


def _cispo(
    logp: torch.Tensor, rows: TokenRows, config: PolicyLossConfig, whole: Batchwide | None
) -> PgTerms:
    """CISPO: ``pg = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp``."""
    live, diff = rows.mask > 0, _diff(logp, rows)
    log_ratio = symmetric_clamp(diff, config.log_ratio_clamp).detach()
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - config.clip_low, 1.0 + config.effective_clip_high)
    pg = -clipped * rows.adv.to(logp.dtype) * torch.where(live, logp, 0.0)
    return PgTerms(pg, {"clip_fraction": ratio != clipped, "ppo_kl": -log_ratio})


def _top_rows(score: torch.Tensor, eligible: torch.Tensor, k: int) -> torch.Tensor:
    """A boolean ``[r]``: the ``k`` eligible rows of largest ``score`` (all if fewer)."""
    ranked = torch.where(eligible, score, -torch.inf)
    k = min(k, int(eligible.sum()))
    chosen = torch.zeros_like(eligible)
    if k > 0:
        chosen[torch.topk(ranked, k).indices] = True
    return chosen


def _clip_cov(
    logp: torch.Tensor, rows: TokenRows, config: PolicyLossConfig, whole: Batchwide | None
) -> PgTerms:
    """Clip-Cov: PPO clip without the dual clip, its loss set to 0 at ``max(1,
    int(clip_cov_ratio * sum(M)))`` unclipped tokens of covariance in ``(clip_cov_lb,
    clip_cov_ub)``, those of largest covariance ``(A - mean_M(A)) * (logp - mean_M(logp))``."""
    live, diff = rows.mask > 0, _diff(logp, rows)
    log_ratio = symmetric_clamp(diff, config.log_ratio_clamp)
    adv, m = rows.adv.to(logp.dtype), rows.mask.to(logp.dtype)
    pg1, pg2 = _clip_branches(torch.exp(log_ratio), adv, config)
    lp = torch.where(live, logp.detach(), 0.0)
    cov = (adv - masked_mean(adv, m)) * (lp - masked_mean(lp, m))
    inside = (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    eligible = live & ~(pg2 > pg1) & inside
    count = max(int(config.clip_cov_ratio * float(m.sum())), 1)
    dropped = _top_rows(cov, eligible, count)
    pg = torch.where(dropped, 0.0, torch.maximum(pg1, pg2))
    return PgTerms(pg, {"clip_fraction": dropped, "ppo_kl": -diff.detach()})


def _kl_cov(
    logp: torch.Tensor, rows: TokenRows, config: PolicyLossConfig, whole: Batchwide | None
) -> PgTerms:
    """KL-Cov: ``pg = -A * r``, plus ``ppo_kl_coef * |logp - old|`` at the ``max(1,
    int(kl_cov_ratio * n))`` counted tokens of largest ``(A - mean(A)) * (logp - mean(logp))``
    (means over the ``n`` counted tokens)."""
    live, diff = rows.mask > 0, _diff(logp, rows)
    log_ratio = symmetric_clamp(diff, config.log_ratio_clamp)
    adv, counted = rows.adv.to(logp.dtype), live.to(logp.dtype)
    lp = torch.where(live, logp.detach(), 0.0)
    cov = (adv - masked_mean(adv, counted)) * (lp - masked_mean(lp, counted))
    n = int(live.sum())
    penalised = _top_rows(cov, live, max(1, int(n * config.kl_cov_ratio)) if n else 0)
    penalty = torch.where(penalised, config.ppo_kl_coef * log_ratio.abs(), 0.0)
    pg = -adv * torch.exp(log_ratio) + penalty
    return PgTerms(pg, {"ppo_kl": log_ratio.detach().abs()})


def _geo_mean(
    logp: torch.Tensor, rows: TokenRows, config: PolicyLossConfig, whole: Batchwide | None
) -> PgTerms:
    """GMPO: each token of sequence ``k`` carries ``-mean_M(A)_k * exp(mean_M(lr)_k)``
    with ``lr = sign(A) * min(sign(A) * d, sign(A) * clip(d, -clip_low, clip_high))``,
    ``d = logp - old``; the aggregation then averages over sequences."""
    whole = typing.cast(Batchwide, whole)
    diff = _diff(logp, rows)
    d = symmetric_clamp(diff, config.log_ratio_clamp)
    adv, m = rows.adv.to(logp.dtype), rows.mask.to(logp.dtype)
    sign = torch.sign(adv)
    clipped = d.clamp(-config.clip_low, config.effective_clip_high)
    lr = sign * torch.minimum(sign * d, sign * clipped)
    sums = torch.stack([segment_sum(v, whole.segments, whole.count) for v in (lr * m, adv * m, m)])
    if whole.cp_sum is not None:
        sums = whole.cp_sum(sums)
    lr_sum, adv_sum, n_k = sums.unbind(0)
    n_k = torch.where(n_k == 0, 1.0, n_k)
    per_seq = -(adv_sum / n_k) * torch.exp(lr_sum / n_k)
    bitten = d != clipped
    out = {"clip_fraction": bitten & (adv > 0), "clip_fraction_lower": bitten & (adv < 0)}
    return PgTerms(per_seq[whole.segments], out | {"ppo_kl": -diff.detach()})


MODES: dict[PolicyLossMode, Mode] = {
    PolicyLossMode.VANILLA: _vanilla,
    PolicyLossMode.BYPASS_MODE: _vanilla,
    PolicyLossMode.GSPO: _gspo_token,
    PolicyLossMode.DPPO_TV: _dppo,
    PolicyLossMode.DPPO_KL: _dppo,
    PolicyLossMode.SAPO: _sapo,
    PolicyLossMode.GPG: _gpg,
    PolicyLossMode.CLIP_COV: _clip_cov,
    PolicyLossMode.KL_COV: _kl_cov,
    PolicyLossMode.GEO_MEAN: _geo_mean,
    PolicyLossMode.DRO: _dro,
    PolicyLossMode.CISPO: _cispo,
}

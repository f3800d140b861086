"""The policy-loss family as plain tensor maths on per-token values (any shape).

Every formula is the one of ``hookspec.conventions``; these functions are what
both paths of :func:`~torch_impl.processors.policy_loss` compute, and what its
tests compare against in float64.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from hookspec import Aggregation, ContractError, KLEstimator

__all__ = [
    "PolicyLossConfig",
    "aggregation_weights",
    "kl_penalty",
    "ppo_token_loss",
    "sequence_log_ratio",
]


def _finite_number(field: str, value: Any, *, low: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ContractError(field, expected="a finite number", actual=repr(value))
    if low is not None and (value <= low if strict else value < low):
        raise ContractError(field, expected=f"a number {'>' if strict else '>='} {low}", actual=repr(value))
    return float(value)


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """The policy loss, per token ``t`` (``hookspec.conventions``)::

        log_ratio = clamp(logp - old, -log_ratio_clamp, log_ratio_clamp)
        ratio = exp(log_ratio)                   # ratio="token": PPO, GRPO
        ratio = exp(seq_mean(logp - old))        # ratio="sequence": GSPO, over the
                                                 # masked tokens of t's sequence
        pg = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        pg = where(A < 0, min(pg, -A * dual_clip), pg)          # if dual_clip
        L = pg + kl_coef * kl(logp, ref) - entropy_coef * entropy
        loss = aggregate(L, mask, aggregation)

    ``kl`` is the ``kl_estimator`` (k1, k2, k3) of ``log_ratio = clamp(ref - logp)``.
    The clamp (default 20, as veRL) keeps ``exp`` finite so that a masked or
    far-off-policy token cannot turn a gradient into NaN; ``None`` turns it off.
    ``fused``: form the gradients in the forward pass when the loss is a sum of
    per-token terms (``ratio="token"``); GSPO's sequence ratio always takes the
    recomputing path.
    """

    clip_low: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    ratio: str = "token"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.K3
    entropy_coef: float = 0.0
    aggregation: Aggregation = Aggregation.TOKEN_MEAN
    log_ratio_clamp: float | None = 20.0
    fused: bool = True

    def __post_init__(self) -> None:
        _finite_number("clip_low", self.clip_low, low=0.0)
        if self.clip_high is not None:
            _finite_number("clip_high", self.clip_high, low=0.0)
        if self.dual_clip is not None:
            _finite_number("dual_clip", self.dual_clip, low=1.0, strict=True)
        if self.ratio not in ("token", "sequence"):
            raise ContractError("ratio", expected="'token' or 'sequence'", actual=repr(self.ratio))
        _finite_number("kl_coef", self.kl_coef)
        _finite_number("entropy_coef", self.entropy_coef)
        if self.log_ratio_clamp is not None:
            _finite_number("log_ratio_clamp", self.log_ratio_clamp, low=0.0, strict=True)
        try:
            object.__setattr__(self, "kl_estimator", KLEstimator(self.kl_estimator))
        except ValueError:
            raise ContractError(
                "kl_estimator",
                expected=f"one of {[k.value for k in KLEstimator]}",
                actual=repr(self.kl_estimator),
            ) from None
        try:
            object.__setattr__(self, "aggregation", Aggregation(self.aggregation))
        except ValueError:
            raise ContractError(
                "aggregation",
                expected=f"one of {[a.value for a in Aggregation]}",
                actual=repr(self.aggregation),
            ) from None

    @property
    def eps_high(self) -> float:
        return self.clip_low if self.clip_high is None else self.clip_high

    @classmethod
    def ppo(cls, *, clip_low: float = 0.2, clip_high: float | None = None, **kw: Any) -> PolicyLossConfig:
        """PPO clip (token ratio, token-mean)."""
        return cls(clip_low=clip_low, clip_high=clip_high, **kw)

    @classmethod
    def grpo(cls, *, clip_low: float = 0.2, kl_coef: float = 0.04, **kw: Any) -> PolicyLossConfig:
        """GRPO (DeepSeekMath): PPO clip with a k3 KL penalty to the reference,
        averaged per sequence (seq-mean-token-mean)."""
        kw.setdefault("aggregation", Aggregation.SEQ_MEAN_TOKEN_MEAN)
        kw.setdefault("kl_estimator", KLEstimator.K3)
        return cls(clip_low=clip_low, kl_coef=kl_coef, **kw)

    @classmethod
    def gspo(cls, *, clip_low: float = 3e-4, clip_high: float | None = 4e-4, **kw: Any) -> PolicyLossConfig:
        """GSPO: the clipped objective on the sequence-level ratio, seq-mean-token-mean."""
        kw.setdefault("aggregation", Aggregation.SEQ_MEAN_TOKEN_MEAN)
        return cls(clip_low=clip_low, clip_high=clip_high, ratio="sequence", **kw)


def _clamp(x: torch.Tensor, bound: float | None) -> torch.Tensor:
    return x if bound is None else x.clamp(-bound, bound)


def kl_penalty(
    logp: torch.Tensor, ref: torch.Tensor, estimator: KLEstimator, *, clamp: float | None
) -> torch.Tensor:
    """``k1 = logp - ref``, ``k2 = (logp - ref)**2 / 2``, ``k3 = exp(r) - r - 1``
    with ``r = ref - logp`` (clamped to ``[-clamp, clamp]``)."""
    log_ratio = _clamp(ref - logp, clamp)
    if estimator == KLEstimator.K1:
        return -log_ratio
    if estimator == KLEstimator.K2:
        return 0.5 * log_ratio * log_ratio
    return torch.expm1(log_ratio) - log_ratio


def ppo_token_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(pg, clipped, dual_clipped)`` per token from ``log_ratio = log(ratio)``.

    ``clipped``: the clipped branch is the larger (``-A clip(r) > -A r``);
    ``dual_clipped``: ``A < 0`` and the dual bound ``-A c`` is taken.
    """
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - config.clip_low, 1.0 + config.eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    dual = None
    if config.dual_clip is not None:
        pg3 = -advantages * config.dual_clip
        dual = (advantages < 0) & (pg > pg3)
        pg = torch.where(advantages < 0, torch.minimum(pg, pg3), pg)
    return pg, clipped, dual


def segment_sum(values: torch.Tensor, segments: torch.Tensor, count: int) -> torch.Tensor:
    """``out[k] = sum(values[segments == k])`` for ``k < count`` (differentiable)."""
    flat = values.reshape(-1)
    out = torch.zeros(count, dtype=flat.dtype, device=flat.device)
    return out.index_add(0, segments.reshape(-1), flat)


def sequence_log_ratio(
    logp: torch.Tensor,
    old: torch.Tensor,
    mask: torch.Tensor,
    segments: torch.Tensor,
    count: int,
    *,
    clamp: float | None,
) -> torch.Tensor:
    """GSPO's ``log s_k = sum_t M_t (logp_t - old_t) / sum_t M_t`` over each
    sequence ``k``, broadcast back to its tokens (same shape as ``logp``)."""
    diff = torch.where(mask > 0, logp - old, 0.0) * mask
    num = segment_sum(diff, segments, count)
    den = segment_sum(mask.to(num.dtype), segments, count)
    per_seq = torch.where(den > 0, num / den.clamp_min(1e-30), 0.0)
    return _clamp(per_seq[segments], clamp)


def aggregation_weights(
    mask: torch.Tensor,
    segments: torch.Tensor,
    count: int,
    how: Aggregation,
    *,
    global_tokens: float | None = None,
    global_sequences: float | None = None,
) -> torch.Tensor:
    """Weights ``w`` (shape of ``mask``) with ``aggregate(L) = sum(w * L)``::

        token-mean:           w = M / sum(M)
        seq-mean-token-sum:   w = M / K
        seq-mean-token-mean:  w = M / (n_k * K)

    ``n_k``: the mask's sum over sequence ``k`` (``segments`` gives each
    token's sequence, ``count`` sequences); ``K``: the sequences with
    ``n_k > 0``. ``global_tokens`` / ``global_sequences`` replace ``sum(M)`` /
    ``K`` (counts over the ranks that share the loss). An empty mask gives
    ``w = 0``.
    """
    m = mask.to(torch.float64 if mask.dtype == torch.float64 else torch.float32)
    if how == Aggregation.TOKEN_MEAN:
        total = m.sum() if global_tokens is None else torch.tensor(float(global_tokens), dtype=m.dtype)
        return torch.where(total > 0, m / total.clamp_min(1e-30), 0.0)
    n_k = segment_sum(m, segments, count)
    k = (
        (n_k > 0).sum().to(m.dtype)
        if global_sequences is None
        else torch.tensor(float(global_sequences), dtype=m.dtype)
    )
    k = k.clamp_min(1e-30)
    if how == Aggregation.SEQ_MEAN_TOKEN_SUM:
        return m / k
    per_tok = n_k[segments]
    return torch.where(per_tok > 0, m / (per_tok.clamp_min(1e-30) * k), 0.0)

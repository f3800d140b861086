"""The losses' maths on per-token values (any shape), the formulas of
``hookspec.conventions``: the policy-loss family and the aggregations every loss shares."""

from __future__ import annotations

import dataclasses
import enum
import warnings
from typing import TYPE_CHECKING, Any

import torch

from hookspec import Aggregation, ContractError, KLEstimator
from hookspec.arrays import format_shape

from ..value_checks import check_finite_deferred, check_indices_deferred
from ._checks import (
    check_bool,
    check_enum,
    check_finite_number,
    check_floating,
    check_instance,
    check_int,
)

if TYPE_CHECKING:
    from ._rollout import RolloutCorrection

__all__ = [
    "PolicyLossConfig",
    "PolicyLossMode",
    "RatioLevel",
    "aggregation_weights",
    "check_counts",
    "global_counts",
    "kl_penalty",
    "kl_terms",
    "masked_mean",
    "segment_sum",
    "symmetric_clamp",
    "weighted_sum",
    "weights_of",
]


class RatioLevel(enum.StrEnum):
    """The level of the importance ratio ``r`` of :class:`PolicyLossConfig`."""

    TOKEN = "token"
    """``r_t = exp(logp_t - old_t)`` per token: PPO, GRPO."""
    SEQUENCE = "sequence"
    """``r_t = exp(mean_M(logp - old))`` over the masked tokens of ``t``'s sequence: GSPO."""


class PolicyLossMode(enum.StrEnum):
    """The policy-gradient term ``pg`` of :class:`PolicyLossConfig`, by veRL 0.9.1's
    ``policy_loss.loss_mode`` names (``hookspec.conventions`` has each formula)."""

    VANILLA = "vanilla"
    """PPO clip, dual clip with ``dual_clip``; the token or sequence ratio of ``ratio``."""
    GSPO = "gspo"
    """GSPO-token: ``s = exp(sg(seq_mean(logp - old)) + logp - sg(logp))``, clipped."""
    DPPO_TV = "dppo_tv"
    """``-A * sg(min(r, c)) * logp`` where ``p - p_old`` stays inside the clip bounds."""
    DPPO_KL = "dppo_kl"
    """As ``dppo_tv``, the trust region a binary KL of ``p`` against ``p_old``."""
    SAPO = "sapo"
    """``-A * sigmoid(tau * (r - 1)) * 4 / tau``, ``tau``: ``tau_pos`` or ``tau_neg``."""
    GPG = "gpg"
    """``-A * logp``: no ratio."""
    CLIP_COV = "clip_cov"
    """PPO clip, the loss of the tokens of highest covariance of ``A`` and ``logp`` set to 0."""
    KL_COV = "kl_cov"
    """``-A * r``, plus ``ppo_kl_coef * |logp - old|`` at the tokens of highest covariance."""
    GEO_MEAN = "geo_mean"
    """GMPO: ``-mean(A) * exp(seq_mean(clipped log-ratio))`` per sequence."""
    DRO = "dro"
    """``-(A * logp - dro_beta / 2 * (logp - old) ** 2)``."""
    CISPO = "cispo"
    """``-sg(clip(r)) * A * logp``."""
    BYPASS_MODE = "bypass_mode"
    """``vanilla`` with ``old = rollout``: needs ``RolloutCorrection(bypass_mode=True)``."""


TOKEN_LOCAL_MODES = frozenset(
    {
        PolicyLossMode.VANILLA,
        PolicyLossMode.BYPASS_MODE,
        PolicyLossMode.DPPO_TV,
        PolicyLossMode.DPPO_KL,
        PolicyLossMode.SAPO,
        PolicyLossMode.GPG,
        PolicyLossMode.DRO,
        PolicyLossMode.CISPO,
    }
)
"""The modes whose token term reads that token's own logprob alone: the fused path's."""


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """The policy loss, per token ``t`` (``hookspec.conventions``)::

        log_ratio = clamp(logp - old, -log_ratio_clamp, log_ratio_clamp)
        ratio = exp(log_ratio)                   # RatioLevel.TOKEN: PPO, GRPO
        ratio = exp(seq_mean_M(logp - old))      # RatioLevel.SEQUENCE: GSPO, over t's sequence
        pg = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        pg = where(A < 0, min(pg, -A * dual_clip), pg)          # if dual_clip
        L = pg + kl_coef * kl(logp, ref) - entropy_coef * entropy
        loss = aggregate(L, mask, aggregation)

    ``loss_mode`` (a :class:`PolicyLossMode`, veRL's name as it is) replaces ``pg`` by its
    mode's term (``hookspec.conventions``), with veRL's options and defaults: ``tau_pos``,
    ``tau_neg`` (sapo); ``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub`` (clip_cov);
    ``kl_cov_ratio``, ``ppo_kl_coef`` (kl_cov); ``dro_beta`` (dro, required); the clip bounds
    are dppo's trust-region bounds and ``dual_clip`` its ratio truncation (veRL's
    ``clip_ratio_c``, default 20).

    ``kl`` is the ``kl_estimator`` (k1, k2, k3) of ``log_ratio = clamp(ref - logp)``.
    The clamp (default 20, as veRL; ``None``: off) keeps ``exp`` finite. ``fused``: form
    the gradients in the forward pass (``RatioLevel.TOKEN`` only; GSPO recomputes).

    ``rollout_correction`` (a :class:`RolloutCorrection`; needs
    ``PolicyBatch.rollout_logprobs``) corrects for the rollout engine: ``pg`` is multiplied
    by the detached importance weight ``w`` and the mask by the rejection's ``keep``
    (which the aggregation's normalisation then reads too)::

        pg = w * pg;  M = M * keep        # decoupled: w, keep of old / rollout
        old = rollout                     # bypass mode: w, keep of logp / rollout
        pg = -A * w * logp                # bypass mode, loss_type "reinforce"

    With ``PolicyBatch.sampling_support`` (sampling replay), ``logp`` and the entropy are of
    the sampler's distribution renormalised over the kept tokens; ``kl`` reads the current
    policy over the whole vocabulary, as the reference is taken (NeMo RL's choice), unless
    ``reference_on_support`` (the reference's logprobs taken on the support too)::

        kl = kl(logp if reference_on_support else z_y - logsumexp(z), ref)

    Checked at construction (``ContractError``; NumPy numbers stored as ``float``):
    every number finite, ``0 <= clip_low <= 1``, ``clip_high >= 0`` (``None``:
    ``clip_low``), ``dual_clip > 1``, ``kl_coef >= 0``, ``log_ratio_clamp > 0``.

    Deprecated for one release (``DeprecationWarning``): ``ratio`` as a string
    (pass :class:`RatioLevel`) and ``eps_high`` (read :attr:`effective_clip_high`).
    """

    clip_low: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    ratio: RatioLevel = RatioLevel.TOKEN
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.K3
    entropy_coef: float = 0.0
    aggregation: Aggregation = Aggregation.TOKEN_MEAN
    log_ratio_clamp: float | None = 20.0
    fused: bool = True
    rollout_correction: RolloutCorrection | None = None
    kl_value_clamp: float | None = None
    kl_straight_through: bool = False
    loss_scale_factor: float | None = None
    loss_mode: PolicyLossMode = PolicyLossMode.VANILLA
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    reference_on_support: bool = False

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "clip_low", check_finite_number("clip_low", self.clip_low, low=0.0, high=1.0))
        if self.clip_high is not None:
            put(self, "clip_high", check_finite_number("clip_high", self.clip_high, low=0.0))
        if self.dual_clip is not None:
            put(
                self,
                "dual_clip",
                check_finite_number("dual_clip", self.dual_clip, low=1.0, low_open=True),
            )
        if not isinstance(self.ratio, RatioLevel):
            if self.ratio not in ("token", "sequence"):
                raise ContractError(
                    "ratio",
                    expected="RatioLevel.TOKEN or RatioLevel.SEQUENCE",
                    actual=repr(self.ratio),
                )
            warnings.warn(
                f"PolicyLossConfig(ratio={self.ratio!r}): a string ratio is deprecated; "
                f"pass RatioLevel.{self.ratio.upper()}",
                DeprecationWarning,
                stacklevel=3,
            )
            put(self, "ratio", RatioLevel(self.ratio))
        put(self, "kl_coef", check_finite_number("kl_coef", self.kl_coef, low=0.0))
        put(self, "entropy_coef", check_finite_number("entropy_coef", self.entropy_coef))
        if self.log_ratio_clamp is not None:
            clamp = check_finite_number(
                "log_ratio_clamp", self.log_ratio_clamp, low=0.0, low_open=True
            )
            put(self, "log_ratio_clamp", clamp)
        check_bool("fused", self.fused)
        check_bool("reference_on_support", self.reference_on_support)
        if self.rollout_correction is not None:
            from ._rollout import RolloutCorrection  # it builds on this module's segment_sum

            expected = "None or a torch_impl.processors.RolloutCorrection"
            check_instance(
                "rollout_correction", self.rollout_correction, RolloutCorrection, expected
            )
        estimator, straight = _verl_estimator(self.kl_estimator)
        put(self, "kl_estimator", check_enum("kl_estimator", KLEstimator, estimator))
        check_bool("kl_straight_through", self.kl_straight_through)
        put(self, "kl_straight_through", self.kl_straight_through or straight)
        for name in ("kl_value_clamp", "loss_scale_factor"):
            if (value := getattr(self, name)) is not None:
                put(self, name, check_finite_number(name, value, low=0.0, low_open=True))
        put(self, "aggregation", check_enum("aggregation", Aggregation, self.aggregation))
        self._check_mode()

    def _check_mode(self) -> None:
        """``loss_mode`` and the options of the modes (veRL's names and defaults)."""
        put = object.__setattr__
        mode = check_enum("loss_mode", PolicyLossMode, self.loss_mode)
        put(self, "loss_mode", mode)
        for name in ("tau_pos", "tau_neg", "clip_cov_ratio", "kl_cov_ratio"):
            put(self, name, check_finite_number(name, getattr(self, name), low=0.0, low_open=True))
        for name in ("clip_cov_lb", "clip_cov_ub", "ppo_kl_coef"):
            put(self, name, check_finite_number(name, getattr(self, name)))
        if self.dro_beta is not None:
            beta = check_finite_number("dro_beta", self.dro_beta, low=0.0, low_open=True)
            put(self, "dro_beta", beta)
        elif mode == PolicyLossMode.DRO:
            raise ContractError(
                "dro_beta", expected="a number > 0 with loss_mode 'dro'", actual=None
            )
        if self.ratio == RatioLevel.SEQUENCE and mode != PolicyLossMode.VANILLA:
            raise ContractError(
                "ratio",
                expected=f"RatioLevel.TOKEN with loss_mode {mode.value!r} (the sequence ratio is "
                "vanilla's; loss_mode 'gspo' is GSPO-token)",
                actual=repr(self.ratio),
            )
        correction = self.rollout_correction
        if mode == PolicyLossMode.GEO_MEAN and correction is not None and correction.rollout_is:
            raise ContractError(
                "rollout_correction.rollout_is",
                expected="None with loss_mode 'geo_mean' (its sequence ratio would take the "
                "token weights' geometric mean; rejection applies)",
                actual=repr(correction.rollout_is),
            )
        bypass = correction is not None and correction.bypass_mode
        if mode == PolicyLossMode.BYPASS_MODE and not bypass:
            raise ContractError(
                "rollout_correction",
                expected="a RolloutCorrection(bypass_mode=True) with loss_mode 'bypass_mode'",
                actual=repr(self.rollout_correction),
            )

    @property
    def is_token_local(self) -> bool:
        """Whether each token's term reads its own logprob alone (the fused path's losses)."""
        return self.loss_mode in TOKEN_LOCAL_MODES and self.ratio == RatioLevel.TOKEN

    @property
    def dppo_truncation(self) -> float:
        """DPPO's truncation ``c`` of the detached ratio: ``dual_clip`` (veRL's
        ``clip_ratio_c``), else 20 as veRL."""
        return 20.0 if self.dual_clip is None else self.dual_clip

    @property
    def kl_options(self) -> KLOptions:
        """The KL term's options: the estimator, the log-ratio clamp, the value clamp, the
        straight-through form."""
        return KLOptions(
            self.kl_estimator, self.log_ratio_clamp, self.kl_value_clamp, self.kl_straight_through
        )

    @property
    def effective_clip_high(self) -> float:
        """The upper clip: ``clip_high``, or ``clip_low`` when it is ``None``."""
        return self.clip_low if self.clip_high is None else self.clip_high

    @property
    def eps_high(self) -> float:
        """Deprecated (one release): :attr:`effective_clip_high`."""
        warnings.warn(
            "PolicyLossConfig.eps_high is deprecated: read effective_clip_high "
            "(the clip bounds are named clip_low/clip_high)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.effective_clip_high

    @classmethod
    def ppo(
        cls, *, clip_low: float = 0.2, clip_high: float | None = None, **kw: Any
    ) -> PolicyLossConfig:
        """PPO clip (token ratio, token-mean)."""
        return cls(clip_low=clip_low, clip_high=clip_high, **kw)

    @classmethod
    def grpo(cls, *, clip_low: float = 0.2, kl_coef: float = 0.04, **kw: Any) -> PolicyLossConfig:
        """GRPO (DeepSeekMath): PPO clip, a k3 KL penalty to the reference, seq-mean-token-mean."""
        kw.setdefault("aggregation", Aggregation.SEQ_MEAN_TOKEN_MEAN)
        kw.setdefault("kl_estimator", KLEstimator.K3)
        return cls(clip_low=clip_low, kl_coef=kl_coef, **kw)

    @classmethod
    def gspo(
        cls, *, clip_low: float = 3e-4, clip_high: float | None = 4e-4, **kw: Any
    ) -> PolicyLossConfig:
        """GSPO: the clipped objective on the sequence-level ratio, seq-mean-token-mean."""
        kw.setdefault("aggregation", Aggregation.SEQ_MEAN_TOKEN_MEAN)
        return cls(clip_low=clip_low, clip_high=clip_high, ratio=RatioLevel.SEQUENCE, **kw)


VERL_KL_NAMES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
"""veRL's ``kl_loss_type`` names that are other names of ours (``abs`` is ``abs``)."""


def _verl_estimator(given: Any) -> tuple[Any, bool]:
    """``(estimator, straight_through)`` of a ``kl_estimator`` given in veRL's words: a
    trailing ``+`` is the straight-through form; ``kl``, ``mse``, ``low_var_kl`` are k1,
    k2, k3 (veRL also clamps k3's value to 10: ``kl_value_clamp=10``)."""
    if not isinstance(given, str) or isinstance(given, KLEstimator):
        return given, False
    straight = given.endswith("+")
    name = given[:-1] if straight else given
    return VERL_KL_NAMES.get(name, name), straight


def symmetric_clamp(x: torch.Tensor, bound: float | None) -> torch.Tensor:
    """``clamp(x, -bound, bound)``; ``x`` itself when ``bound`` is ``None``."""
    return x if bound is None else x.clamp(-bound, bound)


def kl_penalty(
    logp: torch.Tensor,
    ref: torch.Tensor,
    estimator: KLEstimator,
    *,
    clamp: float | None,
    value_clamp: float | None = None,
    straight_through: bool = False,
) -> torch.Tensor:
    """``k1 = logp - ref``, ``k2 = (logp - ref)**2 / 2``, ``k3 = exp(r) - r - 1``,
    ``abs = |logp - ref|`` with ``r = ref - logp`` (clamped to ``[-clamp, clamp]``;
    ``clamp`` a finite number > 0, or ``None``: no clamp); the value clamped to
    ``[-value_clamp, value_clamp]`` (veRL's k3: 10); ``straight_through``: the value with
    k2's gradient (veRL's ``"k3+"``). Elementwise, any shape."""
    estimator = check_enum("estimator", KLEstimator, estimator)
    if clamp is not None:
        clamp = check_finite_number("clamp", clamp, low=0.0, low_open=True)
    if value_clamp is not None:
        value_clamp = check_finite_number("value_clamp", value_clamp, low=0.0, low_open=True)
    check_bool("straight_through", straight_through)
    check_floating("logp", logp)
    check_floating("ref", ref)
    if ref.shape != logp.shape:
        expected = f"the shape of logp {format_shape(logp.shape)}"
        raise ContractError("ref", expected=expected, actual=format_shape(ref.shape))
    options = KLOptions(estimator, clamp, value_clamp, straight_through)
    return kl_terms(logp, ref, options)


@dataclasses.dataclass(frozen=True)
class KLOptions:
    """The KL term's options, checked: the estimator, the log-ratio clamp, the value
    clamp and the straight-through form (:func:`kl_penalty`)."""

    estimator: KLEstimator
    clamp: float | None = None
    value_clamp: float | None = None
    straight_through: bool = False


def kl_terms(logp: torch.Tensor, ref: torch.Tensor, options: KLOptions) -> torch.Tensor:
    """:func:`kl_penalty` on options already checked."""
    log_ratio = symmetric_clamp(ref - logp, options.clamp)
    estimator = options.estimator
    if estimator == KLEstimator.K1:
        value = -log_ratio
    elif estimator == KLEstimator.K2:
        value = 0.5 * log_ratio * log_ratio
    elif estimator == KLEstimator.ABS:
        value = log_ratio.abs()
    else:
        value = torch.expm1(log_ratio) - log_ratio
    value = symmetric_clamp(value, options.value_clamp)
    if not options.straight_through or estimator == KLEstimator.K2:
        return value
    k2 = 0.5 * (logp - ref).square()  # k2's gradient, the value's value
    return k2 - k2.detach() + value.detach()


def segment_sum(values: torch.Tensor, segments: torch.Tensor, count: int) -> torch.Tensor:
    """``out[k] = sum(values[segments == k])`` for ``k < count`` (differentiable)."""
    flat = values.reshape(-1)
    out = torch.zeros(count, dtype=flat.dtype, device=flat.device)
    return out.index_add(0, segments.reshape(-1), flat)


def global_counts(owner: Any) -> dict[str, Any]:
    """The ``global_tokens`` and ``global_sequences`` of a batch or a teacher, as keywords."""
    return {"global_tokens": owner.global_tokens, "global_sequences": owner.global_sequences}


def check_counts(
    how: Aggregation | None, *, global_tokens: Any, global_sequences: Any, prefix: str = ""
) -> None:
    """Each count ``None`` or a finite number ``> 0``; and (``how`` given) refuse the one
    ``how`` does not read: ``global_sequences`` with token-mean, ``global_tokens`` with
    the two sequence means (given, it would be ignored). Errors name ``{prefix}<count>``."""
    counts = {"global_tokens": global_tokens, "global_sequences": global_sequences}
    for name, count in counts.items():
        if count is not None:
            check_finite_number(f"{prefix}{name}", count, low=0.0, low_open=True)
    if how is None:
        return
    used = count_read(how)
    for unused in (name for name in counts if name != used):
        if counts[unused] is not None:
            divides = f"divides by {used}" if used else "divides by no count"
            raise ContractError(
                f"{prefix}{unused}",
                expected=f"None with aggregation {how.value!r}, which {divides} and never "
                f"reads {unused}",
                actual=repr(counts[unused]),
            )


def count_read(how: Aggregation) -> str | None:
    """The global count an aggregation divides by: ``global_tokens`` (token-mean),
    ``global_sequences`` (the sequence means), none (token-sum)."""
    if how == Aggregation.TOKEN_MEAN:
        return "global_tokens"
    return None if how == Aggregation.TOKEN_SUM else "global_sequences"


def aggregation_weights(
    mask: torch.Tensor,
    segments: torch.Tensor,
    count: int,
    how: Aggregation,
    *,
    global_tokens: float | None = None,
    global_sequences: float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Weights ``w`` (shape of ``mask``) with ``aggregate(L) = sum(w * L)``::

        token-mean:           w = M / sum(M)
        seq-mean-token-sum:   w = M / K
        seq-mean-token-mean:  w = M / (n_k * K)
        token-sum:            w = M
        seq-mean-token-sum-norm:  w = M / (K * F)       # F: loss_scale_factor, default s

    ``n_k``: the mask's sum over sequence ``k`` (``segments`` gives each token's
    sequence, ``count`` sequences); ``K``: the sequences with ``n_k != 0``.
    ``global_tokens`` / ``global_sequences`` (finite numbers > 0, counts over the ranks
    sharing the loss) replace ``sum(M)`` / ``K``. A mask whose sum is exactly 0 gives
    ``w = 0``; an entry of ``M`` that is NaN, infinite or negative raises
    ``ContractError`` (``mask``; deferred on a GPU, the weights NaN until then).
    """
    how = check_enum("aggregation", Aggregation, how)
    check_counts(how, global_tokens=global_tokens, global_sequences=global_sequences)
    if not isinstance(mask, torch.Tensor) or mask.is_complex():
        raise ContractError("mask", expected="a real tensor", actual=type(mask).__name__)
    is_tensor = isinstance(segments, torch.Tensor)
    if not is_tensor or segments.dtype.is_floating_point or segments.dtype == torch.bool:
        what = str(segments.dtype) if is_tensor else type(segments).__name__
        raise ContractError(
            "segments", expected="an integer tensor (each token's sequence)", actual=what
        )
    if segments.shape != mask.shape:
        expected = f"the shape of mask {format_shape(mask.shape)}"
        raise ContractError("segments", expected=expected, actual=format_shape(segments.shape))
    count = check_int("count", count, low=0)
    check_indices_deferred(segments, count, field="segments")
    check_finite_deferred(mask, field="mask", nonnegative=True)
    m = mask.to(torch.float64 if mask.dtype == torch.float64 else torch.float32)
    m = torch.where(torch.isfinite(m) & (m >= 0), m, float("nan"))
    if loss_scale_factor is not None:
        factor = check_finite_number("loss_scale_factor", loss_scale_factor, low=0.0, low_open=True)
        loss_scale_factor = factor
    return weights_of(
        m,
        segments,
        count,
        how,
        global_tokens=global_tokens,
        global_sequences=global_sequences,
        loss_scale_factor=loss_scale_factor,
    )


def weights_of(
    m: torch.Tensor,
    segments: torch.Tensor,
    count: int,
    how: Aggregation,
    *,
    global_tokens: float | None,
    global_sequences: float | None,
    totals: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """:func:`aggregation_weights` on inputs already checked (``m`` floating, bad
    entries NaN). ``totals``: ``n_k`` ``[count]`` summed over the context-parallel
    group, which ``sum(M)`` and ``K`` then come from too. ``loss_scale_factor``:
    seq-mean-token-sum-norm's ``F`` (``None``: ``m``'s last dimension, the padded length)."""
    if how == Aggregation.TOKEN_SUM:
        return m
    if how == Aggregation.TOKEN_MEAN:
        if global_tokens is not None:
            total = torch.tensor(float(global_tokens), dtype=m.dtype, device=m.device)
        else:
            total = m.sum() if totals is None else totals.to(m.dtype).sum()
        return m / torch.where(total == 0, 1.0, total)  # an exactly-0 total has m == 0
    n_k = segment_sum(m, segments, count) if totals is None else totals.to(m.dtype)
    if global_sequences is None:
        k = (n_k != 0).sum().to(m.dtype).clamp_min(1.0)  # K == 0 only where m == 0
    else:
        k = torch.tensor(float(global_sequences), dtype=m.dtype, device=m.device)
    if how == Aggregation.SEQ_MEAN_TOKEN_SUM:
        return m / k
    if how == Aggregation.SEQ_MEAN_TOKEN_SUM_NORM:
        factor = float(m.shape[-1]) if loss_scale_factor is None else loss_scale_factor
        return m / (k * factor)
    per_tok = n_k[segments]
    return m / (torch.where(per_tok == 0, 1.0, per_tok) * k)


def weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum(w * x)``, ``x`` not read where ``w == 0`` (a NaN weight gives NaN)."""
    return (torch.where(w != 0, x, 0.0) * w).sum()


def masked_mean(
    x: torch.Tensor, m: torch.Tensor, total: torch.Tensor | None = None
) -> torch.Tensor:
    """``sum(x * m) / sum(m)`` over ``m > 0``; ``0`` when ``sum(m)`` is exactly 0.
    ``x`` where ``m == 0`` is not read; NaN at a counted token, or in ``m``, gives NaN.
    ``total``: the denominator instead of ``sum(m)`` (the sum over the ranks)."""
    total = m.sum() if total is None else total
    x = torch.where(m > 0, x.to(m.dtype), 0.0)
    return (x * m).sum() / torch.where(total == 0, 1.0, total)

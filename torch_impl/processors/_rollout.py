"""Rollout correction: importance weights and rejection masks between the trainer's and
the rollout engine's logprobs (:class:`RolloutCorrection`, :func:`rollout_correction`).

The rollout engine (vLLM, SGLang) samples with other kernels, dtypes or versions than the
trainer, so its logprobs ``rollout`` differ from the trainer's ``old``. Per token ``t`` of
the mask ``M`` (any shape; ``segments`` gives each token's sequence)::

    log_ratio = old - rollout                              # log(pi_old / pi_rollout)
    w_token = exp(clamp(log_ratio, -20, 20))               # level "token"
    w_seq = exp(clamp(seq_sum_M(log_ratio), -20, 20))      # level "sequence", per sequence
    w_geo = exp(clamp(seq_mean_M(log_ratio), -20, 20))     # level "geometric", per sequence
    w = min(w, upper) * M                                  # truncated (TIS), detached
    w = where(lower <= w_raw <= upper, w_raw, 0) * M       # with a lower bound (IcePop)

and a rejection mask ``keep`` from divergence statistics of ``r = clamp(log_ratio, -20,
20)``: ``k1 = -r``, ``k2 = r**2 / 2``, ``k3 = exp(r) - 1 - r``, per token or per sequence
(sum, mean or max over its counted tokens), each kept within its bounds. A rejected token
leaves the loss and its normalisation (``M * keep``); the weights stay the true (truncated)
ratios. The names and the semantics are veRL 0.9.1's (``trainer/ppo/rollout_corr_helper.py``:
``compute_rollout_correction_weights``, ``compute_rollout_rejection_mask``,
``compute_offpolicy_metrics``), which the tests run as the oracle; the geometric level is
ours (the per-token geometric mean of the sequence ratio, GMPO's / GSPO's normalisation).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from collections.abc import Mapping
from typing import Any

import torch

from hookspec import ContractError

from ._checks import check_bool, check_enum, check_finite_number
from ._loss_math import segment_sum

__all__ = [
    "RejectionBounds",
    "RolloutCorrection",
    "RolloutCorrectionResult",
    "WeightLevel",
    "rollout_correction",
]

SAFETY_BOUND = 20.0
"""``|log ratio|`` is clamped to this before ``exp`` (veRL's ``SAFETY_BOUND``)."""

REJECTION_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""The rejection statistics, veRL's names: ``{token, seq_sum, seq_mean, seq_max}_k{1,2,3}``."""


class WeightLevel(enum.StrEnum):
    """The level of the importance weight ``pi_old / pi_rollout`` (veRL's ``rollout_is``)."""

    TOKEN = "token"
    """``exp(log_ratio_t)``: per token (biased, low variance)."""
    SEQUENCE = "sequence"
    """``exp(sum_t log_ratio_t)`` over the sequence, on each of its tokens (unbiased)."""
    GEOMETRIC = "geometric"
    """``exp(mean_t log_ratio_t)`` over the sequence: the geometric mean of its token ratios."""


@dataclasses.dataclass(frozen=True)
class RejectionBounds:
    """The bounds of one rejection statistic: a token (or sequence) is kept where
    ``lower <= stat <= upper``. For the k1 statistics the bounds are ratios and compared
    in log space (``log(lower) <= k1 <= log(upper)``; ``lower`` ``None``: ``1 / upper``, as
    veRL); for k2 and k3 ``lower`` must be ``None`` (they are ``>= 0``)."""

    upper: float
    lower: float | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "upper", check_finite_number("upper", self.upper, low=0.0, low_open=True))
        if self.lower is not None:
            lower = check_finite_number("lower", self.lower, low=0.0, low_open=True)
            if lower > self.upper:
                raise ContractError(
                    "lower", expected=f"<= upper = {self.upper}", actual=repr(lower)
                )
            put(self, "lower", lower)


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """How :func:`policy_loss` corrects for the rollout engine (``PolicyBatch.rollout_logprobs``).

    Attributes:
        rollout_is: the importance weights' :class:`WeightLevel`; ``None``: no weights.
        rollout_is_threshold: the weights' upper bound ``> 0`` (truncation, TIS).
        rollout_is_threshold_lower: a lower bound: weights outside ``[lower, upper]`` become
            0 instead of truncated (IcePop); ``None``: truncation only.
        rollout_is_batch_normalize: divide the weights by their masked mean over the
            micro-batch (token level; per-sequence means at the sequence levels).
        rollout_rs: the rejection statistics and their bounds, ``{name: RejectionBounds or
            upper}`` with names from :data:`REJECTION_OPTIONS`; empty: no rejection.
        bypass_mode: the old policy is the rollout's (``old_logprobs`` is not read): the
            weights and the rejection compare the current policy with the rollout's.
        loss_type: in bypass mode, ``"ppo_clip"`` (the clipped ratio to the rollout policy;
            no weights applied, they would count twice) or ``"reinforce"`` (``-A * w *
            logp``, no ratio, no clip).

    Outside bypass mode this is the decoupled three-policy PPO: the clipped ratio
    ``pi / pi_old`` times the weight ``pi_old / pi_rollout``.
    """

    rollout_is: WeightLevel | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_threshold_lower: float | None = None
    rollout_is_batch_normalize: bool = False
    rollout_rs: Mapping[str, RejectionBounds | float] = dataclasses.field(default_factory=dict)
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    def __post_init__(self) -> None:
        put = object.__setattr__
        if self.rollout_is is not None:
            put(self, "rollout_is", check_enum("rollout_is", WeightLevel, self.rollout_is))
        upper = check_finite_number(
            "rollout_is_threshold", self.rollout_is_threshold, low=0.0, low_open=True
        )
        put(self, "rollout_is_threshold", upper)
        if self.rollout_is_threshold_lower is not None:
            name = "rollout_is_threshold_lower"
            lower = check_finite_number(
                name, self.rollout_is_threshold_lower, low=0.0, low_open=True
            )
            if lower > upper:
                raise ContractError(
                    name, expected=f"<= rollout_is_threshold = {upper}", actual=repr(lower)
                )
            put(self, name, lower)
        check_bool("rollout_is_batch_normalize", self.rollout_is_batch_normalize)
        put(self, "rollout_rs", _checked_rejection(self.rollout_rs))
        check_bool("bypass_mode", self.bypass_mode)
        if self.loss_type not in ("ppo_clip", "reinforce"):
            expected = "'ppo_clip' or 'reinforce'"
            raise ContractError("loss_type", expected=expected, actual=repr(self.loss_type))
        if self.loss_type == "reinforce" and not self.bypass_mode:
            raise ContractError(
                "loss_type",
                expected="'ppo_clip' outside bypass mode (the decoupled PPO clips pi / pi_old)",
                actual="'reinforce'",
            )

    def __hash__(self) -> int:
        fields = dataclasses.astuple(self)[:4]
        return hash((*fields, tuple(sorted(self.rollout_rs.items())), self.bypass_mode))


def _checked_rejection(given: Any) -> dict[str, RejectionBounds]:
    """``rollout_rs`` as ``{name: RejectionBounds}``, each name known and its bounds of the
    statistic's kind (two for k1, an upper bound only for k2 and k3)."""
    if not isinstance(given, Mapping):
        expected = "a mapping {name: RejectionBounds or upper bound}"
        raise ContractError("rollout_rs", expected=expected, actual=type(given).__name__)
    checked = {}
    for name, bounds in given.items():
        if name not in REJECTION_OPTIONS:
            raise ContractError(
                "rollout_rs", expected=f"names in {REJECTION_OPTIONS}", actual=repr(name)
            )
        if not isinstance(bounds, RejectionBounds):
            bounds = RejectionBounds(upper=bounds)
        if name.endswith("k1") and bounds.lower is None:
            bounds = RejectionBounds(upper=bounds.upper, lower=1.0 / bounds.upper)
        if not name.endswith("k1") and bounds.lower is not None:
            raise ContractError(
                f"rollout_rs[{name!r}].lower",
                expected="None (k2 and k3 are >= 0: an upper bound only)",
                actual=repr(bounds.lower),
            )
        checked[name] = bounds
    return checked


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionResult:
    """What :func:`rollout_correction` gives, shaped as its inputs: ``weights`` (detached,
    0 where ``M == 0``; ``None`` without ``rollout_is``), ``keep`` (1.0 kept, 0.0 rejected;
    the loss's mask becomes ``M * keep``), and the detached scalar ``metrics`` veRL logs,
    under its names without the ``rollout_corr/`` prefix."""

    weights: torch.Tensor | None
    keep: torch.Tensor
    metrics: dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class _Sequences:
    """The counted tokens ``mask`` (0/1 as the inputs' dtype), each token's sequence and
    their number, and the per-sequence sums and means over the counted tokens."""

    mask: torch.Tensor
    segments: torch.Tensor
    count: int

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``[count]``: the sum of ``values`` over each sequence's counted tokens."""
        return segment_sum(torch.where(self.mask > 0, values, 0.0), self.segments, self.count)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """``[count]``: the mean over each sequence's counted tokens (0 where none; veRL's
        ``masked_mean`` with its ``1e-8`` is ``sum / (n + 1e-8)``)."""
        return self.sum(values) / (self.sum(torch.ones_like(values)) + 1e-8)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """``[count]``: the max over each sequence's counted tokens (0 where none)."""
        flat = torch.where(self.mask > 0, values, float("-inf")).reshape(-1)
        out = torch.full((self.count,), float("-inf"), dtype=values.dtype, device=values.device)
        out = out.scatter_reduce(0, self.segments.reshape(-1), flat, reduce="amax")
        return torch.where(torch.isinf(out), 0.0, out)

    @property
    def counted(self) -> torch.Tensor:
        """``[count]``: sequences with at least one counted token."""
        return self.sum(torch.ones_like(self.mask)) > 0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * M) / (sum(M) + 1e-8)`` (veRL's ``masked_mean``: 0 for an empty mask)."""
    return (torch.where(mask > 0, values, 0.0) * mask).sum() / (mask.sum() + 1e-8)


def rollout_correction(
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    segments: torch.Tensor,
    count: int,
    config: RolloutCorrection,
) -> RolloutCorrectionResult:
    """The importance weights, the rejection mask and the mismatch metrics of ``old``
    against ``rollout`` (the module docstring's formulas), every input of one shape,
    ``mask`` 0/1 (counted tokens), ``segments`` each token's sequence (``< count``).
    Nothing is differentiated: the result is detached."""
    old, rollout = old.detach(), rollout.detach().to(old.dtype)
    mask = (mask.detach() > 0).to(old.dtype)
    seqs = _Sequences(mask, segments, count)
    log_ratio = torch.where(mask > 0, old - rollout, 0.0)
    metrics = offpolicy_metrics(log_ratio, old, rollout, seqs)
    weights = None
    if config.rollout_is is not None:
        weights, is_metrics = _weights(log_ratio, seqs, config)
        metrics.update(is_metrics)
    keep = torch.ones_like(mask)
    if config.rollout_rs:
        bounds = typing.cast(Mapping[str, RejectionBounds], config.rollout_rs)
        keep, rs_metrics = _rejection(log_ratio, seqs, bounds)
        metrics.update(rs_metrics)
    return RolloutCorrectionResult(weights, keep, metrics)


def _raw_weights(
    log_ratio: torch.Tensor, seqs: _Sequences, level: WeightLevel
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_raw, per_sequence)``: the untruncated weights on every counted token, and
    the log ratios the level's statistics are of (per token, or per sequence)."""
    if level == WeightLevel.TOKEN:
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        return raw * seqs.mask, log_ratio
    per_sequence = seqs.sum(log_ratio) if level == WeightLevel.SEQUENCE else seqs.mean(log_ratio)
    raw = torch.exp(per_sequence.clamp(-SAFETY_BOUND, SAFETY_BOUND))[seqs.segments]
    return raw * seqs.mask, per_sequence


def _weights(
    log_ratio: torch.Tensor, seqs: _Sequences, config: RolloutCorrection
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The truncated (or IcePop-masked) weights and their metrics."""
    level = typing_level(config.rollout_is)
    upper, lower = config.rollout_is_threshold, config.rollout_is_threshold_lower
    raw, per_level = _raw_weights(log_ratio, seqs, level)
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, 0.0)
    metrics = _weight_metrics(weights, raw, per_level, seqs, config)
    if lower is not None:
        outside = (raw < lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = masked_mean(outside.to(raw.dtype), seqs.mask)
    if config.rollout_is_batch_normalize:
        weights, factor = _batch_normalized(weights, seqs, level)
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def typing_level(level: WeightLevel | None) -> WeightLevel:
    """``level``, known not to be ``None`` where weights are asked for."""
    if level is None:
        raise ContractError("rollout_is", expected="a WeightLevel", actual="None")
    return level


def _batch_normalized(
    weights: torch.Tensor, seqs: _Sequences, level: WeightLevel
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weights / mean`` and ``mean``: the masked mean of the weights (token level) or
    the mean of the sequences' masked means (the sequence levels); 1 when it is ``<= 1e-8``.
    The micro-batch's mean (veRL takes the data-parallel group's when it is initialised)."""
    if level == WeightLevel.TOKEN:
        mean = masked_mean(weights, seqs.mask)
    else:
        counted = seqs.counted.to(weights.dtype)
        mean = (seqs.mean(weights) * counted).sum() / counted.sum().clamp_min(1e-8)
    usable = mean > 1e-8
    factor = torch.where(usable, mean, 1.0)
    return weights / factor, factor


def _weight_metrics(
    weights: torch.Tensor,
    raw: torch.Tensor,
    per_level: torch.Tensor,
    seqs: _Sequences,
    config: RolloutCorrection,
) -> dict[str, torch.Tensor]:
    """veRL's ``compute_is_metrics``: mean, max, min, std and effective sample size of
    the weights, the fractions of raw ratios past the bounds, the sequences' mean weights."""
    mask, upper = seqs.mask, config.rollout_is_threshold
    lower = (
        1.0 / upper
        if config.rollout_is_threshold_lower is None
        else config.rollout_is_threshold_lower
    )
    out = {"rollout_is_mean": masked_mean(weights, mask)}
    if config.rollout_is == WeightLevel.TOKEN:
        live = mask > 0
        out["rollout_is_max"] = torch.where(live, weights, float("-inf")).max()
        out["rollout_is_min"] = torch.where(live, weights, float("inf")).min()
        out["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).to(mask.dtype), mask)
        out["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).to(mask.dtype), mask)
    else:  # the per-sequence log ratios, every sequence (veRL's rows, empty ones too)
        out["rollout_is_max"] = torch.exp(per_level.max().clamp(max=SAFETY_BOUND))
        out["rollout_is_min"] = torch.exp(per_level.min())
        high, low = per_level > math.log(upper), per_level < math.log(lower)
        out["rollout_is_ratio_fraction_high"] = high.to(mask.dtype).mean()
        out["rollout_is_ratio_fraction_low"] = low.to(mask.dtype).mean()
    bounded = weights.clamp(min=0.0, max=upper)
    mean = masked_mean(bounded, mask)
    variance = masked_mean(bounded.square(), mask) - mean.square()
    several = mask.sum() > 1
    out["rollout_is_std"] = torch.where(several, variance.clamp_min(0.0).sqrt(), 0.0)
    normalized = bounded / (mean + 1e-8)
    out["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalized.square(), mask)
    out.update(_sequence_weight_metrics(weights, raw, seqs, upper, lower))
    return out


def _sequence_weight_metrics(
    weights: torch.Tensor, raw: torch.Tensor, seqs: _Sequences, upper: float, lower: float
) -> dict[str, torch.Tensor]:
    """The sequences' mean weights (every sequence, as veRL's rows): mean, std, max, min,
    largest deviation from 1, and the fractions whose raw mean is past the bounds."""
    per_sequence, raw_per_sequence = seqs.mean(weights), seqs.mean(raw)
    several = per_sequence.numel() > 1
    std = per_sequence.std() if several else torch.zeros((), dtype=weights.dtype)
    return {
        "rollout_is_seq_mean": per_sequence.mean(),
        "rollout_is_seq_std": std,
        "rollout_is_seq_max": per_sequence.max(),
        "rollout_is_seq_min": per_sequence.min(),
        "rollout_is_seq_max_deviation": (per_sequence - 1.0).abs().max(),
        "rollout_is_seq_fraction_high": (raw_per_sequence > upper).to(weights.dtype).mean(),
        "rollout_is_seq_fraction_low": (raw_per_sequence < lower).to(weights.dtype).mean(),
    }


def _statistic(
    name: str, log_ratio: torch.Tensor, seqs: _Sequences
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stat, per_sequence)``: the rejection statistic ``name`` on every token (a
    sequence statistic on each of the sequence's tokens), and per sequence ``[count]``
    (a token statistic's mean over the sequence's counted tokens, as veRL logs it)."""
    r = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    kind = name[-2:]
    token = {"k1": -r, "k2": 0.5 * r * r, "k3": torch.exp(r) - 1.0 - r}[kind]
    if name.startswith("token"):
        return token, seqs.mean(token)
    reduce = {"seq_sum": seqs.sum, "seq_mean": seqs.mean, "seq_max": seqs.max}[name[:-3]]
    per_sequence = reduce(token)
    return per_sequence[seqs.segments], per_sequence


def _rejection(
    log_ratio: torch.Tensor, seqs: _Sequences, options: Mapping[str, RejectionBounds]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``keep``: 1 where every statistic is within its bounds; the fractions rejected,
    of the counted tokens and of the counted sequences, each statistic's and overall,
    and each statistic's distribution (:func:`_statistic_metrics`)."""
    mask, keep, metrics = seqs.mask, torch.ones_like(seqs.mask), {}
    for name, bounds in options.items():
        stat, per_sequence = _statistic(name, log_ratio, seqs)
        if name.endswith("k1"):  # bounds on the ratio, compared in log space
            low, high = math.log(typing_lower(bounds)), math.log(bounds.upper)
            kept = (stat >= low) & (stat <= high)
        else:
            low, high = None, bounds.upper
            kept = stat <= high
        kept_f = kept.to(mask.dtype)
        keep = keep * kept_f
        level = "token" if name.startswith("token") else "sequence"
        found = _statistic_metrics(stat, per_sequence, seqs, level, high=high, low=low)
        metrics.update({f"rollout_rs_{name}_{key}": value for key, value in found.items()})
        metrics[f"rollout_rs_{name}_masked_fraction"] = masked_mean(1.0 - kept_f, mask)
        metrics[f"rollout_rs_{name}_seq_masked_fraction"] = _rejected_sequences(kept_f, seqs)
    metrics["rollout_rs_masked_fraction"] = masked_mean(1.0 - keep, mask)
    rejected = seqs.sum(((keep <= 0.5) & (mask > 0)).to(mask.dtype)) > 0
    metrics["rollout_rs_seq_masked_fraction"] = rejected.to(mask.dtype).mean()
    return keep, metrics


def _statistic_metrics(
    stat: torch.Tensor,
    per_sequence: torch.Tensor,
    seqs: _Sequences,
    level: str,
    *,
    high: float,
    low: float | None,
) -> dict[str, torch.Tensor]:
    """veRL's ``compute_rs_metrics`` of one statistic: its token mean, its extremes and
    the fractions past the bounds (of the counted sequences' values at the sequence
    level, of the counted tokens at the token level), the std of its values clamped to
    the bounds, and the counted sequences' values: mean, std, max, min, fractions."""
    mask, dtype = seqs.mask, stat.dtype
    valid = seqs.counted
    by_sequence = level == "sequence"
    seq_stats = _valid_statistics(per_sequence, valid, high=high, low=low)
    out = {"mean": masked_mean(stat, mask)}
    live = mask > 0
    out["max"] = seq_stats["seq_max"] if by_sequence else torch.where(live, stat, -math.inf).max()
    out["min"] = seq_stats["seq_min"] if by_sequence else torch.where(live, stat, math.inf).min()
    if by_sequence:
        out["fraction_high"] = seq_stats["seq_fraction_high"]
        out["fraction_low"] = seq_stats.get("seq_fraction_low", torch.zeros((), dtype=dtype))
    else:
        out["fraction_high"] = masked_mean((stat > high).to(dtype), mask)
        below = (stat < low).to(dtype) if low is not None else torch.zeros_like(stat)
        out["fraction_low"] = masked_mean(below, mask)
    bounded = stat.clamp(min=0.0 if low is None else low, max=high)
    mean = masked_mean(bounded, mask)
    variance = masked_mean(bounded.square(), mask) - mean.square()
    out["std"] = torch.where(mask.sum() > 1, variance.clamp_min(0.0).sqrt(), 0.0)
    return out | seq_stats


def _valid_statistics(
    values: torch.Tensor, valid: torch.Tensor, *, high: float, low: float | None
) -> dict[str, torch.Tensor]:
    """Mean, unbiased std, max, min, largest ``|value|`` and the fractions past the
    bounds of ``values`` ``[count]`` over the ``valid`` sequences (0 where none is),
    without a host read (no boolean indexing)."""
    weight = valid.to(values.dtype)
    n = weight.sum()
    some = n > 0
    mean = (values * weight).sum() / torch.where(some, n, 1.0)
    squares = ((values - mean).square() * weight).sum()
    std = torch.where(n > 1, (squares / torch.where(n > 1, n - 1, 1.0)).sqrt(), 0.0)
    top = torch.where(valid, values, -math.inf).max()
    bottom = torch.where(valid, values, math.inf).min()
    magnitude = torch.where(valid, values.abs(), -math.inf).max()

    def fraction(hit: torch.Tensor) -> torch.Tensor:
        return torch.where(
            some, (hit.to(values.dtype) * weight).sum() / torch.where(some, n, 1.0), 0.0
        )

    out = {
        "seq_mean": torch.where(some, mean, 0.0),
        "seq_std": torch.where(some, std, 0.0),
        "seq_max": torch.where(some, top, 0.0),
        "seq_min": torch.where(some, bottom, 0.0),
        "seq_max_deviation": torch.where(some, magnitude, 0.0),
        "seq_fraction_high": fraction(values > high),
    }
    if low is not None:
        out["seq_fraction_low"] = fraction(values < low)
    return out


def typing_lower(bounds: RejectionBounds) -> float:
    """A k1 statistic's lower bound (set at construction)."""
    if bounds.lower is None:
        raise ContractError("lower", expected="a number for a k1 statistic", actual="None")
    return bounds.lower


def _rejected_sequences(kept: torch.Tensor, seqs: _Sequences) -> torch.Tensor:
    """The fraction of counted sequences with a counted token rejected (0 with none counted)."""
    counted = seqs.counted.to(kept.dtype)
    hit = (seqs.sum((kept <= 0).to(kept.dtype)) > 0).to(kept.dtype)
    total = counted.sum()
    return torch.where(total > 0, (hit * counted).sum() / torch.where(total > 0, total, 1.0), 0.0)


def offpolicy_metrics(
    log_ratio: torch.Tensor, old: torch.Tensor, rollout: torch.Tensor, seqs: _Sequences
) -> dict[str, torch.Tensor]:
    """veRL's ``compute_offpolicy_metrics``: the KL of the rollout policy to the trainer's
    (k1 and k3 token means), the two perplexities, their log difference, and chi^2 at
    token and sequence level (``E[rho**2] - 1``; the sequence's ``rho`` the product)::

        kl = mean_M(rollout - old);  k3_kl = mean_M(exp(lr) - lr - 1)
        chi2_token = mean_M(exp(2 clamp(lr))) - 1
        chi2_seq = mean_k(exp(2 clamp(seq_sum_M(lr)))) - 1
    """
    mask = seqs.mask
    mean_old, mean_rollout = seqs.mean(old), seqs.mean(rollout)
    diff = mean_rollout - mean_old
    clamped = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    sequence_sum = seqs.sum(log_ratio).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": torch.exp(-mean_old).mean(),
        "training_log_ppl": (-mean_old).mean(),
        "kl": masked_mean(rollout - old, mask),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1.0, mask),
        "rollout_ppl": torch.exp(-mean_rollout).mean(),
        "rollout_log_ppl": (-mean_rollout).mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": diff.abs().mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": torch.exp(diff).mean(),
        "chi2_token": masked_mean(torch.exp(clamped).square(), mask) - 1.0,
        "chi2_seq": torch.exp(2.0 * sequence_sum).mean() - 1.0,
    }

"""Float64 JAX references of the policy-gradient term ``pg`` of each policy-loss mode
(``PolicyLossConfig.loss_mode``, veRL 0.9.1's ``policy_loss.loss_mode`` names), on ``[b, s]``
arrays whose rows are the sequences (``hookspec.conventions`` has the formulas).

:func:`pg_terms` returns ``pg`` ``[b, s]`` and the per-token indicators whose token means
over the mask are the mode's metrics (``clip_fraction``, ``ppo_kl``, ...). Written from the
formulas, independently of ``torch_impl``; nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .references import as_float64, clipped_objective, gspo_ratio

__all__ = ["pg_terms"]

Terms = tuple[jax.Array, dict[str, jax.Array]]


def _value(x: Any) -> Any:
    return getattr(x, "value", x)


def _bounds(config: Any) -> tuple[float, float]:
    low = float(config.clip_low)
    return low, low if config.clip_high is None else float(config.clip_high)


def _clamped(d: jax.Array, config: Any) -> jax.Array:
    bound = config.log_ratio_clamp
    return d if bound is None else jnp.clip(d, -bound, bound)


def _seq_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """``sum_s(M * x) / sum_s(M)`` per row ``[b, 1]`` (0 for an empty row)."""
    n = jnp.sum(mask, axis=-1, keepdims=True)
    return jnp.sum(x * mask, axis=-1, keepdims=True) / jnp.maximum(n, 1.0)


def _vanilla(logp: jax.Array, old: jax.Array, adv: jax.Array, m: jax.Array, c: Any) -> Terms:
    low, high = _bounds(c)
    d = _clamped(logp - old, c)
    if _value(c.ratio) == "sequence":
        ratio = gspo_ratio(logp, old, m, log_ratio_clamp=c.log_ratio_clamp)
    else:
        ratio = jnp.exp(d)
    pg = clipped_objective(ratio, adv, eps_low=low, eps_high=high, dual_clip=c.dual_clip)
    pg1, pg2 = -adv * ratio, -adv * jnp.clip(ratio, 1 - low, 1 + high)
    out = {"clip_fraction": pg2 > pg1, "ppo_kl": -jnp.log(ratio)}
    if c.dual_clip is not None:
        out["dual_clip_fraction"] = (adv < 0) & (jnp.maximum(pg1, pg2) > -adv * c.dual_clip)
    return pg, out


def _gspo_token(logp: jax.Array, old: jax.Array, adv: jax.Array, m: jax.Array, c: Any) -> Terms:
    """``log s = sg(seq_mean(logp - old)) + logp - sg(logp)``, clipped objective, no dual clip."""
    low, high = _bounds(c)
    seq = lax.stop_gradient(_seq_mean(logp - old, m))
    s = jnp.exp(_clamped(logp - lax.stop_gradient(logp) + seq, c))
    pg1, pg2 = -adv * s, -adv * jnp.clip(s, 1 - low, 1 + high)
    return jnp.maximum(pg1, pg2), {"clip_fraction": pg2 > pg1, "ppo_kl": old - logp}


def _dppo(logp: jax.Array, old: jax.Array, adv: jax.Array, m: jax.Array, c: Any) -> Terms:
    low, high = _bounds(c)
    lp = lax.stop_gradient(logp)
    ratio = jnp.exp(_clamped(lp - old, c))
    p, p_old = jnp.exp(lp), jnp.exp(old)
    if _value(c.loss_mode) == "dppo_tv":
        up, down = p - p_old <= high, p - p_old >= -low
    else:
        eps = 1e-8  # veRL's, beside 1 - p
        bkl = p_old * (old - lp) + (1 - p_old) * jnp.log((1 - p_old + eps) / (1 - p + eps))
        up, down = (bkl <= high) | (p <= p_old), (bkl <= low) | (p >= p_old)
    valid = jnp.where(adv > 0, up, down).astype(jnp.float64)
    trunc = 20.0 if c.dual_clip is None else float(c.dual_clip)
    pg = -adv * jnp.minimum(ratio, trunc) * logp * valid
    out = {"clip_fraction": 1.0 - valid, "clip_fraction_lower": (ratio > trunc) * valid}
    return pg, out | {"ppo_kl": -jnp.log(ratio)}


def _sapo(logp: jax.Array, old: jax.Array, adv: jax.Array, m: jax.Array, c: Any) -> Terms:
    d = _clamped(logp - old, c)
    tau = jnp.where(adv > 0, float(c.tau_pos), float(c.tau_neg))
    gate = jax.nn.sigmoid(tau * (jnp.exp(d) - 1.0)) * 4.0 / tau
    return -gate * adv, {"ppo_kl": -lax.stop_gradient(d)}


def _gpg(logp: jax.Array, old: jax.Array, adv: jax.Array, m: jax.Array, c: Any) -> Terms:
    return -adv * logp, {"ppo_kl": old - logp}


def _dro(logp: jax.Array, old: jax.Array, adv: jax.Array, m: jax.Array, c: Any) -> Terms:
    pg = -(adv * logp - 0.5 * float(c.dro_beta) * (logp - old) ** 2)
    return pg, {"ppo_kl": old - logp}


def _cispo(logp: jax.Array, old: jax.Array, adv: jax.Array, m: jax.Array, c: Any) -> Terms:
    low, high = _bounds(c)
    ratio = jnp.exp(_clamped(lax.stop_gradient(logp) - old, c))
    clipped = jnp.clip(ratio, 1 - low, 1 + high)
    return -clipped * adv * logp, {"clip_fraction": ratio != clipped, "ppo_kl": -jnp.log(ratio)}


def _largest(score: jax.Array, eligible: jax.Array, k: int) -> jax.Array:
    """A boolean ``[b, s]``: the ``k`` eligible entries of largest ``score``."""
    ranked = jnp.where(eligible, score, -jnp.inf).reshape(-1)
    k = min(k, int(jnp.sum(eligible)))
    chosen = jnp.zeros(ranked.shape, bool)
    if k > 0:
        chosen = chosen.at[jnp.argsort(-ranked)[:k]].set(True)
    return chosen.reshape(score.shape)


def _covariance(logp: jax.Array, adv: jax.Array, m: jax.Array) -> jax.Array:
    """``(A - mean_M(A)) * (logp - mean_M(logp))``, detached, means over the whole batch."""
    lp = lax.stop_gradient(jnp.where(m > 0, logp, 0.0))
    a = jnp.where(m > 0, adv, 0.0)
    total = jnp.sum(m)
    return (a - jnp.sum(a * m) / total) * (lp - jnp.sum(lp * m) / total)


def _clip_cov(logp: jax.Array, old: jax.Array, adv: jax.Array, m: jax.Array, c: Any) -> Terms:
    low, high = _bounds(c)
    ratio = jnp.exp(_clamped(logp - old, c))
    pg1, pg2 = -adv * ratio, -adv * jnp.clip(ratio, 1 - low, 1 + high)
    cov = _covariance(logp, adv, m)
    eligible = (m > 0) & ~(pg2 > pg1) & (cov > c.clip_cov_lb) & (cov < c.clip_cov_ub)
    dropped = _largest(cov, eligible, max(int(c.clip_cov_ratio * float(jnp.sum(m))), 1))
    pg = jnp.where(dropped, 0.0, jnp.maximum(pg1, pg2))
    return pg, {"clip_fraction": dropped, "ppo_kl": old - logp}


def _kl_cov(logp: jax.Array, old: jax.Array, adv: jax.Array, m: jax.Array, c: Any) -> Terms:
    d = _clamped(logp - old, c)
    live = m > 0
    cov = _covariance(logp, adv, live.astype(jnp.float64))
    n = int(jnp.sum(live))
    penalised = _largest(cov, live, max(1, int(n * c.kl_cov_ratio)) if n else 0)
    pg = -adv * jnp.exp(d) + jnp.where(penalised, float(c.ppo_kl_coef) * jnp.abs(d), 0.0)
    return pg, {"ppo_kl": jnp.abs(lax.stop_gradient(d))}


def _geo_mean(logp: jax.Array, old: jax.Array, adv: jax.Array, m: jax.Array, c: Any) -> Terms:
    """Every token of a row carries its sequence's ``-mean_M(A) * exp(mean_M(lr))``."""
    low, high = _bounds(c)
    d = _clamped(logp - old, c)
    sign = jnp.sign(adv)
    clipped = jnp.clip(d, -low, high)
    lr = sign * jnp.minimum(sign * d, sign * clipped)
    per_row = -_seq_mean(adv, m) * jnp.exp(_seq_mean(lr, m))
    pg = jnp.broadcast_to(per_row, logp.shape)
    bitten = d != clipped
    out = {"clip_fraction": bitten & (adv > 0), "clip_fraction_lower": bitten & (adv < 0)}
    return pg, out | {"ppo_kl": old - logp}


MODES: dict[str, Callable[..., Terms]] = {
    "vanilla": _vanilla,
    "bypass_mode": _vanilla,
    "gspo": _gspo_token,
    "dppo_tv": _dppo,
    "dppo_kl": _dppo,
    "sapo": _sapo,
    "gpg": _gpg,
    "clip_cov": _clip_cov,
    "kl_cov": _kl_cov,
    "geo_mean": _geo_mean,
    "dro": _dro,
    "cispo": _cispo,
}


def pg_terms(
    config: Any, logp: jax.Array, old: jax.Array, adv: jax.Array, mask: jax.Array, /
) -> Terms:
    """``(pg, indicators)`` of ``config.loss_mode`` (``"vanilla"`` for a config without
    one); ``old``, ``adv``, ``mask`` ``[b, s]`` are read where ``mask > 0``. The bypass
    mode's ``"reinforce"`` loss is ``gpg``'s ``-A * logp``."""
    correction = getattr(config, "rollout_correction", None)
    mode = _value(getattr(config, "loss_mode", "vanilla"))
    if correction is not None and correction.loss_type == "reinforce":
        mode = "gpg"
    m = as_float64(mask)
    live = m > 0
    old = lax.stop_gradient(jnp.where(live, as_float64(old), logp))
    adv = jnp.where(live, lax.stop_gradient(as_float64(adv)), 0.0)
    pg, indicators = MODES[mode](logp, old, adv, m, config)
    return pg, {k: lax.stop_gradient(jnp.asarray(v, jnp.float64)) for k, v in indicators.items()}

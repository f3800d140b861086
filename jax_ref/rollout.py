"""Float64 references of the rollout correction (``hookspec.conventions``, "Rollout
correction"), on ``[b, s]`` rows whose every row is one sequence: the importance
weights and the rejection mask that ``torch_impl.processors.rollout_correction``
computes, written from the formulas alone."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
from jax import lax

__all__ = ["rollout_correction"]

BOUND = 20.0


def _row_sum(x: Any, mask: Any) -> Any:
    return jnp.sum(jnp.where(mask > 0, x, 0.0) * mask, axis=-1)


def _row_mean(x: Any, mask: Any) -> Any:
    return _row_sum(x, mask) / (jnp.sum(mask, axis=-1) + 1e-8)


def _row_max(x: Any, mask: Any) -> Any:
    top = jnp.max(jnp.where(mask > 0, x, -jnp.inf), axis=-1)
    return jnp.where(jnp.isinf(top), 0.0, top)


def _weights(log_ratio: Any, mask: Any, config: Any) -> Any:
    level = str(config.rollout_is)
    if level == "token":
        raw = jnp.exp(jnp.clip(log_ratio, -BOUND, BOUND))
    else:
        per_row = _row_sum(log_ratio, mask) if level == "sequence" else _row_mean(log_ratio, mask)
        raw = jnp.exp(jnp.clip(per_row, -BOUND, BOUND))[:, None] * jnp.ones_like(log_ratio)
    raw = raw * mask
    upper, lower = config.rollout_is_threshold, config.rollout_is_threshold_lower
    if lower is None:
        weights = jnp.minimum(raw, upper)
    else:
        weights = jnp.where((raw >= lower) & (raw <= upper), raw, 0.0)
    if config.rollout_is_batch_normalize:
        if level == "token":
            mean = jnp.sum(weights * mask) / (jnp.sum(mask) + 1e-8)
        else:
            counted = (jnp.sum(mask, axis=-1) > 0).astype(weights.dtype)
            mean = jnp.sum(_row_mean(weights, mask) * counted) / jnp.maximum(counted.sum(), 1e-8)
        weights = weights / jnp.where(mean > 1e-8, mean, 1.0)
    return weights


def _keep(log_ratio: Any, mask: Any, rejection: Any) -> Any:
    r = jnp.clip(log_ratio, -BOUND, BOUND)
    keep = jnp.ones_like(mask)
    for name, bounds in rejection.items():
        token = {"k1": -r, "k2": 0.5 * r * r, "k3": jnp.exp(r) - 1.0 - r}[name[-2:]]
        if name.startswith("token"):
            stat = token
        else:
            reduce = {"seq_sum": _row_sum, "seq_mean": _row_mean, "seq_max": _row_max}[name[:-3]]
            stat = reduce(token, mask)[:, None] * jnp.ones_like(token)
        if name.endswith("k1"):
            kept = (stat >= math.log(bounds.lower)) & (stat <= math.log(bounds.upper))
        else:
            kept = stat <= bounds.upper
        keep = keep * kept.astype(mask.dtype)
    return keep


def rollout_correction(old: Any, rollout: Any, mask: Any, config: Any) -> tuple[Any, Any]:
    """``(weights, keep)`` ``[b, s]`` of ``old`` against ``rollout`` under ``mask`` (0/1),
    by a ``RolloutCorrection`` ``config``; ``weights`` is ``None`` without ``rollout_is``.
    Nothing is differentiated (``stop_gradient`` on both)::

        log_ratio = where(M > 0, old - rollout, 0)
        w = min(exp(clip(level(log_ratio), -20, 20)), upper) * M       # or IcePop's bounds
        keep = prod over rejection options of (lower <= stat <= upper)
    """
    old, rollout = lax.stop_gradient(old), lax.stop_gradient(rollout)
    mask = (jnp.asarray(mask) > 0).astype(jnp.float64)
    log_ratio = jnp.where(mask > 0, old - rollout, 0.0)
    weights = None if config.rollout_is is None else _weights(log_ratio, mask, config)
    keep = _keep(log_ratio, mask, config.rollout_rs)
    return weights, keep

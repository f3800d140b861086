"""float64 JAX references for the standard quantities of ``hookspec.conventions``.

Pure functions of JAX arrays; each casts its floating inputs to float64 and so
must run inside :func:`jax_ref.float64` (it raises a ``ContractError`` where
float64 is off). Gradients come from ``jax.vjp``; the tests check every one
with ``jax.test_util.check_grads``. Shapes: ``z`` logits ``[..., V]``, ``y``
labels ``[...]``, per-token arrays ``[b, s]``; ``T`` a temperature, a scalar or
one value per token ``[...]``.

The vocab-parallel entry point :func:`linear_logprobs` takes a
``hookspec.Collectives`` (identity by default, :class:`jax_ref.JaxCollectives`
inside ``shard_map``) and the first global id of its weight shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from hookspec import (
    IGNORE_INDEX,
    Aggregation,
    Collectives,
    ContractError,
    KLEstimator,
    SingleProcessCollectives,
)

from ._x64 import as_float64

__all__ = [
    "LinearLogprobs",
    "aggregate",
    "clipped_objective",
    "gspo_loss",
    "gspo_ratio",
    "kl_penalty",
    "linear_logits",
    "linear_logprobs",
    "ppo_loss",
    "token_entropy",
    "token_logprobs",
]

_SINGLE = SingleProcessCollectives()


def _temperature(temperature: Any, like: jax.Array) -> jax.Array:
    t = as_float64(temperature, where="temperature")
    return jnp.broadcast_to(t, like.shape) if t.ndim else t


def linear_logits(
    hidden: jax.Array,
    weight: jax.Array,
    /,
    *,
    bias: jax.Array | None = None,
    scale: float = 1.0,
    softcap: float | None = None,
) -> jax.Array:
    """``[..., h] x [V, h] -> [..., V]`` in float64 (``scale`` is Megatron's MuP
    ``mup_output_mult``, else 1; ``softcap`` ``s > 0``: Gemma's
    ``final_logit_softcapping``, after the scale, ``hookspec.conventions``)::

        u = (hidden @ weight.T + bias) * scale
        z = s * tanh(u / s)      # with softcap; else z = u
    """
    z = as_float64(hidden) @ as_float64(weight).T
    if bias is not None:
        z = z + as_float64(bias)
    z = z * scale
    if softcap is None:
        return z
    if not softcap > 0:
        raise ContractError("softcap", expected="None or a number > 0", actual=repr(softcap))
    return softcap * jnp.tanh(z / softcap)


def token_logprobs(
    logits: jax.Array,
    labels: jax.Array,
    /,
    *,
    temperature: Any = 1.0,
    ignore_index: int = IGNORE_INDEX,
) -> jax.Array:
    """``where(y == ignore_index, 0, log_softmax(z / T)[y])``: ``[..., V] -> [...]``.

    Over the full vocabulary, plainly: ``jax.nn.log_softmax``.
    """
    z = as_float64(logits)
    t = _temperature(temperature, labels)
    lp = jax.nn.log_softmax(z / (t[..., None] if t.ndim else t), axis=-1)
    ignored = labels == ignore_index
    safe = jnp.where(ignored, 0, labels)
    picked = jnp.take_along_axis(lp, safe[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.where(ignored, 0.0, picked)


def token_entropy(logits: jax.Array, /, *, temperature: Any = 1.0) -> jax.Array:
    """``-sum(p * log p)`` with ``p = softmax(z / T)``: ``[..., V] -> [...]``, ``>= 0``."""
    z = as_float64(logits)
    t = _temperature(temperature, z[..., 0])
    zt = z / (t[..., None] if t.ndim else t)
    lp = jax.nn.log_softmax(zt, axis=-1)
    return -jnp.sum(jnp.exp(lp) * lp, axis=-1)


@dataclasses.dataclass(frozen=True)
class LinearLogprobs:
    """``logprobs`` ``[...]`` (0 at ignored labels); ``entropy`` ``[...]`` or None;
    ``lse`` ``[...]``: ``logsumexp(z)`` over every shard, every token (None only where
    a caller builds the result without it); ``mean_logit`` ``[...]``: ``mean(z)``
    over the whole vocabulary (column-weighted with ``mean_logit_weights``), or None
    unless asked for (``with_mean_logit``)."""

    logprobs: jax.Array
    entropy: jax.Array | None = None
    lse: jax.Array | None = None
    mean_logit: jax.Array | None = None


def linear_logprobs(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    /,
    *,
    temperature: Any = 1.0,
    ignore_index: int = IGNORE_INDEX,
    with_entropy: bool = False,
    vocab_start: Any = 0,
    bias: jax.Array | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    with_mean_logit: bool = False,
    mean_logit_weights: jax.Array | None = None,
    collectives: Collectives = _SINGLE,
) -> LinearLogprobs:
    """Selected-token logprob (and entropy) from hidden states and a vocab shard.

    ``hidden [..., h]``, ``weight [V_local, h]`` holding global ids
    ``[vocab_start, vocab_start + V_local)``, ``labels [...]`` global ids. The
    contract's vocab-parallel recipe, which is the plain one on one shard::

        z   = linear_logits(hidden, weight, bias=bias, scale=logit_scale, softcap=softcap) / T
        m   = all_reduce_max(stop_gradient(max(z, -1)))
        se  = all_reduce_sum(sum(exp(z - m), -1))
        lse = m + log(se)
        z_y = all_reduce_sum(z[y - vocab_start] if y is local else 0)
        logprobs = where(y == ignore_index, 0, z_y - lse)
        entropy  = lse - all_reduce_sum(sum(exp(z - m) * z, -1)) / se
        V        = all_reduce_sum(V_local)                            # with_mean_logit
        mean_logit = all_reduce_sum(sum(c * z, -1)) / V               # c = mean_logit_weights,
                                                                      #   else 1

    ``mean_logit`` is label smoothing's statistic (``hookspec.conventions``):
    ``mean(z)`` over every shard's columns, or with ``mean_logit_weights``
    ``[V_local]`` (this shard's class weights ``cw[j]``, held constant)
    ``sum_j cw[j] * z_j / V``.
    """
    z = linear_logits(hidden, weight, bias=bias, scale=logit_scale, softcap=softcap)
    t = _temperature(temperature, labels)
    z = z / (t[..., None] if t.ndim else t)
    m = collectives.all_reduce_max(lax.stop_gradient(jnp.max(z, axis=-1)))
    e = jnp.exp(z - m[..., None])
    se = collectives.all_reduce_sum(jnp.sum(e, axis=-1))
    lse = m + jnp.log(se)
    local = labels.astype(jnp.int32) - vocab_start
    rows = z.shape[-1]
    here = (local >= 0) & (local < rows)
    picked = jnp.take_along_axis(z, jnp.clip(local, 0, rows - 1)[..., None], axis=-1)[..., 0]
    z_y = collectives.all_reduce_sum(jnp.where(here, picked, 0.0))
    logprobs = jnp.where(labels == ignore_index, 0.0, z_y - lse)
    entropy = None
    if with_entropy:
        entropy = lse - collectives.all_reduce_sum(jnp.sum(e * z, axis=-1)) / se
    mean_logit = None
    if with_mean_logit or mean_logit_weights is not None:
        zc = z
        if mean_logit_weights is not None:
            c = lax.stop_gradient(as_float64(mean_logit_weights, where="mean_logit_weights"))
            if c.shape != (rows,):
                raise ContractError(
                    "mean_logit_weights",
                    expected=f"None or an array [V_local={rows}]",
                    actual=list(c.shape),
                )
            zc = z * c
        size = collectives.all_reduce_sum(jnp.asarray(float(rows), dtype=z.dtype))
        mean_logit = collectives.all_reduce_sum(jnp.sum(zc, axis=-1)) / size
    return LinearLogprobs(logprobs=logprobs, entropy=entropy, lse=lse, mean_logit=mean_logit)


def kl_penalty(
    logp: jax.Array,
    ref: jax.Array,
    /,
    *,
    estimator: KLEstimator | str,
    clamp: float | None = None,
    value_clamp: float | None = None,
    straight_through: bool = False,
) -> jax.Array:
    """Per-token KL estimate, ``log_ratio = ref - logp`` (clipped to ``[-clamp,
    clamp]`` when ``clamp`` is set); the value clipped to ``[-value_clamp, value_clamp]``;
    ``straight_through``: the value with k2's gradient::

    k1 = -log_ratio;  k2 = log_ratio ** 2 / 2;  k3 = exp(log_ratio) - log_ratio - 1
    abs = |log_ratio|
    """
    try:
        kind = KLEstimator(estimator)
    except ValueError:
        raise ContractError(
            "estimator", expected=[k.value for k in KLEstimator], actual=repr(estimator)
        ) from None
    logp, ref = as_float64(logp), as_float64(ref)
    log_ratio = _clip(ref - logp, clamp)
    if kind is KLEstimator.K1:
        value = -log_ratio
    elif kind is KLEstimator.K2:
        value = log_ratio**2 / 2
    elif kind is KLEstimator.ABS:
        value = jnp.abs(log_ratio)
    else:
        value = jnp.exp(log_ratio) - log_ratio - 1
    value = _clip(value, value_clamp)
    if not straight_through or kind is KLEstimator.K2:
        return value
    k2 = (logp - ref) ** 2 / 2
    return k2 - lax.stop_gradient(k2) + lax.stop_gradient(value)


def _clip(x: jax.Array, bound: float | None) -> jax.Array:
    return x if bound is None else jnp.clip(x, -bound, bound)


def clipped_objective(
    ratio: jax.Array,
    advantages: jax.Array,
    /,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
) -> jax.Array:
    """``max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))``, then, when
    ``dual_clip`` is set, ``min(., -A * dual_clip)`` where ``A < 0``."""
    eps_high = eps_low if eps_high is None else eps_high
    a = as_float64(advantages)
    loss = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 1 - eps_low, 1 + eps_high))
    if dual_clip is not None:
        loss = jnp.where(a < 0, jnp.minimum(loss, -a * dual_clip), loss)
    return loss


def ppo_loss(
    logp: jax.Array,
    old: jax.Array,
    advantages: jax.Array,
    /,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
) -> jax.Array:
    """The clipped PPO loss per token, ``[b, s]``::

    ratio = exp(clip(logp - old, -log_ratio_clamp, log_ratio_clamp))   # no clip when None
    loss = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
    loss = where(A < 0, min(loss, -A * dual_clip), loss)   # when dual_clip is set
    """
    ratio = jnp.exp(_clip(as_float64(logp) - as_float64(old), log_ratio_clamp))
    return clipped_objective(
        ratio, advantages, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip
    )


def gspo_ratio(
    logp: jax.Array, old: jax.Array, mask: jax.Array, /, *, log_ratio_clamp: float | None = None
) -> jax.Array:
    """GSPO's sequence-level ratio at every token of the sequence, ``[b, s]``::

    # [b], 0 if sum_s(M) == 0
    seq_log_ratio = clip(sum_s(M * (logp - old)) / sum_s(M), -clamp, clamp)
    ratio = exp(seq_log_ratio)[:, None]                                        # broadcast over s

    Differentiated through the mean: ``d ratio_b / d logp_t = ratio_b * M_t /
    sum_s(M)`` (none where the clamp binds), so a token's gradient gathers the
    advantages of its whole sequence. With one advantage per sequence and the
    seq-mean-token-mean aggregation this is GSPO's sequence objective, and its
    gradient equals that of the "GSPO-token" form ``exp(sg(seq_log_ratio) +
    logp - sg(logp))``; with per-token advantages the two differ, and this is
    the one the contract's policy loss computes.
    """
    lp, m = as_float64(logp), as_float64(mask)
    raw = jnp.sum(m * (lp - as_float64(old)), axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)
    return jnp.broadcast_to(jnp.exp(_clip(raw, log_ratio_clamp))[:, None], lp.shape)


def gspo_loss(
    logp: jax.Array,
    old: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    /,
    *,
    eps_low: float = 3e-4,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
) -> jax.Array:
    """GSPO's clipped loss per token, ``[b, s]``: :func:`clipped_objective` of
    :func:`gspo_ratio`; ``advantages`` ``[b]`` or ``[b, s]``."""
    a = as_float64(advantages)
    a = a[:, None] if a.ndim == 1 else a
    ratio = gspo_ratio(logp, old, mask, log_ratio_clamp=log_ratio_clamp)
    return clipped_objective(ratio, a, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)


def aggregate(
    loss: jax.Array,
    mask: jax.Array,
    /,
    *,
    mode: Aggregation | str,
    loss_scale_factor: float | None = None,
) -> jax.Array:
    """A per-token loss ``[b, s]`` under a mask ``[b, s]`` to a scalar::

    token-mean:          sum(L * M) / sum(M)
    seq-mean-token-sum:  mean over sequences with sum_s M > 0 of sum_s(L * M)
    seq-mean-token-mean: mean over sequences with sum_s M > 0 of sum_s(L * M) / sum_s(M)
    token-sum:           sum(L * M)
    seq-mean-token-sum-norm: seq-mean-token-sum / F      # F: loss_scale_factor, default s

    An empty mask gives ``0.0`` with a zero gradient.
    """
    try:
        kind = Aggregation(mode)
    except ValueError:
        raise ContractError(
            "mode", expected=[a.value for a in Aggregation], actual=repr(mode)
        ) from None
    lm = as_float64(loss) * as_float64(mask)
    m = as_float64(mask)
    if kind is Aggregation.TOKEN_SUM:
        return jnp.sum(lm)
    if kind is Aggregation.TOKEN_MEAN:
        total = jnp.sum(m)
        return jnp.where(total > 0, jnp.sum(lm) / jnp.maximum(total, 1.0), 0.0)
    per_seq_count = jnp.sum(m, axis=-1)
    per_seq = jnp.sum(lm, axis=-1)
    if kind is Aggregation.SEQ_MEAN_TOKEN_MEAN:
        per_seq = per_seq / jnp.maximum(per_seq_count, 1.0)
    valid = per_seq_count > 0
    n = jnp.sum(valid)
    mean = jnp.where(n > 0, jnp.sum(jnp.where(valid, per_seq, 0.0)) / jnp.maximum(n, 1), 0.0)
    if kind is Aggregation.SEQ_MEAN_TOKEN_SUM_NORM:
        return mean / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return mean

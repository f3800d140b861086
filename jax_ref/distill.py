"""float64 JAX references for top-k logprobs and distillation (``hookspec.conventions``).

Two levels, as in :mod:`jax_ref.references` and :mod:`jax_ref.processors`:

- tensor functions: :func:`linear_topk_logprobs` (vocab parallel through a
  ``hookspec.Collectives``), :func:`divergence`, :func:`sparse_divergence`;
- references of the processors, ``(hidden [s, b, h], weight [V_local, h],
  inputs) -> outputs``: :func:`topk_logprobs` and :func:`distillation_loss`,
  which run on one shard or under :func:`jax_ref.sharded.shard_reference`.

They materialise the logits of their shard and follow the plain formulas;
nothing here imports torch. Run them inside :func:`jax_ref.float64`.
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
    DistillDivergence,
    SingleProcessCollectives,
    TeacherTail,
)

from ._x64 import as_float64
from .collectives import gather_vocab
from .inputs import ReferenceInputs
from .references import aggregate, linear_logits

__all__ = [
    "TopkLogprobs",
    "distillation_loss",
    "divergence",
    "linear_topk_logprobs",
    "sparse_divergence",
    "topk_logprobs",
]

_SINGLE = SingleProcessCollectives()


def _lse(z: jax.Array, collectives: Collectives) -> jax.Array:
    """``logsumexp(z, -1)`` over every shard's columns."""
    m = collectives.all_reduce_max(lax.stop_gradient(jnp.max(z, axis=-1)))
    return m + jnp.log(collectives.all_reduce_sum(jnp.sum(jnp.exp(z - m[..., None]), axis=-1)))


def _pick(z: jax.Array, ids: jax.Array, vocab_start: Any, collectives: Collectives) -> jax.Array:
    """``z_full[..., ids]`` from the shards: each picks the ids it holds, summed."""
    local = ids.astype(jnp.int32) - vocab_start
    rows = z.shape[-1]
    here = (local >= 0) & (local < rows)
    picked = jnp.take_along_axis(z, jnp.clip(local, 0, rows - 1), axis=-1)
    return collectives.all_reduce_sum(jnp.where(here, picked, 0.0))


@dataclasses.dataclass(frozen=True)
class TopkLogprobs:
    """``logprobs [..., k]``, ``ids [..., k]`` (int32), ``label_logprobs [...]`` or
    None, ``entropy [...]`` or None."""

    logprobs: jax.Array
    ids: jax.Array
    label_logprobs: jax.Array | None = None
    entropy: jax.Array | None = None


def linear_topk_logprobs(
    hidden: jax.Array,
    weight: jax.Array,
    /,
    *,
    k: int,
    labels: jax.Array | None = None,
    temperature: Any = 1.0,
    ignore_index: int = IGNORE_INDEX,
    with_entropy: bool = False,
    vocab_start: Any = 0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    collectives: Collectives = _SINGLE,
) -> TopkLogprobs:
    """The ``k`` largest logprobs and their ids, plainly::

    z   = linear_logits(hidden, weight, scale=logit_scale, softcap=softcap) / T   # [..., V_local]
    lse = logsumexp over every shard (all_reduce_max, all_reduce_sum)
    ids = argsort(-all_gather(z), stable)[..., :k]                   # ties: the smaller id
    logprobs = all_reduce_sum(z[ids] where local) - lse
    """
    z = linear_logits(hidden, weight, scale=logit_scale, softcap=softcap)
    t = as_float64(temperature, where="temperature")
    z = z / (t[..., None] if t.ndim else t)
    lse = _lse(z, collectives)
    full = gather_vocab(collectives, z) if _split(collectives) else lax.stop_gradient(z)
    ids = jnp.argsort(-full, axis=-1, stable=True)[..., :k].astype(jnp.int32)
    logprobs = _pick(z, ids, vocab_start, collectives) - lse[..., None]
    label = entropy = None
    if labels is not None:
        ignored = labels == ignore_index
        safe = jnp.where(ignored, 0, labels)[..., None]
        label = jnp.where(ignored, 0.0, _pick(z, safe, vocab_start, collectives)[..., 0] - lse)
    if with_entropy:
        p = jnp.exp(z - lse[..., None])
        entropy = lse - collectives.all_reduce_sum(jnp.sum(p * z, axis=-1))
    return TopkLogprobs(logprobs=logprobs, ids=ids, label_logprobs=label, entropy=entropy)


def _split(collectives: Collectives) -> bool:
    return not isinstance(collectives, SingleProcessCollectives)


def _weighted(w: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``sum(w * (a - b), -1)``, a term whose ``w`` is 0 being 0 (double ``where``:
    no NaN gradient from an infinite ``a - b`` there)."""
    zero = w == 0
    return jnp.sum(jnp.where(zero, 0.0, w * jnp.where(zero, 0.0, a - b)), axis=-1)


def divergence(
    log_p: jax.Array, log_q: jax.Array, /, *, kind: DistillDivergence | str, beta: float = 0.5
) -> jax.Array:
    """``D(P, Q)`` over the last axis (``hookspec.conventions``)::

    forward-kl: sum(P (log P - log Q));  reverse-kl: sum(Q (log Q - log P))
    jsd(beta):  beta sum(P (log P - log M)) + (1 - beta) sum(Q (log Q - log M)),
                M = beta P + (1 - beta) Q
    """
    kind = DistillDivergence(kind)
    p, q = jnp.exp(log_p), jnp.exp(log_q)
    if kind is DistillDivergence.FORWARD_KL:
        return _weighted(p, log_p, log_q)
    if kind is DistillDivergence.REVERSE_KL:
        return _weighted(q, log_q, log_p)
    log_m = jnp.logaddexp(jnp.log(beta) + log_p, jnp.log1p(-beta) + log_q)
    return beta * _weighted(p, log_p, log_m) + (1 - beta) * _weighted(q, log_q, log_m)


def sparse_divergence(
    teacher_logprobs: jax.Array,
    student_logprobs: jax.Array,
    /,
    *,
    kind: DistillDivergence | str,
    tail: TeacherTail | str,
    beta: float = 0.5,
) -> jax.Array:
    """``D`` per token of a sparse teacher: ``teacher_logprobs`` ``lp_t [..., k]``
    and the student's full-vocabulary logprobs at the same ids ``log q [..., k]``::

    renormalize: log P = lp_t - logsumexp(lp_t);  log Q = log q - logsumexp(log q)
    bucket:      log P = [lp_t, log(max(1 - sum(exp(lp_t)), 0))]
                 log Q = [log q, log(max(1 - sum(exp(log q)), tiny))]
    """
    lp_t = as_float64(teacher_logprobs)
    if TeacherTail(tail) is TeacherTail.RENORMALIZE:
        log_p = lp_t - jax.scipy.special.logsumexp(lp_t, axis=-1, keepdims=True)
        log_q = student_logprobs - jax.scipy.special.logsumexp(
            student_logprobs, axis=-1, keepdims=True
        )
    else:
        p_tail = jnp.maximum(1 - jnp.sum(jnp.exp(lp_t), axis=-1), 0.0)
        tiny = jnp.finfo(student_logprobs.dtype).tiny
        q_tail = jnp.maximum(1 - jnp.sum(jnp.exp(student_logprobs), axis=-1), tiny)
        log_p_tail = jnp.where(p_tail > 0, jnp.log(jnp.where(p_tail > 0, p_tail, 1.0)), -jnp.inf)
        log_p = jnp.concatenate([lp_t, log_p_tail[..., None]], axis=-1)
        log_q = jnp.concatenate([student_logprobs, jnp.log(q_tail)[..., None]], axis=-1)
    return divergence(log_p, log_q, kind=kind, beta=beta)


# ---------------------------------------------------------------- processor references


def _rows(inputs: ReferenceInputs, hidden: jax.Array) -> jax.Array:
    """``[s, b, h]`` -> ``[b, s, h]``, gathered over sequence parallel."""
    return inputs.collectives.gather_hidden_states(hidden).transpose(1, 0, 2)


def topk_logprobs(k: int, *, temperature: float | None = None, entropy: bool = False) -> Any:
    """The reference of ``torch_impl.processors.topk_logprobs(k)``: ``topk_logprobs``
    ``[b, s, k]``, ``topk_ids`` ``[b, s, k]`` (as float64, exact integers, so that
    ``jax.vjp`` takes a cotangent for every output), ``logprobs`` (with labels) and
    ``entropy`` (with ``entropy``); the temperature as ``jax_ref.processors``
    resolves it."""
    from .processors import context_temperature

    def topk_logprobs_reference(
        hidden: jax.Array, weight: jax.Array, inputs: ReferenceInputs
    ) -> Any:
        t = context_temperature(inputs, temperature)
        res = linear_topk_logprobs(
            _rows(inputs, hidden),
            weight,
            k=k,
            labels=inputs.labels,
            temperature=t,
            ignore_index=inputs.ignore_index,
            with_entropy=entropy,
            vocab_start=inputs.vocab_start,
            logit_scale=inputs.logit_scale,
            softcap=inputs.softcap,
            collectives=inputs.collectives,
        )
        out = {"topk_logprobs": res.logprobs, "topk_ids": res.ids.astype(jnp.float64)}
        if res.label_logprobs is not None:
            out["logprobs"] = res.label_logprobs
        if res.entropy is not None:
            out["entropy"] = res.entropy
        return out

    return topk_logprobs_reference


def distillation_loss(config: Any) -> Any:
    """The reference of ``torch_impl.processors.distillation_loss(config)``.

    ``config`` is read by attribute (``divergence``, ``beta``, ``tail``,
    ``temperature``, ``aggregation``): a ``DistillConfig`` serves as is. The user
    context holds ``ids`` and ``logprobs`` ``[b, s, k]`` (sparse) or
    ``hidden_states`` ``[s, b, h_t]`` and ``weight`` ``[V_local, h_t]`` (dense;
    ``full_weight`` ``[V, h_t]`` instead, where present, sliced at
    ``vocab_start``: what a sharded check needs), and ``mask``::

        M = where(labels == ignore_index, 0, mask or loss_mask or 1)
        z_s = linear_logits(hidden, weight, scale=inputs.logit_scale, softcap=inputs.softcap)
        z_t = linear_logits(h_t, w_t, scale=teacher.logit_scale, softcap=teacher.softcap)   # dense
        log q = log_softmax(z_s / T);  log p = log_softmax(z_t / T)       # dense,
                                                                          #   teacher stop_gradient
        D = divergence(log p, log q)                                      # dense, whole vocabulary
        D = sparse_divergence(lp_t, log q[ids], tail)                     # sparse
        loss = aggregate(D, M, aggregation)
        kl = token-mean over M of the forward KL (same treatment); top1_agreement likewise
    """
    kind = DistillDivergence(getattr(config.divergence, "value", config.divergence))
    tail = TeacherTail(getattr(config.tail, "value", config.tail))
    mode = Aggregation(getattr(config.aggregation, "value", config.aggregation))
    beta, temp = float(config.beta), float(config.temperature)

    def distillation_loss_reference(
        hidden: jax.Array, weight: jax.Array, inputs: ReferenceInputs
    ) -> Any:
        teacher, coll = inputs.context, inputs.collectives
        zs = linear_logits(
            _rows(inputs, hidden), weight, scale=inputs.logit_scale, softcap=inputs.softcap
        )
        zs = zs / temp  # [b, s, V_local]
        lse_s = _lse(zs, coll)
        full_s = gather_vocab(coll, zs) if _split(coll) else lax.stop_gradient(zs)
        top_s = jnp.argmax(full_s, axis=-1)
        if getattr(teacher, "ids", None) is not None:
            ids = jnp.asarray(teacher.ids).astype(jnp.int32)
            log_q_ids = _pick(zs, ids, inputs.vocab_start, coll) - lse_s[..., None]
            lp_t = lax.stop_gradient(teacher.logprobs)
            d = sparse_divergence(lp_t, log_q_ids, kind=kind, tail=tail, beta=beta)
            kl = sparse_divergence(lp_t, log_q_ids, kind=DistillDivergence.FORWARD_KL, tail=tail)
            top_t = ids[..., 0]
        else:
            tw = getattr(teacher, "full_weight", None)
            if tw is not None:
                tw = lax.dynamic_slice_in_dim(tw, inputs.vocab_start, weight.shape[0], axis=0)
            else:
                tw = teacher.weight
            th = lax.stop_gradient(_rows(inputs, teacher.hidden_states))
            t_scale = float(getattr(teacher, "logit_scale", 1.0))  # the teacher's own (MuP) factor
            t_cap = getattr(teacher, "softcap", None)  # and final-logit softcap
            zt = linear_logits(th, lax.stop_gradient(tw), scale=t_scale, softcap=t_cap)
            zt = lax.stop_gradient(zt / temp)
            log_p = zt - _lse(zt, coll)[..., None]
            log_q = zs - lse_s[..., None]
            d = coll.all_reduce_sum(divergence(log_p, log_q, kind=kind, beta=beta))
            kl = coll.all_reduce_sum(divergence(log_p, log_q, kind=DistillDivergence.FORWARD_KL))
            top_t = jnp.argmax(gather_vocab(coll, zt) if _split(coll) else zt, axis=-1)
        mask = getattr(teacher, "mask", None)
        mask = inputs.loss_mask if mask is None else mask
        m = jnp.ones(lse_s.shape) if mask is None else as_float64(mask)
        if inputs.labels is not None:
            m = jnp.where(inputs.labels == inputs.ignore_index, 0.0, m)
        counted = m != 0
        d = jnp.where(counted, d, 0.0)
        agree = (top_s == top_t).astype(jnp.float64)
        return {
            "loss": aggregate(d, m, mode=mode),
            "kl": aggregate(lax.stop_gradient(jnp.where(counted, kl, 0.0)), m, mode="token-mean"),
            "top1_agreement": aggregate(agree, m, mode="token-mean"),
        }

    return distillation_loss_reference

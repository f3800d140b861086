"""float64 JAX references of sampling replay (``hookspec.conventions``, "Sampling
support"): the kept set of vLLM's min-p, top-k and top-p rule on materialised logits
(:func:`kept_mask`), the logprob and entropy renormalised over a kept set given as ids or
by that rule (:func:`linear_sampling_logprobs`, vocab parallel through a
``hookspec.Collectives``), and the reference of ``torch_impl.processors.selected_logprobs``
with a support (:func:`selected_logprobs`).

They materialise the logits and follow the plain formulas; nothing here imports torch.
Run them inside :func:`jax_ref.float64`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from hookspec import IGNORE_INDEX, Collectives, ContractError, SingleProcessCollectives

from ._x64 import as_float64
from .collectives import gather_vocab
from .inputs import ReferenceInputs
from .references import linear_logits

__all__ = [
    "SamplingLogprobs",
    "kept_mask",
    "linear_sampling_logprobs",
    "sampling_support_of",
    "selected_logprobs",
]

_SINGLE = SingleProcessCollectives()


def kept_mask(
    z: jax.Array, /, *, top_k: Any = None, top_p: Any = None, min_p: Any = None
) -> jax.Array:
    """The tokens vLLM's sampler keeps, ``[..., V]`` bool, from the tempered logits of
    the whole vocabulary ``z [..., V]``; each parameter a number, ``[...]``, or None (not
    applied), in vLLM's order, every comparison on ``z`` as given::

        keep = z >= max(z) + log(min_p)
        keep &= z >= kth_largest(where(keep, z, -inf), top_k)        # top_k >= V: all
        q = softmax(where(keep, z, -inf));  above_j = sum_i q_i [z_i > z_j]
        keep &= above_j < top_p                                       # a tie group whole
    """
    z = lax.stop_gradient(as_float64(z))
    keep = jnp.ones(z.shape, dtype=bool)
    if min_p is not None:
        floor = jnp.max(z, axis=-1) + jnp.log(as_float64(min_p))
        keep = keep & (z >= floor[..., None])
    if top_k is not None:
        v = z.shape[-1]
        zk = jnp.where(keep, z, -jnp.inf)
        k = jnp.minimum(jnp.asarray(top_k), v) * jnp.ones(z.shape[:-1], dtype=jnp.int32)
        kth = jnp.take_along_axis(jnp.sort(zk, axis=-1), (v - k)[..., None], axis=-1)
        keep = keep & (zk >= kth)
    if top_p is not None:
        q = jax.nn.softmax(jnp.where(keep, z, -jnp.inf), axis=-1)
        greater = z[..., None, :] > z[..., :, None]  # [..., j, i]: z_i > z_j
        above = jnp.sum(jnp.where(greater, q[..., None, :], 0.0), axis=-1)
        keep = keep & (above < as_float64(top_p)[..., None])
    return keep


@dataclasses.dataclass(frozen=True)
class SamplingLogprobs:
    """``logprobs``, ``entropy``, ``kept_logmass``, ``[...]`` each (the rows of
    ``labels``)."""

    logprobs: jax.Array
    entropy: jax.Array
    kept_logmass: jax.Array


def _masked_lse(z: jax.Array, mask: jax.Array, collectives: Collectives) -> jax.Array:
    """``logsumexp(z[mask])`` over every shard's columns (-inf where none is kept)."""
    top = jnp.max(jnp.where(mask, lax.stop_gradient(z), -jnp.inf), axis=-1)
    m = collectives.all_reduce_max(top)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    safe = jnp.where(mask, z, m[..., None])  # no exp of an unkept logit (no NaN gradient)
    s = collectives.all_reduce_sum(jnp.sum(jnp.where(mask, jnp.exp(safe - m[..., None]), 0), -1))
    return m + jnp.log(s)


def linear_sampling_logprobs(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    /,
    *,
    kept_ids: jax.Array | None = None,
    top_k: Any = None,
    top_p: Any = None,
    min_p: Any = None,
    temperature: Any = 1.0,
    ignore_index: int = IGNORE_INDEX,
    vocab_start: Any = 0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    collectives: Collectives = _SINGLE,
) -> SamplingLogprobs:
    """The label's logprob and the entropy of the distribution renormalised over the
    kept tokens, plainly::

        z = linear_logits(hidden, weight, scale=logit_scale, softcap=softcap) / T   # [..., V_local]
        kept = any(kept_ids == id)  or  kept_mask(all_gather(z), top_k, top_p, min_p)
        lse_k = logsumexp(z[kept])                    # over every shard
        logprobs = where(ignored, 0, where(y kept, z[y] - lse_k, -inf))
        entropy = -sum(q * log q),  q = softmax(z[kept])      # 0 where nothing is kept
        kept_logmass = lse_k - logsumexp(z)
    """
    z = linear_logits(hidden, weight, scale=logit_scale, softcap=softcap)
    t = as_float64(temperature, where="temperature")
    z = z / (t[..., None] if t.ndim else t)
    local = z.shape[-1]
    ids = vocab_start + jnp.arange(local)
    if kept_ids is None:
        full = kept_mask(gather_vocab(collectives, z), top_k=top_k, top_p=top_p, min_p=min_p)
        mask = lax.dynamic_slice_in_dim(full, vocab_start, local, axis=-1)
    else:
        mask = jnp.any(kept_ids[..., :, None] == ids, axis=-2)
    lse_k = _masked_lse(z, mask, collectives)
    lse = _masked_lse(z, jnp.ones_like(mask), collectives)
    ignored = labels == ignore_index
    at_label = ids == jnp.where(ignored, -1, labels)[..., None]
    zy = collectives.all_reduce_sum(jnp.sum(jnp.where(at_label & mask, z, 0.0), axis=-1))
    kept_y = collectives.all_reduce_sum(jnp.sum(at_label & mask, axis=-1)) > 0
    safe = jnp.where(mask, z - lse_k[..., None], 0.0)  # log q where kept
    q = jnp.where(mask, jnp.exp(safe), 0.0)
    entropy = -collectives.all_reduce_sum(jnp.sum(q * safe, axis=-1))
    entropy = jnp.where(jnp.isfinite(lse_k), entropy, 0.0)
    logprobs = jnp.where(kept_y, zy - lse_k, -jnp.inf)
    return SamplingLogprobs(
        logprobs=jnp.where(ignored, 0.0, logprobs), entropy=entropy, kept_logmass=lse_k - lse
    )


def sampling_support_of(context: Any) -> Any:
    """The user context's ``sampling_support`` (a key or an attribute), or None."""
    if isinstance(context, Mapping):
        return context.get("sampling_support")
    return getattr(context, "sampling_support", None)


def selected_logprobs(
    *, temperature: float | None = None, entropy: bool = False, support: Any = None
) -> Any:
    """The reference of ``torch_impl.processors.selected_logprobs(support=...)``:
    ``{"logprobs": [b, s]}`` (and ``"entropy"``) renormalised over ``support`` (read by
    attribute: ``kept_ids``, ``top_k``, ``top_p``, ``min_p``), else the user context's
    ``sampling_support`` (``[b, s, K]`` ids or ``[b, s]`` parameters); the temperature as
    ``jax_ref.processors`` resolves it."""
    from .processors import context_temperature

    def selected_logprobs_reference(
        hidden: jax.Array, weight: jax.Array, inputs: ReferenceInputs
    ) -> Any:
        given = support if support is not None else sampling_support_of(inputs.context)
        if inputs.labels is None or given is None:
            raise ContractError(
                "sampling_support", expected="labels and a support", actual="one is missing"
            )
        res = linear_sampling_logprobs(
            inputs.collectives.gather_hidden_states(hidden).transpose(1, 0, 2),
            weight,
            inputs.labels,
            **{n: getattr(given, n, None) for n in ("kept_ids", "top_k", "top_p", "min_p")},
            temperature=context_temperature(inputs, temperature),
            ignore_index=inputs.ignore_index,
            vocab_start=inputs.vocab_start,
            logit_scale=inputs.logit_scale,
            softcap=inputs.softcap,
            collectives=inputs.collectives,
        )
        out = {"logprobs": res.logprobs}
        return out | {"entropy": res.entropy} if entropy else out

    return selected_logprobs_reference

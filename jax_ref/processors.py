"""JAX references for the built-in processors, as functions of
``(hidden [s, b, h], weight [V_local, h], inputs: ReferenceInputs)``.

Each mirrors a factory of ``torch_impl.processors`` and returns the same
structure; each follows the vocab-parallel recipe through
``inputs.collectives`` and ``inputs.vocab_start``, so it runs on one shard or
under :func:`jax_ref.sharded.shard_reference`. The policy loss reads its
configuration by attribute (``clip_low``, ``clip_high``, ``dual_clip``,
``ratio``, ``kl_coef``, ``kl_estimator``, ``entropy_coef``, ``aggregation``,
``log_ratio_clamp``), so a ``torch_impl.processors.PolicyLossConfig`` serves
as is and nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from hookspec import ContractError

from .inputs import ReferenceInputs
from .policy_family import pg_terms
from .references import (
    LinearLogprobs,
    aggregate,
    kl_penalty,
    linear_logprobs,
)
from .rollout import rollout_correction
from .sampling import linear_sampling_logprobs, sampling_support_of

__all__ = [
    "Reference",
    "context_temperature",
    "cross_entropy_loss",
    "policy_loss",
    "selected_logprobs",
    "token_logprobs_of",
]

Reference = Callable[[jax.Array, jax.Array, ReferenceInputs], Any]


def context_temperature(inputs: ReferenceInputs, given: float | None) -> Any:
    """``given``, else the user context's ``temperature`` (a number or ``[b, s]``), else 1."""
    from_context = getattr(inputs.context, "temperature", None)
    if given is not None and from_context is not None:
        raise ContractError(
            "temperature", expected="one source: the reference's or the context's", actual="both"
        )
    if from_context is not None:
        return from_context
    return 1.0 if given is None else given


def token_logprobs_of(
    hidden: jax.Array,
    weight: jax.Array,
    inputs: ReferenceInputs,
    /,
    *,
    temperature: Any = 1.0,
    with_entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """``[b, s]`` logprobs (0 at ignored labels) and entropy (``None`` unless
    ``with_entropy``) of ``hidden [s, b, h]`` against this shard's ``weight
    [V_local, h]``: :func:`jax_ref.references.linear_logprobs` after
    ``inputs.collectives.gather_hidden_states``, with ``inputs``' labels,
    ``ignore_index``, ``vocab_start``, ``collectives``, ``logit_scale``
    (MuP's output multiplier: applied, as Megatron's ``scale_logits`` does) and
    ``softcap`` (the final-logit softcap ``s``, after the scale)::

        u = gather_hidden_states(hidden).transpose(1, 0, 2) @ weight.T * logit_scale
        z = s * tanh(u / s) / temperature          # softcap s; else u / temperature
        logprobs = where(labels == ignore_index, 0, z[y] - logsumexp(z))   # over all shards

    ``temperature``: a number or ``[b, s]``; the user context's temperature is
    not read here (:func:`context_temperature` does that).
    """
    res = _token_results(hidden, weight, inputs, temperature=temperature, with_entropy=with_entropy)
    return res.logprobs, res.entropy


def _token_results(
    hidden: jax.Array,
    weight: jax.Array,
    inputs: ReferenceInputs,
    *,
    temperature: Any,
    with_entropy: bool,
    mean_logit_weights: jax.Array | None = None,
    with_mean_logit: bool = False,
) -> LinearLogprobs:
    """:func:`token_logprobs_of`'s :class:`LinearLogprobs` (``[b, s]`` each, ``lse``
    too; ``mean_logit`` with ``with_mean_logit``, column-weighted by ``mean_logit_weights``)."""
    if inputs.labels is None:
        raise ContractError(
            "labels", expected="token ids [b, s] (the reference needs them)", actual="None"
        )
    h = inputs.collectives.gather_hidden_states(hidden).transpose(1, 0, 2)  # [b, s, h]
    return linear_logprobs(
        h,
        weight,
        inputs.labels,
        temperature=temperature,
        ignore_index=inputs.ignore_index,
        with_entropy=with_entropy,
        vocab_start=inputs.vocab_start,
        logit_scale=inputs.logit_scale,
        softcap=inputs.softcap,
        with_mean_logit=with_mean_logit,
        mean_logit_weights=mean_logit_weights,
        collectives=inputs.collectives,
    )


def selected_logprobs(*, temperature: float | None = None, entropy: bool = False) -> Reference:
    """``{"logprobs": [b, s]}`` and, with ``entropy``, ``{"entropy": [b, s]}``;
    the temperature as :func:`context_temperature` resolves it."""

    def selected_logprobs_reference(
        hidden: jax.Array, weight: jax.Array, inputs: ReferenceInputs
    ) -> Any:
        t = context_temperature(inputs, temperature)
        lp, ent = token_logprobs_of(hidden, weight, inputs, temperature=t, with_entropy=entropy)
        return {"logprobs": lp, "entropy": ent} if entropy else {"logprobs": lp}

    return selected_logprobs_reference


def cross_entropy_loss(
    *,
    z_loss: float = 0.0,
    temperature: float = 1.0,
    class_weights: Any = None,
    label_smoothing: float = 0.0,
) -> Reference:
    """Unreduced cross entropy ``[b, s]`` with an optional z-loss, class weights
    ``cw [V]`` and label smoothing ``eps`` (``hookspec.conventions``; PyTorch's
    ``F.cross_entropy(weight=cw, label_smoothing=eps, reduction="none")`` of the
    tempered logits, plus the z-loss), 0 at ignored labels::

        lse = logsumexp(z)                                  # over every shard, at temperature
        smooth = mean(cw) * lse - sum_j cw[j] * z_j / V     # = sum_j cw[j] * -log_softmax(z)_j / V
        loss = where(labels == ignore_index, 0,
                     (1 - eps) * -cw[labels] * logprob + eps * smooth + z_loss * lse ** 2)

    (``cw`` all 1 without class weights: ``smooth = lse - mean(z)``.)
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ContractError(
            "label_smoothing", expected="a number in [0, 1]", actual=repr(label_smoothing)
        )

    def cross_entropy_reference(
        hidden: jax.Array, weight: jax.Array, inputs: ReferenceInputs
    ) -> Any:
        cw = None if class_weights is None else jnp.asarray(class_weights, dtype=jnp.float64)
        cw_local = None
        if cw is not None and label_smoothing != 0.0:
            cw_local = lax.dynamic_slice_in_dim(cw, inputs.vocab_start, weight.shape[0])
        res = _token_results(
            hidden,
            weight,
            inputs,
            temperature=temperature,
            with_entropy=False,
            with_mean_logit=label_smoothing != 0.0,
            mean_logit_weights=cw_local,
        )
        assert inputs.labels is not None  # _token_results refused None
        ignored = inputs.labels == inputs.ignore_index
        ce = -res.logprobs
        if cw is not None:
            ce = jnp.where(ignored, 0.0, cw[jnp.where(ignored, 0, inputs.labels)] * ce)
        if label_smoothing != 0.0:
            assert res.lse is not None and res.mean_logit is not None
            cw_mean = 1.0 if cw is None else jnp.mean(cw)
            smooth = jnp.where(ignored, 0.0, cw_mean * res.lse - res.mean_logit)
            ce = (1.0 - label_smoothing) * ce + label_smoothing * smooth
        if z_loss == 0.0:
            return ce
        assert res.lse is not None
        return jnp.where(ignored, 0.0, z_loss * res.lse**2) + ce

    return cross_entropy_reference


def _token_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return aggregate(lax.stop_gradient(x), mask, mode="token-mean")


def _rollout_corrected(
    config: Any, batch: Any, logp: jax.Array, mask: jax.Array, old: jax.Array
) -> tuple[jax.Array, jax.Array, Any]:
    """``(mask * keep, old, weights)`` under ``config.rollout_correction``: the decoupled
    PPO compares ``old`` with the rollout's logprobs; bypass mode the current ``logp``
    (detached), and the rollout's become ``old`` (weights applied by "reinforce" only)."""
    correction = getattr(config, "rollout_correction", None)
    if correction is None:
        return mask, old, None
    rollout = lax.stop_gradient(jnp.asarray(batch.rollout_logprobs, jnp.float64))
    behaviour = lax.stop_gradient(logp) if correction.bypass_mode else old
    weights, keep = rollout_correction(behaviour, rollout, mask, correction)
    if correction.bypass_mode:
        old = rollout
        if correction.loss_type == "ppo_clip":
            weights = None
    return mask * keep, old, weights


def _on_support(
    hidden: jax.Array,
    weight: jax.Array,
    inputs: ReferenceInputs,
    support: Any,
    temperature: Any,
    mask: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(logp, entropy, mask, outside_fraction)`` with a sampling support: the label's
    logprob and the entropy renormalised over the kept tokens (``logp`` 0 where it is -inf),
    and the mask without the counted tokens outside the support (the current, old or
    rollout logprob -inf), whose share of the counted tokens is ``outside_fraction``."""
    assert inputs.labels is not None  # a policy loss reads labels (checked before)
    res = linear_sampling_logprobs(
        inputs.collectives.gather_hidden_states(hidden).transpose(1, 0, 2),
        weight,
        inputs.labels,
        **{n: getattr(support, n, None) for n in ("kept_ids", "top_k", "top_p", "min_p")},
        temperature=temperature,
        ignore_index=inputs.ignore_index,
        vocab_start=inputs.vocab_start,
        logit_scale=inputs.logit_scale,
        softcap=inputs.softcap,
        collectives=inputs.collectives,
    )
    batch = inputs.context
    outside = jnp.isneginf(res.logprobs)
    for given in (batch.old_logprobs, getattr(batch, "rollout_logprobs", None)):
        if given is not None:
            outside = outside | jnp.isneginf(jnp.asarray(given, jnp.float64))
    outside = outside & (mask > 0)
    fraction = _token_mean(outside.astype(jnp.float64), mask)
    logp = jnp.where(jnp.isneginf(res.logprobs), 0.0, res.logprobs)
    return logp, res.entropy, jnp.where(outside, 0.0, mask), fraction


def policy_loss(config: Any) -> Reference:
    """The policy loss and its metrics, each a scalar; the user context holds
    ``old_logprobs``, ``advantages``, ``mask`` (or None: the loss mask),
    ``ref_logprobs``, ``temperature`` and ``sampling_support`` (read by attribute)::

        M = where(labels == ignore_index, 0, mask)
        logp, entropy = on the support, if any (jax_ref.sampling); logp_v = the whole vocab's
        M = where(logp == -inf or old == -inf or rollout == -inf, 0, M)      # with a support
        pg, indicators = policy_family.pg_terms(config, logp, old, A, M)  # per loss_mode
        L = pg + kl_coef * kl_penalty(logp, ref) - entropy_coef * entropy
        loss = aggregate(L, M, aggregation)

    Metrics (no gradient): ``pg_loss`` and ``kl`` aggregated like the loss;
    ``entropy``, ``approx_kl`` (k3 of ``old`` against ``logp``) and the mode's indicators
    (``clip_fraction``, ``ppo_kl``, ...) as token means over ``M``.
    """
    clamp = config.log_ratio_clamp
    mode = getattr(config.aggregation, "value", config.aggregation)
    factor = getattr(config, "loss_scale_factor", None)
    estimator = getattr(config.kl_estimator, "value", config.kl_estimator)

    def policy_loss_reference(hidden: jax.Array, weight: jax.Array, inputs: ReferenceInputs) -> Any:
        batch = inputs.context
        t = context_temperature(inputs, None)
        logp, ent = token_logprobs_of(hidden, weight, inputs, temperature=t, with_entropy=True)
        assert ent is not None  # with_entropy=True
        mask = batch.mask if batch.mask is not None else inputs.loss_mask
        mask = jnp.ones(logp.shape) if mask is None else jnp.asarray(mask, jnp.float64)
        mask = jnp.where(inputs.labels == inputs.ignore_index, 0.0, mask)
        kl_logp, outside = logp, None
        if (support := sampling_support_of(batch)) is not None:
            logp, ent, mask, outside = _on_support(hidden, weight, inputs, support, t, mask)
            kl_logp = logp if getattr(config, "reference_on_support", False) else kl_logp
        old = lax.stop_gradient(batch.old_logprobs)
        adv = lax.stop_gradient(batch.advantages)
        mask, old, weights = _rollout_corrected(config, batch, logp, mask, old)
        pg, indicators = pg_terms(config, logp, old, adv, mask)
        if weights is not None:
            pg = pg * weights
        total = pg
        kl = None
        if batch.ref_logprobs is not None:
            kl = kl_penalty(
                kl_logp,
                lax.stop_gradient(batch.ref_logprobs),
                estimator=estimator,
                clamp=clamp,
                value_clamp=getattr(config, "kl_value_clamp", None),
                straight_through=getattr(config, "kl_straight_through", False),
            )
            if config.kl_coef != 0.0:
                total = total + config.kl_coef * kl
        if config.entropy_coef != 0.0:
            total = total - config.entropy_coef * ent
        out = {
            "loss": aggregate(total, mask, mode=mode, loss_scale_factor=factor),
            "pg_loss": aggregate(lax.stop_gradient(pg), mask, mode=mode, loss_scale_factor=factor),
            "entropy": _token_mean(ent, mask),
            "approx_kl": _token_mean(kl_penalty(logp, old, estimator="k3", clamp=clamp), mask),
        }
        out |= {name: _token_mean(value, mask) for name, value in indicators.items()}
        if kl is not None:
            out["kl"] = aggregate(lax.stop_gradient(kl), mask, mode=mode, loss_scale_factor=factor)
        if outside is not None:
            out["support/outside_fraction"] = outside
        return out

    return policy_loss_reference

"""float64 JAX references of the preference losses (``hookspec.conventions``): DPO, IPO and
SimPO over pairs of sequences (chosen, rejected).

Two levels, as in :mod:`jax_ref.references` and :mod:`jax_ref.processors`:

- :func:`pair_losses`: the per-pair formulas, on sequence logprobs;
- :func:`preference_loss`: the reference of ``torch_impl.processors.preference_loss``,
  ``(hidden [s, b, h], weight [V_local, h], inputs) -> {"loss", ...}``, which runs on one
  shard or under :func:`jax_ref.sharded.shard_reference`. Each row of the batch is a
  sequence (``ReferenceInputs`` carries no packed sequences).

The configuration is read by attribute (``method``, ``beta``, ``label_smoothing``,
``gamma``, ``length_normalized``), so a ``torch_impl.processors.PreferenceConfig`` serves
as is, and the user context likewise (``ref_chosen``, ``ref_rejected``, ``mask``,
``chosen``, ``rejected``, ``pair_mask``, ``global_pairs``); nothing here imports torch.
Run them inside :func:`jax_ref.float64`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from hookspec import ContractError

from ._x64 import as_float64
from .inputs import ReferenceInputs
from .processors import Reference, token_logprobs_of

__all__ = ["METHODS", "pair_losses", "preference_loss"]

METHODS = ("dpo", "ipo", "simpo")
"""The methods :func:`pair_losses` knows (``PreferenceMethod``'s values)."""


def pair_losses(
    lp_c: Any,
    lp_r: Any,
    ref_c: Any = None,
    ref_r: Any = None,
    /,
    *,
    method: str,
    beta: float,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
) -> dict[str, jax.Array]:
    """Per pair ``[P]``: ``loss``, ``reward_chosen``, ``reward_rejected``, from the policy's
    sequence logprobs ``lp_c``, ``lp_r`` and the reference's ``ref_c``, ``ref_r`` (``None``:
    0, SimPO), all sums or all per-token means::

        m = (lp_c - ref_c) - (lp_r - ref_r)
        dpo:    L = -(1 - eps) * log_sigmoid(beta * m) - eps * log_sigmoid(-beta * m)
        ipo:    L = (m - 1 / (2 * beta)) ** 2
        simpo:  L = -(1 - eps) * log_sigmoid(beta * m - gamma) - eps * log_sigmoid(gamma - beta * m)
        reward_chosen, reward_rejected = beta * (lp_c - ref_c), beta * (lp_r - ref_r)
    """
    if method not in METHODS:
        raise ContractError("method", expected=f"one of {list(METHODS)}", actual=repr(method))
    lp_c = as_float64(lp_c, where="lp_c")
    lp_r = as_float64(lp_r, where="lp_r")
    m_c = lp_c if ref_c is None else lp_c - as_float64(ref_c, where="ref_c")
    m_r = lp_r if ref_r is None else lp_r - as_float64(ref_r, where="ref_r")
    margin = m_c - m_r
    if method == "ipo":
        loss = (margin - 1.0 / (2.0 * beta)) ** 2
    else:
        u = beta * margin - (gamma if method == "simpo" else 0.0)
        loss = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(u)
        loss = loss - label_smoothing * jax.nn.log_sigmoid(-u)
    return {"loss": loss, "reward_chosen": beta * m_c, "reward_rejected": beta * m_r}


def _per_token(values: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.where(tokens == 0, 0.0, values / jnp.where(tokens == 0, 1.0, tokens))


def _sides(batch: Any, rows: int) -> tuple[jax.Array, jax.Array]:
    """``(chosen, rejected)`` row indices: the context's, else rows ``2i`` and ``2i + 1``."""
    if batch.chosen is None:
        return jnp.arange(0, rows - 1, 2), jnp.arange(1, rows, 2)
    return jnp.asarray(batch.chosen), jnp.asarray(batch.rejected)


def preference_loss(config: Any) -> Reference:
    """The preference loss and its metrics over the pairs of the batch's rows, each a
    scalar; the user context holds the pairs and the reference's sums::

        M = where(labels == ignore_index, 0, mask)           # mask: context's, else loss_mask
        S, n = sum(M * logp, -1), sum(M, -1)                 # [b]: each row a sequence
        lp = S / n if length_normalized else S               # per side; ref likewise
        t = pair_losses(lp[chosen], lp[rejected], ref_c, ref_r, ...)
        w = pair_mask / (global_pairs or sum(pair_mask))
        loss = sum(w * t["loss"])

    Metrics (no gradient), weighted by ``w`` alike: ``rewards_chosen``,
    ``rewards_rejected``, ``reward_margin``, ``accuracy`` (``r_c > r_r``),
    ``logps_chosen``, ``logps_rejected``; ``pairs = sum(pair_mask)``.
    """
    method = str(getattr(config.method, "value", config.method))
    normalized = config.length_normalized
    if normalized is None:
        normalized = method != "dpo"
    beta, eps, gamma = float(config.beta), float(config.label_smoothing), float(config.gamma)

    def preference_loss_reference(
        hidden: jax.Array, weight: jax.Array, inputs: ReferenceInputs
    ) -> Any:
        batch = inputs.context
        logp, _ = token_logprobs_of(hidden, weight, inputs)
        mask = batch.mask if batch.mask is not None else inputs.loss_mask
        mask = jnp.ones(logp.shape) if mask is None else as_float64(mask, where="mask")
        mask = jnp.where(inputs.labels == inputs.ignore_index, 0.0, mask)
        total, tokens = jnp.sum(mask * logp, -1), jnp.sum(mask, -1)
        chosen, rejected = _sides(batch, logp.shape[0])
        lp_c, lp_r = total[chosen], total[rejected]
        ref_c, ref_r = batch.ref_chosen, batch.ref_rejected
        if normalized:
            lp_c, lp_r = _per_token(lp_c, tokens[chosen]), _per_token(lp_r, tokens[rejected])
            if ref_c is not None:
                ref_c = _per_token(as_float64(ref_c), tokens[chosen])
                ref_r = _per_token(as_float64(ref_r), tokens[rejected])
        t = pair_losses(
            lp_c, lp_r, ref_c, ref_r, method=method, beta=beta, label_smoothing=eps, gamma=gamma
        )
        pm = batch.pair_mask
        pm = jnp.ones(lp_c.shape) if pm is None else as_float64(pm, where="pair_mask")
        total_pairs = jnp.sum(pm) if batch.global_pairs is None else float(batch.global_pairs)
        w = pm / jnp.where(total_pairs == 0, 1.0, total_pairs)
        r_c, r_r = lax.stop_gradient(t["reward_chosen"]), lax.stop_gradient(t["reward_rejected"])
        return {
            "loss": jnp.sum(w * t["loss"]),
            "rewards_chosen": jnp.sum(w * r_c),
            "rewards_rejected": jnp.sum(w * r_r),
            "reward_margin": jnp.sum(w * (r_c - r_r)),
            "accuracy": jnp.sum(w * (r_c > r_r)),
            "logps_chosen": jnp.sum(w * lax.stop_gradient(lp_c)),
            "logps_rejected": jnp.sum(w * lax.stop_gradient(lp_r)),
            "pairs": jnp.sum(pm),
        }

    return preference_loss_reference

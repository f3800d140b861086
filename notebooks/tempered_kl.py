"""The processor of notebook 02: a tempered cross entropy with a KL term against
reference logprobs and an entropy bonus, read from a user context.

It lives in a module (not in a notebook cell) so that ``hookcheck --tp 2`` can
import it by ``module:attr`` on its spawned gloo ranks. The notebook prints it.

User context (``output_processor_context``)::

    TemperedKLBatch(temperature [b, s] > 0, ref_logprobs [b, s])

Per token, with ``p = softmax(z / T)``, ``z = h @ W.T`` and
``M = loss_mask * (labels != ignore_index)``::

    logp = log p[y]                    H = -sum_v p log p
    r    = ref_logprobs - logp         kl = exp(r) - r - 1        (k3, >= 0)
    loss = sum(M * (-logp + KL_COEF * kl - ENTROPY_COEF * H)) / sum(M)

Outputs: ``loss`` (scalar), ``entropy`` ``[b, s]`` (masked, with gradient),
``kl`` (scalar token mean, no gradient). Three deliberately wrong variants plant
the bugs the notebook shows caught.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import jax_ref.processors
import jax_ref.references
from hookspec import OutputContext, processor

__all__ = [
    "ENTROPY_COEF",
    "KL_COEF",
    "TemperedKLBatch",
    "make_context",
    "missing_all_reduce",
    "sum_for_mean",
    "tempered_kl",
    "tempered_kl_reference",
    "wrong_entropy_sign",
]

KL_COEF = 0.1
ENTROPY_COEF = 0.01


@dataclasses.dataclass(frozen=True)
class TemperedKLBatch:
    """The user context: a sampling temperature and a reference logprob per token."""

    temperature: Any  # [b, s] > 0
    ref_logprobs: Any  # [b, s]


def _logprobs_entropy(
    ctx: OutputContext, *, gather: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, s]`` logprobs and entropy of ``softmax(z / T)`` by the contract's
    vocab-parallel recipe (every sum over the vocabulary all-reduced)."""
    coll, vocab = ctx.collectives, ctx.vocab
    h: Any = ctx.hidden_states
    if gather:  # identity forward; all-reduces d/d hidden over the vocab shards in backward
        h = coll.gather_hidden_states(h)
    t = ctx.context.temperature.t().float()[..., None]  # [s, b, 1]
    z = (h.float() @ ctx.vocab_weight.float().t()) / t  # [s, b, V/tp]
    m = coll.all_reduce_max(z.detach().amax(-1))  # [s, b]
    e = torch.exp(z - m[..., None])
    se = coll.all_reduce_sum(e.sum(-1))
    y = ctx.labels.t().contiguous()  # [s, b] global ids
    local = y - vocab.start
    here = (local >= 0) & (local < vocab.local_size)
    z_y = torch.gather(z, -1, local.clamp(0, vocab.local_size - 1)[..., None])[..., 0]
    z_y = coll.all_reduce_sum(torch.where(here, z_y, torch.zeros_like(z_y)))
    logp = torch.where(y == ctx.ignore_index, torch.zeros_like(z_y), z_y - m - torch.log(se))
    entropy = torch.log(se) - coll.all_reduce_sum((e * (z - m[..., None])).sum(-1)) / se
    return logp.t(), entropy.t()


def _outputs(
    ctx: OutputContext, logp: torch.Tensor, entropy: torch.Tensor, *, mean: bool = True
) -> Any:
    mask = ctx.loss_mask.float() * (ctx.labels != ctx.ignore_index)
    r = torch.where(mask > 0, ctx.context.ref_logprobs.float() - logp, torch.zeros_like(logp))
    kl = torch.exp(r) - r - 1.0
    per_token = mask * (-logp + KL_COEF * kl - ENTROPY_COEF * entropy)
    tokens = mask.sum().clamp(min=1.0)
    return {
        "loss": per_token.sum() / tokens if mean else per_token.sum(),
        "entropy": entropy * mask,
        "kl": ((kl * mask).sum() / tokens).detach(),
    }


@processor
def tempered_kl(ctx: OutputContext) -> Any:
    """Right on any tensor-parallel size."""
    return _outputs(ctx, *_logprobs_entropy(ctx))


@processor
def sum_for_mean(ctx: OutputContext) -> Any:
    """Planted bug: the masked sum where the token mean is meant."""
    return _outputs(ctx, *_logprobs_entropy(ctx), mean=False)


@processor
def wrong_entropy_sign(ctx: OutputContext) -> Any:
    """Planted bug: entropy as ``sum p log p`` (negative), so the bonus becomes a penalty."""
    logp, entropy = _logprobs_entropy(ctx)
    return _outputs(ctx, logp, -entropy)


@processor
def missing_all_reduce(ctx: OutputContext) -> Any:
    """Planted bug: no ``gather_hidden_states``, so the backward all-reduce of
    ``d/d hidden`` over the vocab shards is missing (right at tp=1)."""
    return _outputs(ctx, *_logprobs_entropy(ctx, gather=False))


def make_context(ctx: OutputContext) -> TemperedKLBatch:
    """A user context for a captured ``ctx``: temperatures in ``[0.5, 1.5)`` and
    reference logprobs 0.3 (normal) away from the current ones. Seeded, so every
    tensor-parallel rank builds the same one (call it on every rank)."""
    g = torch.Generator().manual_seed(7)
    b, s = ctx.batch_size, ctx.seq_len
    temperature = 0.5 + torch.rand(b, s, generator=g)
    with torch.no_grad():
        plain = ctx.replace(
            hidden_states=ctx.hidden_states.detach(),
            context=TemperedKLBatch(temperature, torch.zeros(b, s)),
        )
        logp, _ = _logprobs_entropy(plain)
    ref = logp + 0.3 * torch.randn(b, s, generator=g)
    return TemperedKLBatch(temperature=temperature, ref_logprobs=ref)


def tempered_kl_reference(hidden: Any, weight: Any, inputs: Any) -> Any:
    """The float64 JAX reference, from the definition (``jax_ref`` building blocks)."""
    import jax
    import jax.numpy as jnp

    ctx = inputs.context
    logp, entropy = jax_ref.processors.token_logprobs_of(
        hidden, weight, inputs, temperature=ctx.temperature, with_entropy=True
    )
    mask = inputs.loss_mask * (inputs.labels != inputs.ignore_index)
    kl = jax_ref.references.kl_penalty(
        logp, jnp.where(mask > 0, ctx.ref_logprobs, logp), estimator="k3"
    )
    per_token = -logp + KL_COEF * kl - ENTROPY_COEF * entropy
    return {
        "loss": jax_ref.references.aggregate(per_token, mask, mode="token-mean"),
        "entropy": entropy * mask,
        "kl": jax.lax.stop_gradient(jax_ref.references.aggregate(kl, mask, mode="token-mean")),
    }

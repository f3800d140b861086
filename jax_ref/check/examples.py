"""Example torch processors, right and deliberately wrong, with their references.

They show what ``hookcheck`` catches; each is a ``module:attr`` target::

    hookcheck --processor jax_ref.check.examples:wrong_sign_entropy \\
              --reference jax_ref.check.examples:logprobs_entropy_reference      # exits 1

- :data:`vocab_parallel_logprobs`: logprobs and entropy by the contract's
  vocab-parallel recipe (right on any tp).
- :func:`full_vocab_logprobs`: an upstream-style processor (the native hook's
  keywords) through the output layer and a full softmax (right at tp=1).
- :data:`token_mean_loss`: masked token-mean cross entropy, a scalar (right; under
  context parallel each rank's share: its tokens' sum over the count of the CP group).
- :data:`rank_mean_loss`: the token mean over this rank's tokens alone (right at
  cp=1; under context parallel the shares do not sum to the mean).
- :data:`wrong_sign_entropy`: entropy returned as ``sum p log p``, negative
  (NeMo RL's chunked entropy has that sign; the contract's does not).
- :data:`wrong_reduction_loss`: the masked sum where the token mean is meant.
- :data:`unshifted_softmax`: ``exp(z) / sum(exp(z))`` with no max shift:
  right on small logits, NaN where every logit is strongly negative (the
  exponentials underflow to 0/0; veRL #7439 had this with a running max
  started at 0).
- :data:`missing_tp_reduction`: multiplies the raw hidden states by its vocab
  shard without ``collectives.gather_hidden_states``: values right, but under
  tensor parallelism each rank's hidden-state gradient holds only its shard's
  part (the backward all-reduce is missing).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from hookspec import Array, OutputContext, processor

from ..inputs import ReferenceInputs
from ..processors import selected_logprobs
from ..references import aggregate

__all__ = [
    "current_logprobs",
    "full_vocab_logprobs",
    "logprobs_entropy_reference",
    "missing_tp_reduction",
    "rank_mean_loss",
    "token_mean_loss",
    "token_mean_loss_reference",
    "unshifted_softmax",
    "vocab_parallel_logprobs",
    "wrong_reduction_loss",
    "wrong_sign_entropy",
]


def _torch(x: Array | None) -> torch.Tensor:
    """A context field these processors read: the torch tensor a context built by
    ``torch_impl`` holds there."""
    return cast(torch.Tensor, x)


def _recipe(
    ctx: OutputContext, h: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, s]`` logprobs and entropy from gathered hidden states ``h [s, b, h]``, in ``dtype``."""
    coll, vocab = ctx.collectives, ctx.vocab
    assert vocab is not None and ctx.labels is not None
    z = torch.matmul(h.to(dtype), _torch(ctx.vocab_weight).to(dtype).t())  # [s, b, V/tp]
    m = coll.all_reduce_max(z.detach().amax(-1))
    e = torch.exp(z - m[..., None])
    se = coll.all_reduce_sum(e.sum(-1))
    lse = m + torch.log(se)
    # contiguous: Megatron Core 0.16 all-reduces a contiguous *copy* of a strided input
    y = _torch(ctx.labels).t().contiguous()  # [s, b]
    local = y - vocab.start
    here = (local >= 0) & (local < vocab.local_size)
    z_y = torch.gather(z, -1, local.clamp(0, vocab.local_size - 1)[..., None])[..., 0]
    z_y = coll.all_reduce_sum(torch.where(here, z_y, torch.zeros_like(z_y)))
    logprobs = torch.where(y == ctx.ignore_index, torch.zeros_like(z_y), z_y - lse)
    entropy = (
        torch.log(se) - coll.all_reduce_sum((e * (z - m[..., None])).sum(-1)) / se
    )  # shifted: no cancellation
    return logprobs.t(), entropy.t()


def current_logprobs(ctx: OutputContext) -> torch.Tensor:
    """The context's selected-token logprobs ``[b, s]`` in float64, no gradient
    (collective over the vocab shards: call it on every rank)."""
    with torch.no_grad():
        h = ctx.collectives.gather_hidden_states(_torch(ctx.hidden_states).detach())
        return _recipe(ctx, h, torch.float64)[0]


@processor
def vocab_parallel_logprobs(ctx: OutputContext) -> dict[str, torch.Tensor]:
    """``{"logprobs": [b, s], "entropy": [b, s]}`` by the vocab-parallel recipe."""
    lp, ent = _recipe(ctx, ctx.collectives.gather_hidden_states(_torch(ctx.hidden_states)))
    return {"logprobs": lp, "entropy": ent}


def full_vocab_logprobs(
    *, hidden_states: Any, output_layer: Any, output_weight: Any, labels: Any, **_: Any
) -> Any:
    """Upstream-style: ``logits, _ = output_layer(hidden, weight=output_weight)``,
    then ``log_softmax`` over the (whole, tp=1) vocabulary."""
    logits, _ = output_layer(hidden_states, weight=output_weight)
    lsm = torch.log_softmax(logits.float(), dim=-1)  # [s, b, V]
    y = labels.t()
    picked = torch.gather(lsm, -1, y.clamp(min=0)[..., None])[..., 0]
    logprobs = torch.where(y == -100, torch.zeros_like(picked), picked)
    entropy = -(lsm.exp() * lsm).sum(-1)
    return {"logprobs": logprobs.t(), "entropy": entropy.t()}


@processor
def wrong_sign_entropy(ctx: OutputContext) -> dict[str, torch.Tensor]:
    """Wrong on purpose: entropy with the opposite sign."""
    out = vocab_parallel_logprobs(ctx)
    return {"logprobs": out["logprobs"], "entropy": -out["entropy"]}


@processor
def unshifted_softmax(ctx: OutputContext) -> dict[str, torch.Tensor]:
    """Wrong on purpose: a softmax without the max shift (tp=1)."""
    z = torch.matmul(_torch(ctx.hidden_states).float(), _torch(ctx.vocab_weight).float().t())
    p = torch.exp(z) / torch.exp(z).sum(-1, keepdim=True)
    y = _torch(ctx.labels).t()
    picked = torch.log(torch.gather(p, -1, y.clamp(min=0)[..., None])[..., 0])
    logprobs = torch.where(y == ctx.ignore_index, torch.zeros_like(picked), picked)
    entropy = -(p * torch.log(p)).sum(-1)
    return {"logprobs": logprobs.t(), "entropy": entropy.t()}


@processor
def missing_tp_reduction(ctx: OutputContext) -> dict[str, torch.Tensor]:
    """Wrong on purpose under tp > 1: no ``gather_hidden_states`` (no backward all-reduce)."""
    lp, ent = _recipe(ctx, _torch(ctx.hidden_states))
    return {"logprobs": lp, "entropy": ent}


def _masked_ce(ctx: OutputContext) -> tuple[torch.Tensor, torch.Tensor]:
    lp, _ = _recipe(ctx, ctx.collectives.gather_hidden_states(_torch(ctx.hidden_states)))
    mask = _torch(ctx.loss_mask).float() * (_torch(ctx.labels) != ctx.ignore_index)
    return -lp * mask, mask


@processor
def token_mean_loss(ctx: OutputContext) -> torch.Tensor:
    """``sum(CE * M) / sum(M)`` over the loss mask and non-ignored labels (a scalar);
    under context parallel ``sum(M)`` is over the CP group, so each rank's value is its
    share of the micro-batch's mean."""
    loss, mask = _masked_ce(ctx)
    count = mask.sum()
    if ctx.parallel.cp_size > 1:
        count = ctx.collectives.all_reduce_sum_context_parallel(count)
    return loss.sum() / count.clamp(min=1.0)


@processor
def rank_mean_loss(ctx: OutputContext) -> torch.Tensor:
    """Wrong on purpose under cp > 1: the token mean over this rank's tokens only."""
    loss, mask = _masked_ce(ctx)
    return loss.sum() / mask.sum().clamp(min=1.0)


@processor
def wrong_reduction_loss(ctx: OutputContext) -> torch.Tensor:
    """Wrong on purpose: the masked sum, not the token mean."""
    loss, _ = _masked_ce(ctx)
    return loss.sum()


logprobs_entropy_reference = selected_logprobs(entropy=True)
"""The reference of :data:`vocab_parallel_logprobs` and its wrong variants."""


def token_mean_loss_reference(hidden: Any, weight: Any, inputs: ReferenceInputs) -> Any:
    """``aggregate(-logprobs, loss_mask * (labels != ignore), "token-mean")``."""
    lp = logprobs_entropy_reference(hidden, weight, inputs)["logprobs"]
    assert inputs.loss_mask is not None and inputs.labels is not None  # token_mean_loss needs both
    mask = inputs.loss_mask * (inputs.labels != inputs.ignore_index)
    return aggregate(-lp, mask, mode="token-mean")

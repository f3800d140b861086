"""A processor: per-token tempered logprobs and a token-mean loss, without the logits."""

from collections.abc import Mapping

import torch

import hookspec
from torch_impl.processors import context_options, context_rows, from_rows, linear_logprobs


@hookspec.processor
def tempered_logprobs(ctx: hookspec.OutputContext) -> dict[str, torch.Tensor]:
    _require_temperature(ctx)  # output_processor_context={"temperature": T [b, s]}
    if ctx.labels is None:  # None where the caller passed no labels
        raise hookspec.ContractError("labels", expected="[b, s] token ids (labels=)", actual="None")
    rows = context_rows(ctx)  # hidden [n, h] (row i*b + j: token (j, i)), weight, labels [n]
    options = context_options(ctx)  # vocab shard, collectives, MuP scale, T as rows [n]
    result = linear_logprobs(*rows, options=options)  # tile by tile: no [n, V] logits
    logprobs = from_rows(result.logprobs, ctx)  # [b, s]; 0 at an ignored label
    mask = (ctx.labels != ctx.ignore_index).float()
    if ctx.loss_mask is not None:  # None where the caller passed no loss_mask: every token counts
        mask = mask * ctx.loss_mask
    count = mask.sum()
    if ctx.parallel.cp_size > 1:  # context parallel: this rank holds part of every sequence
        count = ctx.collectives.all_reduce_sum_context_parallel(count)  # the micro-batch's count
    loss = -(logprobs * mask).sum() / count.clamp(min=1)  # token mean (a rank's share); 0 if none
    return {"logprobs": logprobs, "loss": loss}


def _require_temperature(ctx: hookspec.OutputContext) -> None:
    """A user context holding a temperature, or a ContractError naming what came instead."""
    user = ctx.context  # the caller's output_processor_context, None where there was none
    if not isinstance(user, Mapping) or "temperature" not in user:
        got = (
            f"a mapping with keys {sorted(user)}"
            if isinstance(user, Mapping)
            else type(user).__name__
        )
        raise hookspec.ContractError(
            "context", expected="{'temperature': [b, s]} (output_processor_context=)", actual=got
        )


def make_context(ctx: hookspec.OutputContext) -> dict[str, torch.Tensor]:
    """The user context for `hookcheck --context`: a temperature in [0.5, 1.5) per token."""
    g = torch.Generator().manual_seed(0)
    return {"temperature": torch.rand(ctx.batch_size, ctx.seq_len, generator=g) + 0.5}

"""The template processor of ``docs/examples/my_processor.py`` with one defect, a
``module:attr`` target that ``hookcheck``'s spawned ranks import
(``tests/project/test_docs.py``)."""

from __future__ import annotations

import torch

import hookspec
from torch_impl.processors import context_options, context_rows, from_rows, linear_logprobs


@hookspec.processor
def without_cp_count(ctx: hookspec.OutputContext) -> dict[str, torch.Tensor]:
    """The template without ``all_reduce_sum_context_parallel`` of its count: right at
    cp=1; under context parallel each rank's loss is the mean of its own tokens, and the
    ranks' losses no longer sum to the micro-batch's token mean."""
    labels = ctx.labels
    assert isinstance(labels, torch.Tensor)
    rows = context_rows(ctx)
    logprobs = from_rows(linear_logprobs(*rows, options=context_options(ctx)).logprobs, ctx)
    mask = (labels != ctx.ignore_index).float()
    if ctx.loss_mask is not None:
        mask = mask * ctx.loss_mask
    return {"logprobs": logprobs, "loss": -(logprobs * mask).sum() / mask.sum().clamp(min=1)}

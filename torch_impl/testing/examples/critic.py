"""A PPO critic through the output hook: per-token values from a value head of the
user's own, and PPO's clipped value loss, without the model's output layer.

The critic is a Megatron GPT (or HybridModel) enabled with
``torch_impl.enable_output_processor``; the value head is any module that maps the
hidden size to one value, held by the user beside the model (a ``torch.nn.Linear(h,
1)``, replicated on every tensor-parallel rank). The processor takes the decoder's
hidden states the hook hands over, gathers them over the tensor-parallel group
(``ctx.collectives.gather_hidden_states``: the whole sequence under sequence
parallelism), and applies the head::

    h = gather_hidden_states(ctx.hidden_states)                 # [s, b, h]
    v = head(h)[..., 0].T                                       # [b, s], fp32
    # PPO's value clip (v where inactive)
    v_clip = old + clamp(v - old, -clip_range, clip_range)
    loss = 0.5 * sum(M * max((v - R)**2, (v_clip - R)**2)) / N  # N = sum(M), or global_tokens
    clip_fraction = sum(M * ((v_clip - R)**2 > (v - R)**2)) / sum(M)

``R`` the returns, ``old`` the values at rollout, ``M`` the mask (``ValueBatch.mask``,
else the model's ``loss_mask``, else every token). An empty mask gives loss 0.

Tensor parallelism: every rank computes the same values from the same gathered
hidden states, so the hidden-state gradient of each rank is the whole gradient.
``gather_hidden_states`` sums the ranks' gradients in backward (right for a
vocab-sharded head, whose ranks each hold a part); for a replicated head the
gradient is scaled by ``1 / tp`` before that sum, so the decoder receives it once.
The head's own gradient is the whole one on every rank (a replicated parameter,
like a layer norm's without sequence parallelism). Tested at tp=1 and tp=2 over
gloo against a float64 computation (``tests/hook/test_critic.py``).

Usage::

    head = torch.nn.Linear(hidden_size, 1)
    critic = torch_impl.enable_output_processor(critic)
    out = critic(input_ids, position_ids, attention_mask,
                 output_processor=value_head_processor(head, clip_range=0.2),
                 output_processor_context=ValueBatch(returns, old_values, mask))
    out["loss"].backward()            # trains the head and the critic's decoder
    values = out["values"]            # [b, s]; without a context, only the values
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

import hookspec
from hookspec import ContractError, OutputContext
from torch_impl.mtp import scale_gradient

__all__ = ["ValueBatch", "clipped_value_loss", "value_head_processor"]


@dataclasses.dataclass(frozen=True)
class ValueBatch:
    """The user context of :func:`value_head_processor`: per-token ``returns`` and
    ``old_values`` ``[b, s]``, an optional ``mask`` ``[b, s]``; ``global_tokens``:
    the token count to divide by where a batch is split over ranks (context
    parallel, packed shares), so that the ranks' losses sum to the loss."""

    returns: torch.Tensor
    old_values: torch.Tensor
    mask: torch.Tensor | None = None
    global_tokens: float | None = None


def clipped_value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    /,
    *,
    clip_range: float | None,
    count: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss and the clipped fraction (see the module docstring)::

    unclipped = (values - returns) ** 2                                     # [b, s]
    clipped = (old + clamp(values - old, -clip_range, clip_range) - returns) ** 2
    loss = 0.5 * sum(mask * max(unclipped, clipped)) / count
    """
    unclipped = (values - returns) ** 2
    if clip_range is None:
        per_token, clipped_tokens = unclipped, torch.zeros_like(unclipped)
    else:
        delta = values - old_values
        # where the clamp is inactive, v_clip is the value itself (not old + (v - old),
        # which rounds), so the clipped fraction counts only tokens the clip changes
        v_clip = torch.where(
            delta.abs() > clip_range, old_values + delta.clamp(-clip_range, clip_range), values
        )
        clipped = (v_clip - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_tokens = (clipped > unclipped).to(values.dtype)
    total = mask.sum()
    loss = (
        0.5
        * (mask * per_token).sum()
        / (count if isinstance(count, torch.Tensor) else float(count))
    )
    fraction = torch.where(total > 0, (mask * clipped_tokens).sum() / total.clamp(min=1e-30), 0.0)
    return loss, fraction.detach()


def _check_tensor(field: str, value: Any, shape: tuple[int, int]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ContractError(field, expected="a torch.Tensor [b, s]", actual=type(value).__name__)
    if tuple(value.shape) != shape:
        raise ContractError(
            field,
            expected=f"shape [b={shape[0]}, s={shape[1]}]",
            actual=f"shape {list(value.shape)}",
        )
    return value


def value_head_processor(head: Any, /, *, clip_range: float | None = 0.2) -> hookspec.Processor:
    """The critic processor of the module docstring: ``{"values": [b, s]}``, and with a
    :class:`ValueBatch` as the user context also ``"loss"`` and ``"clip_fraction"``
    (scalars). ``head``: a callable ``[..., h] -> [..., 1]`` (a module the user
    owns and optimises), or one returning Megatron's ``(output, bias)`` pair (a
    ``ColumnParallelLinear(h, 1)`` at tp=1; bias added); ``clip_range``: a finite
    number > 0, or ``None`` for the unclipped loss."""
    if not callable(head):
        raise ContractError(
            "head", expected="a callable [..., h] -> [..., 1]", actual=type(head).__name__
        )
    if clip_range is not None and (
        isinstance(clip_range, bool)
        or not isinstance(clip_range, (int, float))
        or not (0 < float(clip_range) < math.inf)
    ):
        raise ContractError(
            "clip_range", expected="a finite number > 0, or None", actual=repr(clip_range)
        )
    clip = None if clip_range is None else float(clip_range)

    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        values = _values(head, ctx)
        batch = ctx.context
        if batch is None:
            return {"values": values}
        if not isinstance(batch, ValueBatch):
            raise ContractError(
                "context", expected="a ValueBatch or None", actual=type(batch).__name__
            )
        return {"values": values, **_value_loss(values, batch, ctx, clip)}

    return hookspec.processor(fn, name="value_head")


def _values(head: Any, ctx: OutputContext) -> torch.Tensor:
    """The head's values ``[b, s]`` (fp32) of the gathered hidden states ``[s, b, h]``."""
    hidden: Any = ctx.collectives.gather_hidden_states(ctx.hidden_states)  # [s, b, h]
    tp = ctx.parallel.tp_size
    if tp > 1:  # every rank's gradient is whole: counted once in the gather's sum
        hidden = scale_gradient(hidden, 1.0 / tp)
    out = head(hidden)
    if isinstance(out, tuple):  # Megatron's parallel linear layers return (output, bias)
        out, bias = out
        out = out if bias is None else out + bias
    if out.shape[-1] != 1 or tuple(out.shape[:-1]) != tuple(hidden.shape[:-1]):
        raise ContractError(
            "head",
            expected=f"output [s, b, 1] for input {list(hidden.shape)}",
            actual=list(out.shape),
        )
    return out[..., 0].transpose(0, 1).float()  # [b, s]


def _value_loss(
    values: torch.Tensor, batch: ValueBatch, ctx: OutputContext, clip: float | None
) -> dict[str, torch.Tensor]:
    """``{"loss", "clip_fraction"}`` of ``values`` against the batch's checked returns, old
    values and mask (the context's, else the model's ``loss_mask``, else ones), over the
    counted tokens or ``global_tokens``."""
    shape = (ctx.batch_size, ctx.seq_len)
    returns = _check_tensor("context.returns", batch.returns, shape).float()
    old = _check_tensor("context.old_values", batch.old_values, shape).float()
    mask = batch.mask if batch.mask is not None else ctx.loss_mask
    mask = torch.ones(shape) if mask is None else _check_tensor("context.mask", mask, shape).float()
    count: float | torch.Tensor = mask.sum().clamp(min=1.0)
    if batch.global_tokens is not None:
        tokens = batch.global_tokens
        if (
            isinstance(tokens, bool)
            or not isinstance(tokens, (int, float))
            or not (0 < float(tokens) < math.inf)
        ):
            raise ContractError(
                "context.global_tokens", expected="a finite number > 0", actual=repr(tokens)
            )
        count = float(tokens)
    loss, fraction = clipped_value_loss(values, returns, old, mask, clip_range=clip, count=count)
    return {"loss": loss, "clip_fraction": fraction}

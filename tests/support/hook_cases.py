"""Processors and references shared by the hook tests (module level: picklable)."""

from __future__ import annotations

from typing import Any

import torch

import hookspec
from hookspec import OutputContext


def stock_loss_upstream(
    *,
    hidden_states: torch.Tensor,
    output_layer: Any,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor,
    runtime_gather_output: bool | None,
    compute_language_model_loss: Any,
    scale_logits: Any,
    **_: Any,
) -> torch.Tensor:
    """Upstream-style: the stock loss through the output layer and Megatron's loss."""
    logits, _ = output_layer(
        hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output
    )
    return compute_language_model_loss(labels, scale_logits(logits))


@hookspec.processor
def stock_loss(ctx: OutputContext) -> Any:
    """Hookspec: the same through the typed context."""
    logits, _ = ctx.output_layer(
        ctx.hidden_states, weight=ctx.output_weight, runtime_gather_output=ctx.runtime_gather_output
    )
    return ctx.compute_language_model_loss(ctx.labels, ctx.scale_logits(logits))


def fused_output_processor(
    *, hidden_states, output_layer, output_weight, labels, context, config, **_
):  # type: ignore[no-untyped-def]
    """Written the way veRL writes its processor for the native hook (tp=1):
    per-token logprobs [b, s] from hidden states and the resolved weight."""
    weight = output_weight if output_weight is not None else output_layer.weight
    logits = torch.einsum("sbh,vh->bsv", hidden_states, weight) / context["temperature"]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def vocab_parallel_logprobs_fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
    """A plain vocab-parallel selected-token logprob written with the contract's
    collectives (materialises the local logits shard; independent of torch_impl's
    fused processors). Returns logprobs [b, s] and the full hidden states it used."""
    hidden = ctx.collectives.gather_hidden_states(ctx.hidden_states)  # [s, b, h]
    assert ctx.vocab_weight is not None and ctx.vocab is not None and ctx.labels is not None
    logits = torch.einsum("sbh,vh->bsv", hidden, ctx.vocab_weight).float()  # [b, s, V/tp]
    m = ctx.collectives.all_reduce_max(logits.max(dim=-1).values)
    sumexp = ctx.collectives.all_reduce_sum(torch.exp(logits - m.unsqueeze(-1)).sum(-1))
    lse = m + torch.log(sumexp)
    labels = ctx.labels
    local = (labels >= ctx.vocab.start) & (labels < ctx.vocab.end)
    idx = torch.where(local, labels - ctx.vocab.start, torch.zeros_like(labels))
    picked = logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * local
    target = ctx.collectives.all_reduce_sum(picked)
    return {"logprobs": target - lse}


vocab_parallel_logprobs = hookspec.processor(
    vocab_parallel_logprobs_fn, name="vocab_parallel_logprobs"
)


def reference_logprobs(logits_bsv: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """float64 log_softmax + gather of full logits [b, s, V]."""
    return torch.log_softmax(logits_bsv.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def model_inputs(batch: dict[str, Any]) -> tuple[Any, ...]:
    return (batch["input_ids"], batch["position_ids"], batch["attention_mask"])


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

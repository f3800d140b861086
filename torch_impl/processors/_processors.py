"""The logprob processors: selected-token logprobs (and entropy) and Megatron's
cross entropy, each computed from the hidden states and the vocab shard
(layout: :mod:`._inputs`). The policy loss is in :mod:`._policy`.
"""

from __future__ import annotations

import torch

from hookspec import ContractError, OutputContext, Processor, processor

from ._checks import check_bool, check_temperature, context_field
from ._inputs import from_tokens, hook_inputs, resolve_temperature, tile_options
from ._logprobs import linear_logprobs

__all__ = [
    "cross_entropy_loss",
    "selected_logprobs",
]


def selected_logprobs(
    *,
    temperature: float | None = None,
    entropy: bool = False,
    vocab_chunk_size: int | None = None,
    token_chunk_size: int | None = None,
    chunk_size: int | None = None,
) -> Processor:
    """A processor returning ``{"logprobs": [b, s], "entropy": [b, s]}`` (fp32)::

        z = hidden_states @ vocab_weight.T / T          # never materialised
        logprobs = log_softmax(z)[labels]               # 0 where labels == ignore_index
        entropy = logsumexp(z) - sum(softmax(z) * z)    # only with entropy=True

    ``T``: ``temperature`` if given, else the user context's ``temperature``
    when it has one that is not ``None`` (a number or ``[b, s]`` per token; the
    key of a mapping such as veRL's, or the attribute of an object such as
    :class:`PolicyBatch`), else 1. Both given is an error.
    """
    if temperature is not None:
        check_temperature(temperature, 1)
    check_bool("entropy", entropy)
    tile = tile_options(
        vocab_chunk_size=vocab_chunk_size, token_chunk_size=token_chunk_size, chunk_size=chunk_size
    )

    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        x = hook_inputs(ctx, "selected_logprobs")
        res = linear_logprobs(
            x.hidden,
            x.weight,
            x.labels,
            temperature=resolve_temperature(temperature, ctx, x.b, x.s),
            with_entropy=entropy,
            vocab_chunk_size=tile.vocab_chunk_size,
            token_chunk_size=tile.token_chunk_size,
            **x.kwargs,
        )
        out = {"logprobs": from_tokens(res.logprobs, x.b, x.s)}
        if res.entropy is not None:
            out["entropy"] = from_tokens(res.entropy, x.b, x.s)
        return out

    return processor(fn, name="selected_logprobs")


def cross_entropy_loss(
    *,
    vocab_chunk_size: int | None = None,
    token_chunk_size: int | None = None,
    chunk_size: int | None = None,
) -> Processor:
    """A processor returning the per-token loss ``[b, s]`` (fp32) of Megatron's
    ``compute_language_model_loss``, unreduced and without the loss mask, like
    Megatron's (apply ``loss_mask`` as you do to Megatron's output)::

        loss = -log_softmax(scale_logits(hidden_states @ vocab_weight.T))[labels]

    One difference: where ``labels == ctx.ignore_index`` the loss is ``0`` with a
    zero gradient (Megatron returns the logsumexp there, which the loss mask
    then removes).

    It takes no temperature (Megatron's loss has none): a user context holding
    a ``temperature`` that is not ``None`` raises rather than being ignored.
    """
    tile = tile_options(
        vocab_chunk_size=vocab_chunk_size, token_chunk_size=token_chunk_size, chunk_size=chunk_size
    )

    def fn(ctx: OutputContext) -> torch.Tensor:
        x = hook_inputs(ctx, "cross_entropy_loss")
        t = context_field(ctx.context, "temperature")
        if t is not None:
            raise ContractError(
                "context.temperature",
                expected="none (cross_entropy_loss is Megatron's loss, which takes no temperature; "
                "use selected_logprobs for tempered logprobs)",
                actual=f"a {type(t).__name__}",
            )
        res = linear_logprobs(
            x.hidden,
            x.weight,
            x.labels,
            vocab_chunk_size=tile.vocab_chunk_size,
            token_chunk_size=tile.token_chunk_size,
            **x.kwargs,
        )
        return from_tokens(-res.logprobs, x.b, x.s)

    return processor(fn, name="cross_entropy_loss")

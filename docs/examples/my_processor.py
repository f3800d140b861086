"""A processor: per-token tempered logprobs and a token-mean loss, vocab-parallel."""

from collections.abc import Mapping

import torch

import hookspec


@hookspec.processor
def tempered_logprobs(ctx: hookspec.OutputContext) -> dict[str, torch.Tensor]:
    temperature = _temperature(ctx)  # [b, s]: output_processor_context={"temperature": T}
    if ctx.labels is None:  # None where the caller passed no labels
        raise hookspec.ContractError("labels", expected="[b, s] token ids (labels=)", actual="None")
    coll, vocab = ctx.collectives, ctx.vocab  # vocab: this rank's ids [start, end) of V
    h = coll.gather_hidden_states(ctx.hidden_states)  # [s, b, h]; whole gradient under TP and SP
    z = torch.einsum("sbh,vh->bsv", h.float(), ctx.vocab_weight.float())  # [b, s, V_local]
    z = ctx.scale_logits(z) / temperature[..., None]  # MuP's output scale (identity without MuP)
    m = coll.all_reduce_max(z.detach().amax(-1))  # [b, s]; all_reduce_max takes no gradient
    lse = m + torch.log(coll.all_reduce_sum(torch.exp(z - m[..., None]).sum(-1)))
    y = ctx.labels  # [b, s] global ids, or ctx.ignore_index
    here = (y >= vocab.start) & (y < vocab.end)  # the label's row is on this rank
    row = torch.where(here, y - vocab.start, 0)
    z_y = coll.all_reduce_sum(z.gather(-1, row[..., None]).squeeze(-1) * here)
    logprobs = torch.where(y == ctx.ignore_index, 0.0, z_y - lse)  # 0 at an ignored label
    mask = (y != ctx.ignore_index).float()
    if ctx.loss_mask is not None:  # None where the caller passed no loss_mask: every token counts
        mask = mask * ctx.loss_mask
    loss = -(logprobs * mask).sum() / mask.sum().clamp(min=1)  # token mean; 0 if nothing counts
    return {"logprobs": logprobs, "loss": loss}


def _temperature(ctx: hookspec.OutputContext) -> torch.Tensor:
    """The user context's temperature, or a ContractError naming what came instead."""
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
    return user["temperature"]


def make_context(ctx: hookspec.OutputContext) -> dict[str, torch.Tensor]:
    """The user context for `hookcheck --context`: a temperature in [0.5, 1.5) per token."""
    g = torch.Generator().manual_seed(0)
    return {"temperature": torch.rand(ctx.batch_size, ctx.seq_len, generator=g) + 0.5}

"""A processor: per-token tempered logprobs and a token-mean loss, vocab-parallel."""

import torch

import hookspec


@hookspec.processor
def tempered_logprobs(ctx: hookspec.OutputContext) -> dict[str, torch.Tensor]:
    coll, vocab = ctx.collectives, ctx.vocab  # vocab: this rank's ids [start, end) of V
    temperature = ctx.context["temperature"]  # [b, s]: output_processor_context={"temperature": T}
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
    mask = ctx.loss_mask * (y != ctx.ignore_index)
    loss = -(logprobs * mask).sum() / mask.sum().clamp(min=1)  # token mean; 0 if nothing counts
    return {"logprobs": logprobs, "loss": loss}


def make_context(ctx: hookspec.OutputContext) -> dict[str, torch.Tensor]:
    """The user context for `hookcheck --context`: a temperature in [0.5, 1.5) per token."""
    g = torch.Generator().manual_seed(0)
    return {"temperature": torch.rand(ctx.batch_size, ctx.seq_len, generator=g) + 0.5}

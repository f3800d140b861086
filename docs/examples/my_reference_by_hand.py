"""`my_processor.tempered_logprobs` in float64 JAX with its reductions written out."""

import jax
import jax.numpy as jnp

from jax_ref import ReferenceInputs


def tempered_logprobs_by_hand(hidden, weight, inputs: ReferenceInputs):
    # hidden [s, b, h], weight [V_local, h]: this shard's rows,
    # ids [vocab_start, vocab_start + V_local)
    coll = inputs.collectives  # every sum or max over the vocabulary goes through these
    h = coll.gather_hidden_states(hidden)  # [s, b, h]; gradient: every shard's part summed
    z = jnp.einsum("sbh,vh->bsv", h, weight) * inputs.logit_scale  # [b, s, V_local], MuP's scale
    z = z / inputs.context["temperature"][..., None]  # the user context, as JAX arrays
    m = coll.all_reduce_max(jax.lax.stop_gradient(z.max(-1)))  # [b, s]: max over all shards
    lse = m + jnp.log(coll.all_reduce_sum(jnp.exp(z - m[..., None]).sum(-1)))  # [b, s]
    y, start = inputs.labels, inputs.vocab_start  # y: [b, s] global ids
    here = (y >= start) & (y < start + weight.shape[0])  # the label's row is on this shard
    z_here = jnp.take_along_axis(z, jnp.where(here, y - start, 0)[..., None], -1)[..., 0]
    z_y = coll.all_reduce_sum(jnp.where(here, z_here, 0.0))  # [b, s]: from the one shard holding it
    ignored = y == inputs.ignore_index
    logprobs = jnp.where(ignored, 0.0, z_y - lse)  # 0 at an ignored label, zero gradient
    mask = jnp.where(ignored, 0.0, 1.0 if inputs.loss_mask is None else inputs.loss_mask)
    loss = -(logprobs * mask).sum() / jnp.maximum(mask.sum(), 1.0)  # token mean
    return {"logprobs": logprobs, "loss": loss}

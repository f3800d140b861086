"""The float64 JAX reference of `my_processor.tempered_logprobs`."""

# the submodule used here (`import jax_ref` alone also works: they load on use)
import jax_ref.references
from jax_ref import ReferenceInputs


def tempered_logprobs_reference(hidden, weight, inputs: ReferenceInputs):
    # hidden [s, b, h] and weight [V_local, h] (this rank's vocabulary rows), float64;
    # under `hookcheck --tp N` the same function runs on every shard: inputs.vocab_start says
    # which rows this one holds, and inputs.collectives (all_reduce_sum, all_reduce_max,
    # gather_hidden_states, all_gather: lax.psum, lax.pmax, ... over the shards) combine them.
    coll = inputs.collectives
    h = coll.gather_hidden_states(hidden).transpose(1, 0, 2)  # [b, s, h]
    res = jax_ref.references.linear_logprobs(
        h,
        weight,
        inputs.labels,  # [b, s] global ids
        temperature=inputs.context["temperature"],  # the user context, torch tensors as JAX arrays
        ignore_index=inputs.ignore_index,  # logprob 0 there, zero gradient
        vocab_start=inputs.vocab_start,  # first global id of `weight`
        logit_scale=inputs.logit_scale,  # MuP's output multiplier, 1 without MuP
        collectives=coll,  # every sum and max over the vocabulary goes through these
    )
    mask = inputs.labels != inputs.ignore_index
    if inputs.loss_mask is not None:  # None where the processor saw none: every token counts
        mask = mask * inputs.loss_mask
    loss = jax_ref.references.aggregate(-res.logprobs, mask, mode="token-mean")
    return {"logprobs": res.logprobs, "loss": loss}

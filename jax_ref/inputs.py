"""What a JAX reference receives besides the hidden states and the weight.

A *reference* is a pure JAX function::

    reference(hidden [s, b, h], weight [V_local, h], inputs: ReferenceInputs)
        -> array [b, s] | scalar | Mapping[str, array]

differentiable in ``hidden`` and ``weight``, returning the same structure as
the torch processor it checks. ``inputs`` mirrors the fields of a
``hookspec.OutputContext`` that carry data, as JAX arrays. Inside
``shard_map`` ``vocab_start`` is a traced scalar and ``collectives`` reduces
over the mesh axis; a reference that follows the contract's vocab-parallel
recipe (:func:`jax_ref.references.linear_logprobs`) runs unchanged on one
shard or on many.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from hookspec import IGNORE_INDEX, Collectives, SingleProcessCollectives

__all__ = ["ReferenceInputs"]


@dataclasses.dataclass(frozen=True)
class ReferenceInputs:
    """The data of an ``OutputContext``, as JAX arrays.

    ``jax_ref.check`` builds it from the torch context a processor received
    (``reference_inputs(ctx)``), inside :func:`jax_ref.float64`; by hand,
    ``ReferenceInputs(labels=..., loss_mask=...)`` with the defaults below is
    one unsharded vocabulary.

    Attributes:
        labels: ``[b, s]`` global token ids (``ignore_index`` where none is
            selected), integer, or None. ``OutputContext.labels``.
        loss_mask: ``[b, s]`` float64, 1 where a token counts, or None.
        padding_mask: ``[b, s]`` bool, True at padding, or None.
        input_ids: ``[b, s]``, or None.
        context: the user context (``output_processor_context``, the
            context's ``context`` field) with every torch tensor or NumPy
            array replaced by a JAX array, floating ones in float64: a
            mapping becomes a dict (``inputs.context["temperature"]``), a
            dataclass stays that dataclass where it can be rebuilt with the
            new values (``inputs.context.temperature``; else a
            ``types.SimpleNamespace`` of its fields), tuples and lists keep
            their type, anything else is passed as it is. This is how a
            per-token temperature ``[b, s]`` or old and reference logprobs
            reach the reference.
        vocab_start: the first global id of ``weight``: row ``r`` of the
            ``[V_local, h]`` weight is token ``vocab_start + r``
            (``OutputContext.vocab.start``; 0 on one shard; a traced scalar
            inside ``shard_map``).
        vocab_size: ``V``, the global vocabulary (``OutputContext.vocab.size``;
            0 where the context had no vocab range).
        ignore_index: the label that selects no token (logprob 0, zero
            gradient, counted in no aggregation).
        logit_scale: the factor on the logits Megatron's ``scale_logits``
            applies: ``config.mup_output_mult`` when ``config.use_mup``, else
            1. :func:`jax_ref.processors.token_logprobs_of` applies it.
        softcap: the model's final-logit softcap ``s > 0``
            (``config.final_logit_softcapping``, Gemma's name), or None: the
            logits are ``s * tanh(u * logit_scale / s)`` before the temperature
            (``hookspec.conventions``). Every reference that forms logits
            applies it.
        collectives: the contract's ``Collectives`` over the vocabulary
            shards: ``SingleProcessCollectives`` (identity) on one shard,
            :class:`jax_ref.JaxCollectives` (``psum``/``pmax``/``all_gather``
            over the mesh axis) under :func:`jax_ref.sharded.shard_reference`.
            Every sum and max over the vocabulary goes through them, and the
            hidden states through ``gather_hidden_states``.
        mtp_depth: 0 for the main head, ``k`` for MTP depth ``k``.
    """

    labels: jax.Array | None = None
    loss_mask: jax.Array | None = None
    padding_mask: jax.Array | None = None
    input_ids: jax.Array | None = None
    context: Any = None
    vocab_start: Any = 0
    vocab_size: int = 0
    ignore_index: int = IGNORE_INDEX
    logit_scale: float = 1.0
    softcap: float | None = None
    collectives: Collectives = dataclasses.field(default_factory=SingleProcessCollectives)
    mtp_depth: int = 0

    def replace(self, **changes: Any) -> ReferenceInputs:
        return dataclasses.replace(self, **changes)

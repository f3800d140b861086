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

    Attributes:
        labels: ``[b, s]`` global token ids, or None.
        loss_mask: ``[b, s]`` float64, or None.
        padding_mask: ``[b, s]`` bool, True at padding, or None.
        input_ids: ``[b, s]``, or None.
        context: the user context with every torch tensor replaced by a JAX
            array (floating ones in float64); a dataclass stays that dataclass
            where it can be rebuilt, a mapping becomes a dict.
        vocab_start: the first global id of the weight shard (a traced scalar
            inside ``shard_map``).
        vocab_size: ``V``, the global vocabulary.
        ignore_index: the label that selects no token.
        logit_scale: Megatron's MuP ``mup_output_mult`` when ``use_mup``, else 1.
        collectives: the contract's collectives (identity on one shard).
        mtp_depth: 0 for the main head.
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
    collectives: Collectives = dataclasses.field(default_factory=SingleProcessCollectives)
    mtp_depth: int = 0

    def replace(self, **changes: Any) -> ReferenceInputs:
        return dataclasses.replace(self, **changes)

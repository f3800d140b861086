"""JAX references for the built-in processors, as functions of
``(hidden [s, b, h], weight [V_local, h], inputs: ReferenceInputs)``.

Each mirrors a factory of ``torch_impl.processors`` and returns the same
structure; each follows the vocab-parallel recipe through
``inputs.collectives`` and ``inputs.vocab_start``, so it runs on one shard or
under :func:`jax_ref.sharded.shard_reference`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .inputs import ReferenceInputs
from .references import linear_logprobs

__all__ = ["Reference", "cross_entropy_loss", "selected_logprobs", "token_logprobs_of"]

Reference = Callable[[jax.Array, jax.Array, ReferenceInputs], Any]


def token_logprobs_of(
    hidden: jax.Array,
    weight: jax.Array,
    inputs: ReferenceInputs,
    /,
    *,
    temperature: Any = 1.0,
    with_entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """``[b, s]`` logprobs (0 at ignored labels) and entropy of ``hidden [s, b, h]``."""
    h = inputs.collectives.gather_hidden_states(hidden).transpose(1, 0, 2)  # [b, s, h]
    res = linear_logprobs(
        h,
        weight,
        inputs.labels,
        temperature=temperature,
        ignore_index=inputs.ignore_index,
        with_entropy=with_entropy,
        vocab_start=inputs.vocab_start,
        logit_scale=inputs.logit_scale,
        collectives=inputs.collectives,
    )
    return res.logprobs, res.entropy


def selected_logprobs(*, temperature: float = 1.0, entropy: bool = False) -> Reference:
    """``{"logprobs": [b, s]}`` and, with ``entropy``, ``{"entropy": [b, s]}``."""

    def selected_logprobs_reference(hidden: jax.Array, weight: jax.Array, inputs: ReferenceInputs) -> Any:
        lp, ent = token_logprobs_of(hidden, weight, inputs, temperature=temperature, with_entropy=entropy)
        return {"logprobs": lp, "entropy": ent} if entropy else {"logprobs": lp}

    return selected_logprobs_reference


def cross_entropy_loss() -> Reference:
    """Unreduced cross entropy ``[b, s]``: ``-logprob`` (0 at ignored labels)."""

    def cross_entropy_reference(hidden: jax.Array, weight: jax.Array, inputs: ReferenceInputs) -> Any:
        lp, _ = token_logprobs_of(hidden, weight, inputs)
        return -lp

    return cross_entropy_reference

"""Build a ``hookspec.OutputContext`` from the upstream hook's keywords and a model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from megatron.core.tensor_parallel.utils import VocabUtility

from hookspec import (
    IGNORE_INDEX,
    UPSTREAM_HOOK_KEYWORDS,
    Collectives,
    OutputContext,
    ParallelLayout,
    VocabShard,
)

from .collectives import TorchCollectives

__all__ = ["build_output_context", "parallel_layout"]


def _size_rank(group: Any) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def parallel_layout(model: torch.nn.Module) -> ParallelLayout:
    """The tensor, context and pipeline layout of ``model``'s process groups."""
    pgs = getattr(model, "pg_collection", None)
    tp_size, tp_rank = _size_rank(getattr(pgs, "tp", None))
    cp_size, cp_rank = _size_rank(getattr(pgs, "cp", None))
    pp_size, pp_rank = _size_rank(getattr(pgs, "pp", None))
    return ParallelLayout(
        tp_size=tp_size,
        tp_rank=tp_rank,
        cp_size=cp_size,
        cp_rank=cp_rank,
        pp_size=pp_size,
        pp_rank=pp_rank,
        sequence_parallel=bool(getattr(model.config, "sequence_parallel", False)) and tp_size > 1,
    )


def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


def build_output_context(
    model: torch.nn.Module,
    hook_kwargs: Mapping[str, Any],
    *,
    padding_mask: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    mtp_depth: int = 0,
) -> OutputContext:
    """The typed context for ``hook_kwargs`` (the upstream hook's 16 keywords).

    The extras come from the model: its ``pg_collection`` gives the parallel
    layout and the collectives' group; the vocab range is Megatron's
    ``VocabUtility`` split of the local weight's rows.
    """
    layout = parallel_layout(model)
    output_weight = hook_kwargs.get("output_weight")
    output_layer = hook_kwargs.get("output_layer")
    vocab_weight = output_weight if output_weight is not None else getattr(output_layer, "weight", None)
    vocab = None
    if vocab_weight is not None:
        local = int(vocab_weight.shape[0])
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            local, layout.tp_rank, layout.tp_size
        )
        vocab = VocabShard(start=start, end=end, size=local * layout.tp_size)
    tp_group = getattr(getattr(model, "pg_collection", None), "tp", None)
    fields: dict[str, Any] = {k: hook_kwargs.get(k) for k in UPSTREAM_HOOK_KEYWORDS}
    if fields["scale_logits"] is None:
        fields["scale_logits"] = _identity
    return OutputContext(
        **fields,
        vocab_weight=vocab_weight,
        padding_mask=padding_mask,
        parallel=layout,
        vocab=vocab,
        mtp_depth=mtp_depth,
        ignore_index=ignore_index,
        # The protocol is generic in the array type; these act on the torch
        # tensors every context built here holds.
        collectives=cast(Collectives, TorchCollectives(tp_group, sequence_parallel=layout.sequence_parallel)),
    )

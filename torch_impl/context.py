"""Build a ``hookspec.OutputContext`` from the upstream hook's keywords and a model."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

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

from ._compat import model_process_groups
from .collectives import TorchCollectives

__all__ = ["build_output_context", "no_logit_scaling", "parallel_layout"]


def _size_rank(group: Any) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def parallel_layout(model: torch.nn.Module) -> ParallelLayout:
    """The tensor, context and pipeline layout of ``model``'s process groups."""
    pgs = model_process_groups(model)
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


def no_logit_scaling(logits: torch.Tensor) -> torch.Tensor:
    """``scale_logits`` where the model has none (releases before MuP): the identity."""
    return logits


class _StaticParts(NamedTuple):
    """What a context takes from the model's groups and weight shape, not from the call."""

    pg_collection: Any
    sequence_parallel_flag: bool
    local_vocab: int | None
    layout: ParallelLayout
    vocab: VocabShard | None
    collectives: TorchCollectives
    cp_group: Any
    # a micro-batch's own context-parallel group (packed_seq_params.cp_group) ->
    # the layout and collectives over it
    by_cp_group: dict[Any, tuple[ParallelLayout, TorchCollectives]]


_STATIC_PARTS: weakref.WeakKeyDictionary[torch.nn.Module, _StaticParts] = (
    weakref.WeakKeyDictionary()
)


def _static_parts(model: torch.nn.Module, vocab_weight: torch.Tensor | None) -> _StaticParts:
    """The layout, vocab shard and collectives of ``model``, read once per model.

    Process groups never change size or rank, so the parts are kept until the
    model's ``pg_collection`` object, its ``config.sequence_parallel`` or the
    local vocabulary rows change (about 50 us a forward saved on a CPU).
    """
    pgs = model_process_groups(model)
    sp_flag = bool(getattr(model.config, "sequence_parallel", False))
    local = int(vocab_weight.shape[0]) if vocab_weight is not None else None
    cached = _STATIC_PARTS.get(model)
    if (
        cached is not None
        and cached.pg_collection is pgs
        and cached.sequence_parallel_flag == sp_flag
        and cached.local_vocab == local
    ):
        return cached
    layout = parallel_layout(model)
    vocab = None
    if local is not None:
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            local, layout.tp_rank, layout.tp_size
        )
        vocab = VocabShard(start=start, end=end, size=local * layout.tp_size)
    cp_group = getattr(pgs, "cp", None)
    collectives = TorchCollectives(
        getattr(pgs, "tp", None), sequence_parallel=layout.sequence_parallel, cp_group=cp_group
    )
    parts = _StaticParts(pgs, sp_flag, local, layout, vocab, collectives, cp_group, {})
    _STATIC_PARTS[model] = parts
    return parts


def _micro_batch_parts(
    parts: _StaticParts, packed_seq_params: Any
) -> tuple[ParallelLayout, TorchCollectives]:
    """The layout and collectives of one micro-batch: the model's, or, where its
    ``packed_seq_params`` carries a ``cp_group`` (Megatron's dynamic context
    parallel), the same with that group's size, rank and context-parallel sum."""
    group = getattr(packed_seq_params, "cp_group", None)
    if group is None or group is parts.cp_group:
        return parts.layout, parts.collectives
    cached = parts.by_cp_group.get(group)
    if cached is None:
        size, rank = _size_rank(group)
        layout = dataclasses.replace(parts.layout, cp_size=size, cp_rank=rank)
        tp = parts.collectives
        collectives = TorchCollectives(
            tp.group, sequence_parallel=tp.sequence_parallel, cp_group=group
        )
        parts.by_cp_group[group] = cached = (layout, collectives)
    return cached


def build_output_context(
    model: torch.nn.Module,
    hook_kwargs: Mapping[str, Any],
    *,
    padding_mask: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    mtp_depth: int = 0,
    check_values: bool = True,
    labels_checked: bool = False,
) -> OutputContext:
    """The typed context for ``hook_kwargs`` (the upstream hook's 16 keywords).

    The extras come from the model: its ``pg_collection`` gives the parallel
    layout and the collectives' groups (tensor parallel; context parallel, or
    the micro-batch's ``packed_seq_params.cp_group`` where it carries one); the
    vocab range is Megatron's ``VocabUtility`` split of the local weight's rows.
    """
    output_weight = hook_kwargs.get("output_weight")
    output_layer = hook_kwargs.get("output_layer")
    vocab_weight = (
        output_weight if output_weight is not None else getattr(output_layer, "weight", None)
    )
    parts = _static_parts(model, vocab_weight)
    layout, collectives = _micro_batch_parts(parts, hook_kwargs.get("packed_seq_params"))
    fields: dict[str, Any] = {k: hook_kwargs.get(k) for k in UPSTREAM_HOOK_KEYWORDS}
    if fields["scale_logits"] is None:
        fields["scale_logits"] = no_logit_scaling
    return OutputContext(
        **fields,
        vocab_weight=vocab_weight,
        padding_mask=padding_mask,
        parallel=layout,
        vocab=parts.vocab,
        mtp_depth=mtp_depth,
        ignore_index=ignore_index,
        # The protocol is generic in the array type; these act on the torch
        # tensors every context built here holds.
        collectives=cast(Collectives, collectives),
        check_values=check_values,
        labels_checked=labels_checked,
    )

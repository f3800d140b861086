"""A plan's post-process node carrying the hook, for the schedule-plan tests: the
plan's own where the release builds one on a CPU, else Megatron's ``PostProcessNode``
over a ``ModelChunkState`` filled the way the plan fills it."""

from __future__ import annotations

import types
from typing import Any

import torch
from megatron.core.models.common.model_chunk_schedule_plan import ModelChunkState

from torch_impl.schedule_plan import attach_plan_hook, build_schedule_plan, prepare_plan_hook

try:
    from megatron.core.models.common.utils import PostProcessNode
except ImportError:  # 0.16
    from megatron.core.models.gpt.fine_grained_callables import PostProcessNode


def _plan_builds_on_cpu(model: Any) -> bool:
    try:
        torch.cuda.Event()
    except RuntimeError:
        return False
    return not model.config.mtp_num_layers


def post_node(model: Any, batch: dict[str, Any], **processors: Any) -> Any:
    """A plan-like ``(state, post_process)`` whose post-process node carries the hook."""
    args = (batch["input_ids"], batch["position_ids"], None)
    kw = {"labels": batch.get("labels"), "loss_mask": batch.get("loss_mask")}
    if _plan_builds_on_cpu(model):
        plan = build_schedule_plan(model, *args, **kw, **processors)
        state = plan.state
    else:
        state = ModelChunkState()
        for name, value in dict(
            input_ids=args[0],
            position_ids=args[1],
            attention_mask=None,
            decoder_input=None,
            labels=kw["labels"],
            mtp_hidden_states=None,
            loss_mask=kw["loss_mask"],
            packed_seq_params=None,
            padding_mask=None,
            extra_block_kwargs=None,
            runtime_gather_output=None,
            output_processor=None,
            output_processor_context=None,
            model=model,
        ).items():
            setattr(state, name, value)
        native_kwargs, hook = prepare_plan_hook(
            model, {"input_ids": args[0], "position_ids": args[1]}, **processors
        )
        for name, value in native_kwargs.items():
            setattr(state, name, value)
        node = PostProcessNode(model, state, None, None)
        attach_plan_hook(node, hook)
        plan = types.SimpleNamespace(state=state, post_process=node)
    for name in ("rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin", "sequence_len_offset"):
        setattr(state, name, None)  # what the pre-process node sets, for learned positions
    return plan

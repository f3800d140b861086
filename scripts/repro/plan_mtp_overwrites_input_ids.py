"""Megatron Core: with MTP layers, the combined-1F1B schedule plan's MTP nodes
overwrite the model chunk's ``input_ids`` (and ``position_ids``) with their rolled
copies, so the postprocess node hands the output hook, and the MTP loss, ids rolled
once per MTP layer.

Runs on a CPU with torch and megatron-core only: a two-layer MoE GPTModel (the plan
takes MTP layers only after a MoE layer) with two MTP layers, and its schedule plan
(``GPTModel.build_schedule_plan``, the nodes run in schedule order, forward only,
without streams). Prints one JSON line:

- ``defect``: after the plan's MTP nodes ran, the chunk state's ``input_ids`` are
  not the ids the plan was built with;
- ``rolled_by``: how many positions left they were rolled (an independent shift
  compared position by position; ``null`` if no shift up to the sequence length
  matches), and ``mtp_num_layers``;
- ``output_hook_sees_chunk_ids`` (releases whose ``GPTModel.build_schedule_plan``
  takes ``output_processor``, 0.18 on): whether the output hook in the plan received
  the chunk's ids, as it does in ``forward``; ``null`` elsewhere;
- ``rl_mtp_loss_equal`` (releases whose ``process_mtp_loss`` derives the labels from
  ``input_ids``): with ``labels=None`` (as RL trainers call it), whether the MTP loss
  each depth logs through the plan equals ``forward``'s; ``null`` elsewhere.

See docs/upstream.md. Exit status 0 whether or not the defect shows.
"""

from __future__ import annotations

import copy
import importlib.metadata
import inspect
import json
import os
import socket

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.pipeline_parallel.utils import NoopScheduleNode
from megatron.core.transformer import multi_token_prediction as mtp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, BATCH, DEPTHS = 64, 8, 2, 2


class CausalAttention(MegatronModule):
    """Core attention on a CPU (the stock local one allocates on CUDA)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        super().__init__(config=config)
        self.softmax_scale = kwargs.get("softmax_scale")

    def forward(self, query, key, value, attention_mask, **kwargs):
        sq, b, heads, hn = query.shape
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


def build_model() -> GPTModel:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        mtp_num_layers=DEPTHS,
        mtp_loss_scaling_factor=0.3,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        add_bias_linear=False,
    )
    spec = copy.deepcopy(get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False))
    spec.submodules.self_attention.submodules.core_attention = CausalAttention
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    torch.manual_seed(1234)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="learned_absolute",
        mtp_block_spec=mtp_spec,
    )


def run_plan_forward(plan) -> object:
    """Forward of every node of the plan in schedule order
    (``TransformerModelChunkSchedulePlan.run``)."""
    hidden = plan.pre_process.forward_func()
    for i in range(plan.num_layers()):
        layer = plan.get_layer(i)
        first = getattr(layer, "pre_dispatch_computation", None) or layer.attn  # 0.16 names it attn
        for node in (
            first,
            layer.moe_dispatch,
            layer.mlp,
            layer.moe_combine,
            layer.mtp_post_process,
        ):
            if not isinstance(node, NoopScheduleNode):
                hidden = node.forward_func(*(hidden if isinstance(hidden, tuple) else (hidden,)))
    return plan.post_process.forward_func(hidden)


def rolled_by(got: torch.Tensor, ids: torch.Tensor) -> int | None:
    """The k with ``got[:, :s-k] == ids[:, k:]`` (a left shift by k), if any."""
    for k in range(SEQ):
        if torch.equal(got[:, : SEQ - k], ids[:, k:]):
            return k
    return None


def logged_mtp_losses(model: GPTModel, run) -> list[float]:
    """The per-depth MTP losses ``process_mtp_loss`` logs while ``run()`` runs in
    training mode (the tracker given CPU buffers; it allocates on CUDA)."""
    tracker = mtp.MTPLossLoggingHelper.tracker
    tracker.clear()
    for key in ("loss_values", "correct_values", "total_values"):
        tracker[key] = torch.zeros(DEPTHS)
    model.train()
    with torch.no_grad():
        run()
    model.eval()
    values = [float(v) for v in tracker["loss_values"]]
    tracker.clear()
    return values


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    if not torch.cuda.is_available():
        # What the plan touches of CUDA, answered on a CPU: its event (built, never recorded
        # here), the device the MoE router moves its weight to, the stream the MoE combine
        # step records its residual on.
        torch.cuda.Event = lambda *args, **kwargs: None  # type: ignore[assignment,misc]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        torch.cuda.current_stream = lambda *args, **kwargs: None  # type: ignore[assignment]
        torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign]
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = (
            None  # unbound without Transformer Engine before 0.19 (report 3)
        )

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    pos = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()

    model = build_model().eval()
    with torch.no_grad():
        plan = model.build_schedule_plan(ids, pos, None, labels=labels)
        run_plan_forward(plan)
    state_ids = plan.state.input_ids
    report: dict[str, object] = {
        "megatron_core": importlib.metadata.version("megatron-core"),
        "defect": not (state_ids is ids or torch.equal(state_ids, ids)),
        "rolled_by": rolled_by(state_ids, ids),
        "mtp_num_layers": DEPTHS,
        "output_hook_sees_chunk_ids": None,
        "rl_mtp_loss_equal": None,
    }

    if "output_processor" in inspect.signature(model.build_schedule_plan).parameters:
        seen: list[torch.Tensor] = []

        def hook(**kwargs):
            seen.append(kwargs["input_ids"])
            logits, _ = kwargs["output_layer"](kwargs["hidden_states"])
            return logits.float().logsumexp(-1).transpose(0, 1)

        with torch.no_grad():
            run_plan_forward(model.build_schedule_plan(ids, pos, None, output_processor=hook))
        report["output_hook_sees_chunk_ids"] = len(seen) == 1 and torch.equal(seen[0], ids)

    process = getattr(mtp, "process_mtp_loss", None)
    if process is not None and "input_ids" in inspect.signature(process).parameters:
        want = logged_mtp_losses(
            model, lambda: model(ids, pos, None, loss_mask=torch.ones(BATCH, SEQ))
        )
        got = logged_mtp_losses(
            model,
            lambda: run_plan_forward(
                model.build_schedule_plan(ids, pos, None, loss_mask=torch.ones(BATCH, SEQ))
            ),
        )
        report["rl_mtp_loss_equal"] = got == want
        report["rl_mtp_loss_forward"] = [round(v, 4) for v in want]
        report["rl_mtp_loss_plan"] = [round(v, 4) for v in got]

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""Megatron Core: the combined-1F1B schedule plan never applies the decoder's
final norm when the model chunk's last decoder layer is dense.

Runs on a CPU with torch and megatron-core only: a two-layer dense GPTModel,
its loss through ``forward`` and through its own schedule plan
(``GPTModel.build_schedule_plan``, the plan's nodes run in schedule order,
forward only, without streams). Prints one JSON line:

- ``defect``: the plan's loss differs from ``forward``'s;
- ``plan_is_forward_without_final_norm``: the plan's loss equals, bitwise,
  ``forward``'s with ``decoder.final_layernorm`` removed (the cause);
- ``max_abs_diff``: the largest per-token loss difference.

See docs/upstream.md. Exit status 0 whether or not the defect shows.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import socket

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel.utils import NoopScheduleNode
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


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
    )
    spec = copy.deepcopy(get_gpt_layer_local_spec())
    spec.submodules.self_attention.submodules.core_attention = CausalAttention
    torch.manual_seed(1234)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=64,
        max_sequence_length=64,
        position_embedding_type="learned_absolute",
    )


def run_plan_forward(plan) -> torch.Tensor:
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


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    if not torch.cuda.is_available():
        # The plan builds a CUDA event; nothing records it here. A CPU-only torch cannot build one.
        torch.cuda.Event = lambda *args, **kwargs: None  # type: ignore[assignment,misc]

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 9), generator=g)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    pos = torch.arange(8).expand(2, 8).contiguous()

    model = build_model()
    with torch.no_grad():
        forward_loss = model(ids, pos, None, labels=labels)
        plan_loss = run_plan_forward(model.build_schedule_plan(ids, pos, None, labels=labels))
        model.decoder.final_layernorm = None
        unnormed_loss = model(ids, pos, None, labels=labels)
    report = {
        "megatron_core": importlib.metadata.version("megatron-core"),
        "defect": not torch.equal(plan_loss, forward_loss),
        "plan_is_forward_without_final_norm": torch.equal(plan_loss, unnormed_loss),
        "max_abs_diff": float((plan_loss - forward_loss).abs().max()),
        "forward_loss_sum": float(forward_loss.sum()),
        "plan_loss_sum": float(plan_loss.sum()),
    }
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""A tiny Megatron GPT with MoE layers, for the schedule-plan tests.

Built through Megatron's own spec system (``get_gpt_decoder_block_spec`` with
local modules, and ``get_gpt_mtp_block_spec`` for MTP layers), with the core
attention of :func:`torch_impl.testing.tiny.cpu_layer_spec`, the ``allgather`` token
dispatcher (the ``alltoall`` one creates a CUDA stream when built), no load
balancing loss and no linear biases (a biased expert adds its bias in place to
the output of a custom autograd function, which autograd refuses).

On a CPU its MoE layers build, but Megatron's router moves a CPU gate weight to
``torch.cuda.current_device()`` on every call (``TopKRouter.gating``), so
running them on a CPU needs that function to answer ``"cpu"``; the tests do
this. On a GPU, move the model with ``.cuda()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
)

from hookspec import ContractError

from .tiny import CPUCoreAttention, TinyGPTShape, build_tiny_gpt, tiny_config

__all__ = ["build_tiny_moe_gpt"]


def build_tiny_moe_gpt(
    moe_layers: Sequence[int],
    shape: TinyGPTShape | None = None,
    *,
    seed: int = 1234,
    num_experts: int = 4,
    topk: int = 2,
    mtp_num_layers: int = 0,
    **config_overrides: Any,
) -> GPTModel:
    """A tiny GPT whose layer ``i`` is a MoE layer where ``moe_layers[i]`` is 1,
    dense where it is 0 (Megatron's ``moe_layer_freq`` as a list); MTP layers
    (``mtp_num_layers``) are MoE layers, as Megatron's plan requires them.
    ``shape``: :class:`TinyGPTShape` (two layers) by default."""
    shape = TinyGPTShape() if shape is None else shape
    if len(moe_layers) != shape.num_layers or any(v not in (0, 1) for v in moe_layers):
        raise ContractError(
            "moe_layers",
            expected=f"{shape.num_layers} entries, each 0 (dense) or 1 (MoE)",
            actual=list(moe_layers),
        )
    kwargs: dict[str, Any] = dict(
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_layer_freq=list(moe_layers),
        moe_ffn_hidden_size=shape.hidden_size // 2,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        add_bias_linear=False,
    )
    if mtp_num_layers:
        kwargs["mtp_num_layers"] = mtp_num_layers
    kwargs.update(config_overrides)
    config = tiny_config(shape, **kwargs)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    for layer_spec in block.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = CPUCoreAttention
    mtp_spec = None
    if mtp_num_layers:
        moe_spec = (
            next(s for s, v in zip(block.layer_specs, moe_layers) if v) if any(moe_layers) else None
        )
        if moe_spec is None:
            raise ContractError(
                "moe_layers",
                expected="at least one MoE layer (the MTP layers copy its spec)",
                actual=list(moe_layers),
            )
        mtp_spec = get_gpt_mtp_block_spec(config, moe_spec, use_transformer_engine=False)
    return build_tiny_gpt(
        shape, seed=seed, transformer_layer_spec=block, mtp_block_spec=mtp_spec, **kwargs
    )

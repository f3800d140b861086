"""A tiny Megatron ``HybridModel`` (Megatron Core 0.19+) that runs on a CPU.

The shipped hybrid stack specs use Transformer Engine modules throughout, and
``HybridStack`` builds its final norm with Transformer Engine. This spec keeps
to what runs on a CPU: attention (``*``) and MLP (``-``) layers assembled from
the local GPT layer spec of :func:`torch_impl.tiny.cpu_layer_spec`, no final
norm (``post_layer_norm=False``), and an MTP block of local modules when the
pattern asks for one (``"*-*-/*-"``: one MTP depth of an attention and an MLP
layer). No Mamba layer (``M``) is supported: its kernels need CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .tiny import TinyGPTShape, cpu_layer_spec, tiny_config

__all__ = ["build_tiny_hybrid", "cpu_hybrid_stack_spec"]


def cpu_hybrid_stack_spec() -> ModuleSpec:
    """A ``HybridStack`` spec of local attention and MLP layers, without a final norm."""
    layer = cpu_layer_spec().submodules
    norm = layer.input_layernorm
    attention = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=layer.self_attention,
            self_attn_bda=layer.self_attn_bda,
        ),
    )
    mlp = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=layer.pre_mlp_layernorm, mlp=layer.mlp, mlp_bda=layer.mlp_bda
        ),
    )
    mtp_block = ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[
                ModuleSpec(
                    module=MultiTokenPredictionLayer,
                    submodules=MultiTokenPredictionLayerSubmodules(
                        enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, layer_norm=norm
                    ),
                )
            ]
        ),
    )
    return ModuleSpec(
        module=HybridStack,
        params={"post_layer_norm": False},
        submodules=HybridStackSubmodules(
            attention_layer=attention, mlp_layer=mlp, mtp_block_spec=mtp_block
        ),
    )


def build_tiny_hybrid(
    pattern: str = "*-*-",
    shape: TinyGPTShape | None = None,
    *,
    seed: int = 1234,
    share_embeddings_and_output_weights: bool = False,
    **config_overrides: Any,
) -> HybridModel:
    """A tiny ``HybridModel`` on the CPU with layer ``pattern`` (``*`` and ``-`` only,
    ``/`` before each MTP depth's pattern); the same ``seed`` gives the same weights."""
    shape = shape or TinyGPTShape()
    main, *depths = pattern.split("/")
    overrides: dict[str, Any] = {"num_layers": len(main)}
    if depths:
        overrides["mtp_num_layers"] = len(depths)
    overrides.update(config_overrides)
    config = tiny_config(shape, **overrides)
    torch.manual_seed(seed)
    return HybridModel(
        config=config,
        hybrid_stack_spec=cpu_hybrid_stack_spec(),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_sequence_length,
        hybrid_layer_pattern=pattern,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type="learned_absolute",
    )

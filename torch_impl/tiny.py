"""A tiny Megatron GPT that builds and runs on a CPU: to try the hook and the
processors without a GPU, for the README's quickstart, the examples, the tools
(``doctor``, ``hookcheck``), the notebooks, the benchmarks and the tests.

A supported entry point of the project (``torch_impl.testing`` is test support and
re-exports these names for the tests):

>>> from torch_impl.tiny import build_tiny_gpt, megatron_parallel, tiny_batch
>>> with megatron_parallel():  # gloo, one process, and Megatron's groups; torn down on exit
...     model = build_tiny_gpt()  # Megatron's GPTModel: 2 layers, hidden 32, V 64, fp32
...     batch = tiny_batch()  # input_ids, position_ids, labels, loss_mask: [2, 8]
...     logits = model(batch["input_ids"], batch["position_ids"], None)  # no labels: logits
>>> tuple(logits.shape)
(2, 8, 64)

Built through Megatron's own spec system: ``get_gpt_layer_local_spec()`` with its
core attention swapped for :class:`CPUCoreAttention` (the stock local attention
takes its scratch buffer from a CUDA memory pool), learned absolute positions
(rotary kernels need CUDA), fusions off and dropout 0. Megatron's schedules
(``get_forward_backward_func``) still allocate on CUDA; on a CPU the tests run
them under ``torch_impl.testing.schedules.cpu_schedule()`` (``docs/schedules.md``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from .process_state import free_port, megatron_parallel

__all__ = [
    "CPUCoreAttention",
    "TinyGPTShape",
    "build_tiny_gpt",
    "cpu_layer_spec",
    "free_port",
    "megatron_parallel",
    "tiny_batch",
    "tiny_config",
]


class CPUCoreAttention(MegatronModule):
    """Causal softmax attention through ``F.scaled_dot_product_attention``.

    Takes Megatron's core-attention arguments: query ``[sq, b, np, hn]``, key
    and value ``[sk, b, ng, hn]``; returns ``[sq, b, np * hn]``. With packed
    (THD) ``packed_seq_params`` the mask is causal within each sequence.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        **_: Any,
    ) -> None:
        super().__init__(config=config)
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
        **_: Any,
    ) -> torch.Tensor:
        thd = query.dim() == 3  # packed input arrives as [t, np, hn]
        if thd:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        sq, b, n_heads, hn = query.shape
        groups = key.shape[2]
        if groups != n_heads:
            key = key.repeat_interleave(n_heads // groups, dim=2)
            value = value.repeat_interleave(n_heads // groups, dim=2)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, np, s, hn]
        mask = torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).tril()
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q.to(q.device)
            seq_id = torch.bucketize(torch.arange(sq, device=q.device), cu[1:], right=True)
            mask = mask & (seq_id[:, None] == seq_id[None, :])
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.softmax_scale
        )
        out = out.permute(2, 0, 1, 3).reshape(sq, b, n_heads * hn)
        return out.squeeze(1) if thd else out


def cpu_layer_spec() -> Any:
    """Megatron's local GPT layer spec with :class:`CPUCoreAttention`."""
    spec = copy.deepcopy(get_gpt_layer_local_spec())
    spec.submodules.self_attention.submodules.core_attention = CPUCoreAttention
    return spec


@dataclasses.dataclass(frozen=True)
class TinyGPTShape:
    """Sizes of the tiny model."""

    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    vocab_size: int = 64
    max_sequence_length: int = 64


def tiny_config(shape: TinyGPTShape = TinyGPTShape(), **overrides: Any) -> TransformerConfig:
    """A CPU-safe ``TransformerConfig``: fp32, dropout 0, fusions off."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    kwargs: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


# Settings that place layers on pipeline stages: dropped for the unpipelined model a
# pipeline stage takes its weights from.
_STAGE_PLACEMENT = (
    "virtual_pipeline_model_parallel_size",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def build_tiny_gpt(
    shape: TinyGPTShape = TinyGPTShape(),
    *,
    seed: int = 1234,
    share_embeddings_and_output_weights: bool = False,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    mtp_block_spec: Any = None,
    transformer_layer_spec: Any = None,
    vp_stage: int | None = None,
    **config_overrides: Any,
) -> GPTModel:
    """A tiny ``GPTModel`` on the CPU, in Megatron's current parallel state.

    The same ``seed`` gives the same model on every call and every layout: under
    tensor parallel each rank holds its shard of the one model (Megatron's CPU
    initialisation splits one master weight), and under pipeline parallel each
    stage holds exactly the unpipelined (pp=1) model's embedding, layers (by
    their global layer number), final norm and output layer, so a pipelined run
    starts from the same weights as one process. Torch's global RNG is left as
    it was found (the weights are drawn under ``torch.random.fork_rng``).

    ``shape``: the sizes (:class:`TinyGPTShape`); ``config_overrides``: any
    ``TransformerConfig`` field (:func:`tiny_config`). ``pre_process`` /
    ``post_process``: whether this stage holds the embedding / the output layer
    (default: from the pipeline rank). ``transformer_layer_spec``: a layer or block
    spec instead of :func:`cpu_layer_spec`. ``vp_stage``: this model chunk's virtual
    pipeline stage (interleaved schedule; pass
    ``virtual_pipeline_model_parallel_size=`` too), which sets its layers and whether
    it holds the embedding and the output layer.
    """
    config = tiny_config(shape, **config_overrides)
    pre_process, post_process = _stage_ends(pre_process, post_process, vp_stage)
    spec = cpu_layer_spec() if transformer_layer_spec is None else transformer_layer_spec

    def build(config: TransformerConfig, pre: bool, post: bool, vp: int | None) -> GPTModel:
        torch.manual_seed(seed)
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=shape.vocab_size,
            max_sequence_length=shape.max_sequence_length,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type="learned_absolute",
            mtp_block_spec=mtp_block_spec,
            vp_stage=vp,
        )

    with torch.random.fork_rng(devices=[]):
        model = build(config, pre_process, post_process, vp_stage)
        if config.pipeline_model_parallel_size > 1:
            # Each stage draws its weights from a fresh seed, so a later stage's first
            # layer would get the numbers of the model's first layer: this stage takes
            # the unpipelined model's tensors instead.
            kept = {k: v for k, v in config_overrides.items() if k not in _STAGE_PLACEMENT}
            whole = build(_unpipelined_config(shape, kept), True, True, None).state_dict()
            model.load_state_dict(_stage_tensors(model, whole), strict=False)
    return model


def _stage_ends(
    pre_process: bool | None, post_process: bool | None, vp_stage: int | None
) -> tuple[bool, bool]:
    """``(pre_process, post_process)`` as given, else from the pipeline rank (and the
    virtual stage ``vp_stage`` where given): whether this stage holds the embedding and
    the output layer."""
    virtual = vp_stage is not None
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(
            ignore_virtual=not virtual, vp_stage=vp_stage
        )
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(
            ignore_virtual=not virtual, vp_stage=vp_stage
        )
    return pre_process, post_process


def _unpipelined_config(shape: TinyGPTShape, overrides: dict[str, Any]) -> TransformerConfig:
    """The config of the same model in one pipeline stage (``overrides`` without the
    stage placement's fields)."""
    return tiny_config(
        shape,
        **overrides,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
    )


def _stage_tensors(stage: GPTModel, whole: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The unpipelined model's tensors (``whole``, its state dict) under the stage's
    names: the stage's ``decoder.layers.i`` is the whole model's layer of the same
    ``layer_number``; a last stage's own copy of a tied embedding
    (``output_layer.weight``) is the embedding."""
    layers = stage.decoder.layers

    def whole_name(name: str) -> str:
        if name.startswith("decoder.layers."):
            i, rest = name.removeprefix("decoder.layers.").split(".", 1)
            return f"decoder.layers.{layers[int(i)].layer_number - 1}.{rest}"
        if name == "output_layer.weight" and name not in whole:
            return "embedding.word_embeddings.weight"
        return name

    out = {}
    for name in stage.state_dict():
        if "_extra_state" in name:
            continue
        source = whole_name(name)
        if source not in whole:
            raise RuntimeError(
                f"build_tiny_gpt: the unpipelined model has no {source!r} for this stage's {name!r}"
            )
        out[name] = whole[source]
    return out


def tiny_batch(
    batch: int = 2, seq: int = 8, vocab_size: int = 64, *, seed: int = 0
) -> dict[str, torch.Tensor | None]:
    """``input_ids``, ``position_ids``, ``attention_mask`` (None: causal inside the
    attention), ``labels`` (inputs shifted by one) and ``loss_mask``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq + 1), generator=g)
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "position_ids": torch.arange(seq).expand(batch, seq).contiguous(),
        "attention_mask": None,
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones(batch, seq),
    }

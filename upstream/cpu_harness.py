"""A pytest plugin that runs the series' tests on a CPU without Transformer Engine.

Loaded by ``scripts/upstream_check.sh`` (``-p cpu_harness``, with ``upstream/`` on
``PYTHONPATH``) for two kinds of test:

- Megatron's own unit tests that the patches add and that need neither Transformer
  Engine nor ``megatron.training`` (``tests/unit_tests/...``). They import
  ``tests.unit_tests.test_utilities.Utils``, which initializes NCCL on CUDA devices;
  here :class:`Utils` takes its place (the same methods, over gloo, one process or as
  many as ``torchrun`` starts), and, for the length of each such test, the CUDA calls
  Megatron makes to place or synchronize tensors (``torch.cuda.current_device``,
  ``torch.cuda.synchronize``, ``torch.cuda.is_current_stream_capturing``) answer for
  the CPU. Those tests are unchanged: on GPUs
  they run as Megatron's CI runs them.
- The CPU checks of the patches whose Megatron tests need GPUs or Transformer Engine
  (``upstream/cpu_tests``). They share what is here instead of each carrying its own:
  the gloo world (:func:`model_parallel`), a causal core attention for Megatron's
  local layer specs (:class:`CPUCoreAttention`: the local one takes its scratch buffer
  from CUDA), CPU buffers for the MTP logging tracker (:func:`cpu_mtp_tracker`),
  :func:`router_on_cpu` for MoE models (the router moves its weight to the current CUDA
  device on every forward), and :func:`cuda_stand_ins`, which a test enters only around
  the schedule plan (its CUDA events and streams).

Every process group is this plugin's own gloo world, created once per session; no
test runs on a group a caller created.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import sys
import types
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
import torch


class Utils:
    """``tests.unit_tests.test_utilities.Utils`` over gloo on a CPU."""

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    inited = False

    @staticmethod
    def initialize_distributed() -> None:
        if not torch.distributed.is_initialized():
            if "MASTER_PORT" in os.environ:  # started by torchrun
                init_method = "env://"
            else:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
            torch.distributed.init_process_group(
                "gloo",
                init_method=init_method,
                rank=Utils.rank,
                world_size=Utils.world_size,
                timeout=timedelta(minutes=2),
            )
        Utils.inited = True

    @staticmethod
    def destroy_model_parallel() -> None:
        from megatron.core import parallel_state

        if not Utils.inited:
            return
        torch.distributed.barrier()
        parallel_state.destroy_model_parallel()
        Utils.inited = False

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        Utils.initialize_distributed()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size,
            **kwargs,
        )
        Utils.inited = True


def _install_utils() -> None:
    """Make ``from tests.unit_tests.test_utilities import Utils`` find :class:`Utils`."""
    module = types.ModuleType("tests.unit_tests.test_utilities")
    module.Utils = Utils  # type: ignore[attr-defined]
    sys.modules["tests.unit_tests.test_utilities"] = module


def pytest_configure(config: pytest.Config) -> None:
    _install_utils()


def pytest_unconfigure(config: pytest.Config) -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def _megatron_unit_test_on_cpu(request: pytest.FixtureRequest) -> Iterator[None]:
    """For Megatron's own unit tests only: the CUDA calls that place and synchronize
    tensors answer for the CPU."""
    if "unit_tests" not in request.node.path.parts or torch.cuda.is_available():
        yield
        return
    with (
        mock.patch("torch.cuda.current_device", return_value="cpu"),
        mock.patch("torch.cuda.synchronize"),
        mock.patch("torch.cuda.is_current_stream_capturing", return_value=False),
    ):
        yield


@pytest.fixture
def model_parallel() -> Iterator[None]:
    """Megatron's model-parallel groups at size 1 on the session's gloo world."""
    Utils.initialize_model_parallel(1, 1)
    yield
    Utils.destroy_model_parallel()


@pytest.fixture
def router_on_cpu() -> Iterator[None]:
    """For MoE models: the router moves its weight to ``torch.cuda.current_device()`` on
    every forward; here that device is the CPU."""
    with mock.patch("torch.cuda.current_device", return_value="cpu"):
        yield


@contextlib.contextmanager
def cuda_stand_ins() -> Iterator[None]:
    """The CUDA objects the combined-1F1B schedule plan takes when it is built and run
    node by node without streams: its event, the current stream and device, and
    ``Tensor.record_stream``."""
    with (
        mock.patch("torch.cuda.Event"),
        mock.patch("torch.cuda.current_stream"),
        mock.patch("torch.cuda.current_device", return_value="cpu"),
        mock.patch.object(torch.Tensor, "record_stream", create=True),
    ):
        yield


@pytest.fixture
def cpu_mtp_tracker() -> Iterator[dict[str, Any]]:
    """CPU buffers for ``MTPLossLoggingHelper.tracker`` (it allocates on the current CUDA
    device when an MTP loss is logged in training), two depths."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    saved = dict(tracker)
    tracker.clear()
    for key in ("loss_values", "correct_values", "total_values"):
        tracker[key] = torch.zeros(2)
    yield tracker
    tracker.clear()
    tracker.update(saved)


def _cpu_core_attention() -> type:
    from megatron.core.transformer.module import MegatronModule

    class CPUCoreAttention(MegatronModule):
        """Causal attention through ``scaled_dot_product_attention``, for Megatron's local
        layer specs on a CPU (the local core attention takes its scratch buffer from CUDA)."""

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, **kwargs: Any):
            super().__init__(config=config)
            self.softmax_scale = kwargs.get("softmax_scale")

        def forward(self, query: Any, key: Any, value: Any, attention_mask: Any, **kw: Any) -> Any:
            sq, b, heads, hn = query.shape
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale
            )
            return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    return CPUCoreAttention


def with_cpu_attention(spec: Any) -> Any:
    """A copy of a layer spec, or of a block spec's layer specs, with the CPU core
    attention in every self-attention."""
    spec = copy.deepcopy(spec)
    attention = _cpu_core_attention()
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        layer.submodules.self_attention.submodules.core_attention = attention
    return spec


def tiny_config(**overrides: Any) -> Any:
    """A small ``TransformerConfig`` for CPU runs: no dropout, no fusions."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_overrides(**overrides: Any) -> dict[str, Any]:
    """Four experts, top-2, the allgather dispatcher (one rank), no load balancing."""
    kwargs: dict[str, Any] = dict(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        add_bias_linear=False,
    )
    kwargs.update(overrides)
    return kwargs


def token_batch(vocab: int, seq: int, batch: int = 2, seed: int = 0) -> dict[str, Any]:
    """``input_ids``, ``position_ids``, ``labels`` (the ids one place on) and a
    ``loss_mask`` with one masked position."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    loss_mask = torch.ones(batch, seq)
    loss_mask[0, 2] = 0.0
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "position_ids": torch.arange(seq).expand(batch, seq).contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": loss_mask,
    }


def run_plan_forward(plan: Any) -> Any:
    """A schedule plan's nodes in schedule order, forward only, without streams and
    chained without detaching (``TransformerModelChunkSchedulePlan.run(plan, None)``
    without its streams)."""
    from megatron.core.pipeline_parallel.utils import NoopScheduleNode

    hidden = plan.pre_process.forward_func()
    for i in range(plan.num_layers()):
        layer = plan.get_layer(i)
        for name in NODE_ORDER:
            node = getattr(layer, name, None)
            if node is not None and not isinstance(node, NoopScheduleNode):
                hidden = node.forward_func(*(hidden if isinstance(hidden, tuple) else (hidden,)))
    return plan.post_process.forward_func(hidden)


# A layer's nodes in forward order: main and the releases name the first one
# pre_dispatch_computation, dev names it attn and adds mhc_post.
NODE_ORDER = (
    "pre_dispatch_computation",
    "attn",
    "moe_dispatch",
    "mlp",
    "moe_combine",
    "mhc_post",
    "mtp_post_process",
)


def grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got: Any, want: Any) -> None:
    """The same parameters have gradients in both models, bitwise equal."""
    got_grads, want_grads = grads(got), grads(want)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        assert torch.equal(got_grads[name], want_grads[name]), name


def cpu_hybrid_stack_spec() -> Any:
    """A ``HybridStack`` spec of Megatron's local attention (``*``, with
    :class:`CPUCoreAttention`) and MLP (``-``) layers and an MTP block, without the stack's
    final norm (built with Transformer Engine). Mamba layers (``M``) need kernels that
    have no CPU build."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    local = with_cpu_attention(get_gpt_layer_local_spec()).submodules
    norm = local.pre_mlp_layernorm
    attention_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=local.input_layernorm,
            self_attention=local.self_attention,
            self_attn_bda=local.self_attn_bda,
        ),
    )
    mlp_layer = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=local.mlp, mlp_bda=local.mlp_bda
        ),
    )
    mtp_layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, layer_norm=norm
        ),
    )
    return ModuleSpec(
        module=HybridStack,
        params={"post_layer_norm": False},
        submodules=HybridStackSubmodules(
            attention_layer=attention_layer,
            mlp_layer=mlp_layer,
            mtp_block_spec=ModuleSpec(
                module=MultiTokenPredictionBlock,
                submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer]),
            ),
        ),
    )


def tiny_hybrid(pattern: str, *, vocab: int, seq: int, seed: int = 1234, **kwargs: Any) -> Any:
    """A ``HybridModel`` of :func:`cpu_hybrid_stack_spec` for ``pattern`` (one MTP depth
    per ``/`` group), in eval mode (MTP logging allocates on CUDA in training)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    main, *depths = pattern.split("/")
    config = tiny_config(
        num_layers=len(main), mtp_num_layers=len(depths) or None, mtp_loss_scaling_factor=0.3
    )
    torch.manual_seed(seed)
    return HybridModel(
        config=config,
        hybrid_stack_spec=cpu_hybrid_stack_spec(),
        vocab_size=vocab,
        max_sequence_length=seq,
        hybrid_layer_pattern=pattern,
        position_embedding_type="learned_absolute",
        **kwargs,
    ).eval()

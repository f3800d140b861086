"""GPU-only checks of the GPT hook: Transformer Engine layers, sequence parallel, and
Megatron's own forward/backward schedule. Marked ``gpu``: skipped without CUDA."""

from __future__ import annotations

import importlib.util
from functools import partial
from typing import Any

import pytest
import torch

import torch_impl
from tests.support import hook_cases as cases
from tests.support.distributed import run_distributed
from torch_impl.testing.tiny import TinyGPTShape, megatron_parallel, tiny_batch, tiny_config

pytestmark = pytest.mark.gpu

HAS_TE = importlib.util.find_spec("transformer_engine") is not None


def _cuda_gpt(spec: Any, *, seed: int = 1234, **overrides: Any) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    shape = TinyGPTShape()
    config = tiny_config(shape, use_cpu_initialization=False, **overrides)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_sequence_length,
        position_embedding_type="rope",
    ).cuda()


def _cuda_batch(**kw: Any) -> dict[str, Any]:
    return {
        k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in tiny_batch(**kw).items()
    }


@pytest.mark.skipif(not HAS_TE, reason="Transformer Engine is not installed")
def test_transformer_engine_spec_bitwise_stock() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    with megatron_parallel():
        spec = get_gpt_layer_with_transformer_engine_spec()
        stock = _cuda_gpt(spec)
        enabled = torch_impl.enable_output_processor(_cuda_gpt(spec))
        batch = _cuda_batch()
        inputs = cases.model_inputs(batch)
        ref = stock(*inputs, labels=batch["labels"])
        assert torch.equal(ref, enabled(*inputs, labels=batch["labels"]))
        assert torch.equal(
            ref, enabled(*inputs, labels=batch["labels"], output_processor=cases.stock_loss)
        )


def _forward_step(batch: dict[str, Any], data_iterator: Any, model: torch.nn.Module) -> Any:
    out = model(
        *cases.model_inputs(batch),
        labels=batch["labels"],
        output_processor=cases.vocab_parallel_logprobs,
    )

    def loss_func(result: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        loss = -(result["logprobs"] * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        return loss, {"nll": loss.detach()}

    return out, loss_func


def test_megatron_schedule_carries_a_mapping_result() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with megatron_parallel():
        model = torch_impl.enable_output_processor(_cuda_gpt(get_gpt_layer_local_spec()))
        batch = _cuda_batch()
        losses = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, batch),
            data_iterator=iter([None]),
            model=[model],
            num_microbatches=1,
            seq_length=8,
            micro_batch_size=2,
            forward_only=False,
        )
        logits = model(*cases.model_inputs(batch)).detach()
        expected = -cases.reference_logprobs(logits, batch["labels"]).mean()
        torch.testing.assert_close(losses[0]["nll"].double(), expected, rtol=1e-5, atol=1e-5)
        assert (
            model.output_layer.weight.grad is not None
            or model.output_layer.weight.main_grad is not None
        )


def _sp_rank(rank: int) -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.cuda.set_device(rank)
    batch = _cuda_batch()
    sp = torch_impl.enable_output_processor(
        _cuda_gpt(get_gpt_layer_local_spec(), sequence_parallel=True)
    )
    plain = torch_impl.enable_output_processor(_cuda_gpt(get_gpt_layer_local_spec()))
    out_sp = sp(
        *cases.model_inputs(batch),
        labels=batch["labels"],
        output_processor=cases.vocab_parallel_logprobs,
    )
    out = plain(
        *cases.model_inputs(batch),
        labels=batch["labels"],
        output_processor=cases.vocab_parallel_logprobs,
    )
    torch.testing.assert_close(out_sp["logprobs"], out["logprobs"], rtol=1e-5, atol=1e-5)
    out_sp["logprobs"].sum().backward()
    out["logprobs"].sum().backward()
    torch.testing.assert_close(
        sp.output_layer.weight.grad, plain.output_layer.weight.grad, rtol=1e-4, atol=1e-5
    )


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="sequence parallel needs tp=2, one GPU per rank"
)
def test_sequence_parallel_gathers_hidden_states() -> None:
    run_distributed(_sp_rank, tp=2, backend="nccl")


def test_megatron_ddp_wrapper() -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    with megatron_parallel():
        stock = _cuda_gpt(get_gpt_layer_local_spec())
        model = _cuda_gpt(get_gpt_layer_local_spec())
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        assert (
            torch_impl.enable_output_processor(ddp) is ddp and torch_impl.unwrap_model(ddp) is model
        )
        batch = _cuda_batch()
        out = ddp(
            *cases.model_inputs(batch), labels=batch["labels"], output_processor=cases.stock_loss
        )
        assert torch.equal(out, stock(*cases.model_inputs(batch), labels=batch["labels"]))
        out.sum().backward()
        assert model.output_layer.weight.main_grad.abs().sum() > 0

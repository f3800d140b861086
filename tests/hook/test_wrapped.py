"""A language model inside wrappers: Megatron's multimodal pattern (the GPT at
``.language_model``), under ``Float16Module`` and Megatron's
``DistributedDataParallel`` (DDP -> Float16Module -> wrapper -> ``.language_model``).

Each wrapped model's processor result equals (``torch.equal``) the unwrapped
language model's, built with the same seed and run with the same processor;
gradients too. Megatron's DDP allocates its grad buffers on
``torch.cuda.current_device()``: it is built on the CPU under
``torch_impl.testing.schedules.cpu_schedule``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torch_impl
from hookspec import ContractError
from tests.support import hook_cases as cases
from torch_impl.processors import selected_logprobs
from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch

pytestmark = pytest.mark.usefixtures("megatron_single")


class TinyMultimodal(torch.nn.Module):
    """A wrapper in the shape of Megatron's multimodal models: a module of its own
    beside the GPT at ``.language_model``; ``forward`` passes the hook's keywords on."""

    def __init__(self, language_model: torch.nn.Module) -> None:
        super().__init__()
        self.vision_projection = torch.nn.Linear(4, 4)
        self.language_model = language_model

    def set_input_tensor(self, tensor: Any) -> None:
        self.language_model.set_input_tensor(tensor)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any, **kw: Any
    ) -> Any:
        return self.language_model(input_ids, position_ids, attention_mask, **kw)


def _run(model: torch.nn.Module, batch: dict[str, Any], processor: Any) -> dict[str, torch.Tensor]:
    out = model(*cases.model_inputs(batch), labels=batch["labels"], output_processor=processor)
    assert isinstance(out, dict)
    (out["logprobs"].sum() + 0.5 * out["entropy"].sum()).backward()
    return out


def _gpt_grads(gpt: torch.nn.Module, *, main_grad: bool = False) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in gpt.named_parameters():
        grad = p.main_grad if main_grad else p.grad
        if grad is not None:
            grads[name] = grad
    return grads


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and len(want) > 0
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_language_model_attribute_is_unwrapped() -> None:
    batch = tiny_batch()
    processor = selected_logprobs(entropy=True)
    reference = torch_impl.enable_output_processor(build_tiny_gpt())
    want = _run(reference, batch, processor)
    gpt = build_tiny_gpt()
    wrapped = TinyMultimodal(gpt)
    assert torch_impl.enable_output_processor(wrapped) is wrapped
    assert torch_impl.unwrap_model(wrapped) is gpt and torch_impl.is_output_processor_enabled(
        wrapped
    )
    got = _run(wrapped, batch, processor)
    _assert_equal(got, want)
    _assert_equal(_gpt_grads(gpt), _gpt_grads(reference))
    assert wrapped.vision_projection.weight.grad is None  # the wrapper's own module is untouched
    torch_impl.disable_output_processor(wrapped)
    assert type(gpt) is type(build_tiny_gpt())


def test_float16module_around_the_wrapper() -> None:
    from megatron.core.transformer.module import Float16Module

    batch = tiny_batch()
    processor = selected_logprobs(entropy=True)
    reference = torch_impl.enable_output_processor(build_tiny_gpt(bf16=True).bfloat16())
    want = _run(reference, batch, processor)
    gpt = build_tiny_gpt(bf16=True)
    wrapped = Float16Module(gpt.config, TinyMultimodal(gpt))
    torch_impl.enable_output_processor(wrapped)
    assert torch_impl.unwrap_model(wrapped) is gpt
    got = _run(wrapped, batch, processor)
    assert got["logprobs"].dtype == torch.float32
    _assert_equal(got, want)
    _assert_equal(_gpt_grads(gpt), _gpt_grads(reference))


def test_megatron_ddp_around_float16module_around_the_wrapper() -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from torch_impl.testing.schedules import cpu_schedule

    batch = tiny_batch()
    processor = selected_logprobs(entropy=True)
    reference = torch_impl.enable_output_processor(build_tiny_gpt(bf16=True).bfloat16())
    want = _run(reference, batch, processor)
    gpt = build_tiny_gpt(bf16=True)
    with cpu_schedule():  # the grad buffers are allocated on torch.cuda.current_device()
        ddp = DistributedDataParallel(
            gpt.config,
            DistributedDataParallelConfig(),
            Float16Module(gpt.config, TinyMultimodal(gpt)),
        )
    assert torch_impl.enable_output_processor(ddp) is ddp
    assert torch_impl.unwrap_model(ddp) is gpt
    ddp.zero_grad_buffer()
    got = _run(ddp, batch, processor)
    _assert_equal(got, want)
    # Megatron's DDP accumulates each gradient into the parameter's main_grad.
    _assert_equal(_gpt_grads(gpt, main_grad=True), _gpt_grads(reference))


def test_a_model_without_a_language_model_names_what_was_looked_for() -> None:
    class Empty(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vision = torch.nn.Linear(2, 2)

    outer = torch.nn.Sequential()
    outer.module = Empty()  # type: ignore[assignment]
    with pytest.raises(ContractError) as err:
        torch_impl.enable_output_processor(outer)
    assert err.value.field == "model"
    assert ".language_model" in str(err.value.expected) and ".module" in str(err.value.expected)
    assert str(err.value.actual) == "Sequential -> .module: Empty (no language model found)"


def test_wrapped_hybrid_model() -> None:
    """A HybridModel at ``.language_model`` (megatron-core 0.19), under Float16Module."""
    pytest.importorskip(
        "megatron.core.models.hybrid",
        reason="HybridModel arrives with Megatron Core 0.19 (this one is older)",
    )
    from megatron.core.transformer.module import Float16Module

    from torch_impl.testing.tiny_hybrid import build_tiny_hybrid

    batch = tiny_batch()
    processor = selected_logprobs(entropy=True)
    reference = torch_impl.enable_output_processor(build_tiny_hybrid("*-*-", bf16=True).bfloat16())
    want = _run(reference, batch, processor)
    hybrid = build_tiny_hybrid("*-*-", bf16=True)
    wrapped = Float16Module(hybrid.config, TinyMultimodal(hybrid))
    torch_impl.enable_output_processor(wrapped)
    assert torch_impl.unwrap_model(wrapped) is hybrid
    assert type(hybrid).__name__ == "OutputHookHybridModel"
    _assert_equal(_run(wrapped, batch, processor), want)
    _assert_equal(_gpt_grads(hybrid), _gpt_grads(reference))

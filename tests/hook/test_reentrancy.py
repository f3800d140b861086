"""Reentrancy: the adapter holds no state across calls that another call could see.

Two enabled models in one process, a processor that itself runs another enabled model
(teacher logprobs inside a student's processor), and an exception inside a processor:
afterwards every model's next forward, with and without a processor, is bitwise what
it was before.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hookspec
import torch_impl
from torch_impl.processors import selected_logprobs
from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch

pytestmark = pytest.mark.usefixtures("megatron_single")


def _args(batch: dict[str, Any]) -> tuple[Any, ...]:
    return batch["input_ids"], batch["position_ids"], None


def _outputs(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The stock loss, and the logprobs through the hook."""
    with torch.no_grad():
        loss = model(*_args(batch), labels=batch["labels"])
        lp = model(*_args(batch), labels=batch["labels"], output_processor=selected_logprobs())[
            "logprobs"
        ]
    return loss, lp


def _models() -> tuple[torch.nn.Module, torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    a = torch_impl.enable_output_processor(build_tiny_gpt())
    torch.manual_seed(1)
    b = torch_impl.enable_output_processor(build_tiny_gpt(share_embeddings_and_output_weights=True))
    return a, b, tiny_batch(2, 8, 64, seed=3)


def _equal(x: tuple[torch.Tensor, torch.Tensor], y: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_two_enabled_models_do_not_see_each_other() -> None:
    a, b, batch = _models()
    before_a, before_b = _outputs(a, batch), _outputs(b, batch)
    assert not torch.equal(before_a[1], before_b[1])  # different weights: a mix-up would show
    for _ in range(2):  # interleaved
        _equal(_outputs(a, batch), before_a)
        _equal(_outputs(b, batch), before_b)


def test_processor_running_another_enabled_model() -> None:
    student, teacher, batch = _models()
    before_s, before_t = _outputs(student, batch), _outputs(teacher, batch)
    seen: dict[str, torch.Tensor] = {}

    @hookspec.processor
    def distill(ctx: hookspec.OutputContext) -> dict[str, torch.Tensor]:
        with torch.no_grad():  # the teacher's forward runs inside the student's hook
            t_lp = teacher(
                *_args(batch), labels=batch["labels"], output_processor=selected_logprobs()
            )["logprobs"]
        s_lp = selected_logprobs()(ctx)["logprobs"]
        seen["teacher"] = t_lp
        return {"logprobs": s_lp, "kl": s_lp - t_lp}

    with torch.no_grad():
        out = student(*_args(batch), labels=batch["labels"], output_processor=distill)
    assert torch.equal(seen["teacher"], before_t[1])
    assert torch.equal(out["logprobs"], before_s[1])
    assert torch.equal(out["kl"], before_s[1] - before_t[1])
    _equal(_outputs(student, batch), before_s)
    _equal(_outputs(teacher, batch), before_t)


def test_exception_inside_a_processor_leaves_no_trace() -> None:
    a, b, batch = _models()
    before_a, before_b = _outputs(a, batch), _outputs(b, batch)

    class Boom(RuntimeError):
        pass

    @hookspec.processor
    def fails(ctx: hookspec.OutputContext) -> torch.Tensor:
        raise Boom("inside the processor")

    for _ in range(2):
        with pytest.raises(Boom):
            a(*_args(batch), labels=batch["labels"], output_processor=fails)
    _equal(_outputs(a, batch), before_a)
    _equal(_outputs(b, batch), before_b)
    # and a training step after the failure has the stock gradients
    ref = build_tiny_gpt()
    ref.load_state_dict(a.state_dict())
    ref(*_args(batch), labels=batch["labels"]).sum().backward()
    a(*_args(batch), labels=batch["labels"]).sum().backward()
    for (name, p), q in zip(a.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name

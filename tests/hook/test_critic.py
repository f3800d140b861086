"""The PPO critic pattern (``torch_impl.testing.examples.critic``): per-token values
from a value head of the user's own, taken from the hidden states the hook hands
over, and PPO's clipped value loss.

Independent computation, in float64: the decoder's hidden states (the model run as a
non-final stage), the head and the loss written out; the gradient of that loss with
respect to the hidden states is back-propagated through a second copy of the model
(Megatron's own backward), which gives every model parameter's gradient. At tp=2
(gloo, two processes) the same on each rank: the values and the loss are the same
on both, the head's gradient is whole on both, and the decoder receives the
hidden-state gradient once (not once per rank).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torch_impl
from hookspec import ContractError
from tests.support.distributed import run_distributed
from torch_impl._postprocess import as_inner_stage
from torch_impl.testing.examples.critic import ValueBatch, value_head_processor
from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch

CLIP = 0.2


def _head(hidden: int = 32) -> torch.nn.Linear:
    torch.manual_seed(11)
    return torch.nn.Linear(hidden, 1)


def _value_batch(seed: int = 3) -> ValueBatch:
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(2, 8, generator=g) * 0.5
    returns = old + torch.randn(2, 8, generator=g)  # far enough from old that some tokens clip
    mask = torch.ones(2, 8)
    mask[0, 6:] = 0.0
    mask[1, 0] = 0.0
    return ValueBatch(returns=returns, old_values=old, mask=mask)


def _float64_reference(
    hidden: torch.Tensor, head: torch.nn.Linear, batch: ValueBatch
) -> dict[str, torch.Tensor]:
    """Values, loss and clip fraction in float64, and the gradients of the loss with
    respect to the hidden states ``[s, b, h]`` and the head's parameters."""
    h = hidden.detach().double().requires_grad_(True)
    w = head.weight.detach().double().requires_grad_(True)
    bias = head.bias.detach().double().requires_grad_(True)
    values = (h @ w.T + bias)[..., 0].T  # [b, s]
    r, old, m = batch.returns.double(), batch.old_values.double(), batch.mask.double()
    delta = values - old
    v_clip = torch.where(delta.abs() > CLIP, old + torch.clamp(delta, -CLIP, CLIP), values)
    a, c = (values - r) ** 2, (v_clip - r) ** 2
    loss = 0.5 * (m * torch.maximum(a, c)).sum() / m.sum()
    fraction = (m * (c > a)).sum() / m.sum()
    loss.backward()
    return {
        "values": values.detach(),
        "loss": loss.detach(),
        "clip_fraction": fraction,
        "dh": h.grad,
        "head.weight": w.grad,
        "head.bias": bias.grad,
    }


def _decoder_output(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The hidden states the hook receives: the model run as a non-final stage."""
    with as_inner_stage(model):
        return model(batch["input_ids"], batch["position_ids"], None)


def _check_critic(tp: int) -> None:
    """Body of the tp=1 and tp=2 tests (each rank runs it)."""
    batch, values_batch = tiny_batch(), _value_batch()
    head = _head()
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    out = model(
        batch["input_ids"],
        batch["position_ids"],
        None,
        output_processor=value_head_processor(head, clip_range=CLIP),
        output_processor_context=values_batch,
    )
    out["loss"].backward()

    reference = build_tiny_gpt()  # the same weights (same seed), Megatron's backward for the model
    hidden = _decoder_output(reference, batch)
    want = _float64_reference(hidden, head, values_batch)
    hidden.backward(want["dh"].float())

    torch.testing.assert_close(out["values"].double(), want["values"], rtol=0, atol=1e-5)
    torch.testing.assert_close(out["loss"].double(), want["loss"], rtol=1e-5, atol=0)
    assert float(out["clip_fraction"]) == pytest.approx(
        float(want["clip_fraction"]), abs=1e-6
    )  # a token is 1/13
    assert 0.0 < float(want["clip_fraction"]) < 1.0  # the clip is active for some tokens, not all
    for name, param in head.named_parameters():
        g = want[f"head.{name}"]
        torch.testing.assert_close(
            param.grad.double(), g, rtol=1e-5, atol=1e-6 * float(g.abs().max())
        )
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ref = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert got.keys() == ref.keys() and "decoder.layers.0.self_attention.linear_qkv.weight" in got
    assert "output_layer.weight" not in got  # the output layer is not used
    for name, g in ref.items():
        torch.testing.assert_close(
            got[name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()), msg=name
        )
    assert tp == model.config.tensor_model_parallel_size


@pytest.mark.usefixtures("megatron_single")
def test_critic_values_loss_and_gradients_at_tp1() -> None:
    _check_critic(tp=1)


def _tp2_rank(rank: int) -> None:
    _check_critic(tp=2)


def test_critic_values_loss_and_gradients_at_tp2() -> None:
    run_distributed(_tp2_rank, tp=2)


@pytest.mark.usefixtures("megatron_single")
def test_values_only_without_a_context_and_the_loss_mask_as_default() -> None:
    batch = tiny_batch()
    head = _head()
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    proc = value_head_processor(head, clip_range=None)
    out = model(batch["input_ids"], batch["position_ids"], None, output_processor=proc)
    assert set(out) == {"values"} and tuple(out["values"].shape) == (2, 8)
    want = head(_decoder_output(build_tiny_gpt(), batch))[..., 0].T
    torch.testing.assert_close(out["values"], want, rtol=1e-6, atol=1e-6)
    # the model's loss_mask stands in for ValueBatch.mask; an empty mask gives loss 0
    vb = _value_batch()
    empty = ValueBatch(returns=vb.returns, old_values=vb.old_values)
    out = model(
        batch["input_ids"],
        batch["position_ids"],
        None,
        loss_mask=torch.zeros(2, 8),
        output_processor=proc,
        output_processor_context=empty,
    )
    assert float(out["loss"].detach()) == 0.0 and float(out["clip_fraction"]) == 0.0


@pytest.mark.usefixtures("megatron_single")
@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_megatron_column_parallel_head_at_tp1(skip_bias_add: bool) -> None:
    """A ``ColumnParallelLinear(h, 1)`` owned by the user returns ``(output, bias)``;
    the values and its gradients equal a ``torch.nn.Linear`` with the same weights."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    batch, vb = tiny_batch(), _value_batch()
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    linear = _head()
    column = ColumnParallelLinear(
        32,
        1,
        config=model.config,
        init_method=torch.nn.init.zeros_,
        bias=True,
        gather_output=False,
        skip_bias_add=skip_bias_add,
    )
    with torch.no_grad():
        column.weight.copy_(linear.weight)
        column.bias.copy_(linear.bias)
    outs = []
    for head in (linear, column):
        out = model(
            batch["input_ids"],
            batch["position_ids"],
            None,
            output_processor=value_head_processor(head),
            output_processor_context=vb,
        )
        out["loss"].backward()
        outs.append(out)
    assert torch.equal(outs[0]["values"], outs[1]["values"])
    assert torch.equal(column.weight.grad, linear.weight.grad)
    assert torch.equal(column.bias.grad, linear.bias.grad)


@pytest.mark.usefixtures("megatron_single")
def test_split_batch_losses_sum_to_the_loss_with_global_tokens() -> None:
    """A batch split in two (as over context-parallel ranks or micro-batches): with
    ``global_tokens`` = the whole batch's token count, the halves' losses sum to the
    whole batch's loss."""
    batch, vb = tiny_batch(), _value_batch()
    head = _head()
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    proc = value_head_processor(head, clip_range=CLIP)

    def loss(rows: slice, global_tokens: float | None) -> torch.Tensor:
        part = ValueBatch(
            vb.returns[rows], vb.old_values[rows], vb.mask[rows], global_tokens=global_tokens
        )
        out = model(
            batch["input_ids"][rows],
            batch["position_ids"][rows],
            None,
            output_processor=proc,
            output_processor_context=part,
        )
        return out["loss"].detach()

    whole = loss(slice(0, 2), None)
    total = float(vb.mask.sum())
    halves = loss(slice(0, 1), total) + loss(slice(1, 2), total)
    torch.testing.assert_close(halves, whole, rtol=1e-6, atol=0)
    assert not torch.allclose(loss(slice(0, 1), None) + loss(slice(1, 2), None), whole)


@pytest.mark.usefixtures("megatron_single")
@pytest.mark.parametrize(
    ("context", "field"),
    [
        (ValueBatch(returns=torch.zeros(2, 7), old_values=torch.zeros(2, 8)), "context.returns"),
        (
            ValueBatch(returns=torch.zeros(2, 8), old_values=[0.0]),  # type: ignore[arg-type]
            "context.old_values",
        ),
        (
            ValueBatch(returns=torch.zeros(2, 8), old_values=torch.zeros(2, 8), global_tokens=0),
            "context.global_tokens",
        ),
        ({"returns": torch.zeros(2, 8)}, "context"),
    ],
)
def test_bad_context(context: Any, field: str) -> None:
    batch = tiny_batch()
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    with pytest.raises(ContractError) as err:
        model(
            batch["input_ids"],
            batch["position_ids"],
            None,
            output_processor=value_head_processor(_head()),
            output_processor_context=context,
        )
    assert err.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"clip_range": 0}, "clip_range"), ({"clip_range": float("nan")}, "clip_range")],
)
def test_bad_options_are_refused_when_made(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ContractError) as err:
        value_head_processor(_head(), **kwargs)
    assert err.value.field == field
    with pytest.raises(ContractError, match=r"^head: expected a callable"):
        value_head_processor(3)

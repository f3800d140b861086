"""The whole combined-1F1B plan on a CPU: Megatron's plan, the adapted plan and ``forward``.

The plan's own nodes run in schedule order, pre-process, each layer's nodes,
post-process, then the loss node and the backward in reverse, the way
``TransformerModelChunkSchedulePlan.run`` runs them, without streams
(``tests/support/plan_driver.py``). "Stock plan": ``GPTModel.build_schedule_plan`` on a
model that was never enabled. "Adapted plan": ``torch_impl.build_schedule_plan``.

Where the chunk's last decoder layer is dense, Megatron's plan never applies the
decoder's final norm (its MoE combine step does, for a MoE last layer); the
adapted plan adds it (``apply_final_norm=True``, the default) and then equals
``forward`` bitwise; with ``apply_final_norm=False`` it equals the stock plan
bitwise. Every comparison is ``torch.equal``: values and every parameter gradient.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import hookspec
from hookspec import ContractError, OutputContext
from tests.support.hook_cases import stock_loss
from tests.support.plan_driver import cpu_stand_ins, run_plan
from torch_impl import enable_output_processor
from torch_impl._compat import installed_megatron
from torch_impl._plan_final_norm import add_missing_final_norm, missing_final_norm
from torch_impl.mtp import default_mtp_loss
from torch_impl.schedule_plan import build_schedule_plan, plan_loss_func
from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch
from torch_impl.testing.tiny_moe import build_tiny_moe_gpt

pytestmark = pytest.mark.usefixtures("megatron_single", "stand_ins")


@pytest.fixture
def stand_ins() -> Iterator[None]:
    with cpu_stand_ins():
        yield


# name -> (builder, Megatron's plan applies the final norm)
MODELS: dict[str, tuple[Callable[[], Any], bool]] = {
    "dense": (lambda: build_tiny_gpt(), False),
    "moe-then-dense": (lambda: build_tiny_moe_gpt([1, 0]), False),
    "dense-then-moe": (lambda: build_tiny_moe_gpt([0, 1]), True),
}
MTP_MODELS: dict[str, tuple[Callable[[], Any], bool]] = {
    "mtp-dense-last": (lambda: build_tiny_moe_gpt([1, 0], mtp_num_layers=1).eval(), False),
    "mtp-moe-last": (lambda: build_tiny_moe_gpt([0, 1], mtp_num_layers=1).eval(), True),
}
# Megatron's plan normalises after a dense last layer too (the patch series of upstream/)
NATIVE_NORM = installed_megatron().plan_final_norm_after_dense


@hookspec.processor
def logprobs_and_entropy(ctx: OutputContext) -> Any:
    """A mapping result: selected-token logprobs and a loss (grad), entropy (no grad)."""
    logits = torch.einsum("sbh,vh->bsv", ctx.hidden_states, ctx.vocab_weight).float()
    logp = torch.log_softmax(logits, -1)
    chosen = logp.gather(-1, ctx.labels.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return {"logprobs": chosen, "entropy": entropy, "loss": -chosen.mean()}


PROCESSORS = {"default-loss": None, "tensor": stock_loss, "mapping": logprobs_and_entropy}


def _loss(output: Any) -> torch.Tensor:
    return output["loss"] + output["logprobs"].sum() if isinstance(output, dict) else output.sum()


def _inputs(batch: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (batch["input_ids"], batch["position_ids"], None), {
        "labels": batch["labels"],
        "loss_mask": batch["loss_mask"],
    }


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _forward(model: Any, **processors: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    args, kw = _inputs(tiny_batch())
    if any(v is not None for v in processors.values()):
        model = enable_output_processor(model)
        kw.update(processors)
    out = model(*args, **kw)
    _loss(out).backward()
    return out, _grads(model)


def _stock_plan(model: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    args, kw = _inputs(tiny_batch())
    out, _ = run_plan(model.build_schedule_plan(*args, **kw), _loss)
    return out, _grads(model)


def _adapted_plan(model: Any, **options: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    args, kw = _inputs(tiny_batch())
    model = enable_output_processor(model)
    plan = build_schedule_plan(model, *args, **kw, **options)
    received: list[Any] = []

    def loss_func(output: Any) -> torch.Tensor:
        received.append(output)
        return _loss(output)

    run_plan(plan, plan_loss_func(plan, loss_func))
    (out,) = received
    return out, _grads(model)


def _assert_equal(
    got: tuple[Any, dict[str, torch.Tensor]], want: tuple[Any, dict[str, torch.Tensor]]
) -> None:
    (out, grads), (want_out, want_grads) = got, want
    if isinstance(want_out, dict):
        assert list(out) == list(want_out)
        for key in want_out:
            assert torch.equal(out[key], want_out[key]), key
    else:
        assert torch.equal(out, want_out)
    assert grads.keys() == want_grads.keys()
    for name in want_grads:
        assert torch.equal(grads[name], want_grads[name]), name


def _processors(name: str, mtp: bool) -> dict[str, Any]:
    processors: dict[str, Any] = {"output_processor": PROCESSORS[name]}
    if mtp:
        processors["mtp_processor"] = default_mtp_loss
    return processors


@pytest.mark.parametrize("name", list(MODELS) + list(MTP_MODELS))
def test_stock_plan_differs_from_forward_where_the_last_layer_is_dense(name: str) -> None:
    build, megatron_norms = {**MODELS, **MTP_MODELS}[name]
    want = _forward(build())
    got = _stock_plan(build())
    if megatron_norms or NATIVE_NORM:
        _assert_equal(got, want)
        return
    assert not torch.equal(got[0], want[0])
    assert (got[0] - want[0]).abs().max() > 1e-2  # every token, not rounding
    # the cause, and nothing else: forward without the decoder's final norm is the stock plan
    unnormed = build()
    unnormed.decoder.final_layernorm = None
    _assert_equal(got, _forward(unnormed))


@pytest.mark.parametrize("processor", list(PROCESSORS))
@pytest.mark.parametrize("name", list(MODELS) + list(MTP_MODELS))
def test_adapted_plan_equals_forward(name: str, processor: str) -> None:
    build, _ = {**MODELS, **MTP_MODELS}[name]
    processors = _processors(processor, name in MTP_MODELS)
    _assert_equal(_adapted_plan(build(), **processors), _forward(build(), **processors))


@pytest.mark.parametrize("processor", ["default-loss", "tensor"])
@pytest.mark.parametrize("name", list(MODELS) + list(MTP_MODELS))
def test_option_off_keeps_megatrons_plan_bitwise(name: str, processor: str) -> None:
    """``stock_loss`` is Megatron's own loss through the hook, so with the option
    off the adapted plan is Megatron's plan to the bit, processors or not."""
    build, _ = {**MODELS, **MTP_MODELS}[name]
    processors = _processors(processor, name in MTP_MODELS)
    _assert_equal(
        _adapted_plan(build(), apply_final_norm=False, **processors), _stock_plan(build())
    )


def test_where_megatrons_plan_applies_the_final_norm() -> None:
    """The decision, from the layers: the norm is missing exactly where neither the
    last layer's MoE combine step nor the post-process node (empty decoder, no MTP)
    applies it."""
    dense, moe_last = build_tiny_gpt(), build_tiny_moe_gpt([0, 1])
    norm = dense.decoder.final_layernorm
    assert missing_final_norm(dense) is (None if NATIVE_NORM else norm)
    assert (missing_final_norm(build_tiny_moe_gpt([1, 0])) is None) is NATIVE_NORM
    assert missing_final_norm(moe_last) is None

    def chunk(layers: list[Any], mtp: int = 0, post_process: bool = True, final: Any = norm) -> Any:
        return types.SimpleNamespace(
            post_process=post_process,
            decoder=types.SimpleNamespace(final_layernorm=final, layers=layers),
            mtp=types.SimpleNamespace(layers=[None] * mtp) if mtp else None,
        )

    assert missing_final_norm(chunk(list(dense.decoder.layers), post_process=False)) is None
    assert missing_final_norm(chunk(list(dense.decoder.layers), final=None)) is None
    assert missing_final_norm(chunk([])) is None  # Megatron's post-process node normalises
    assert missing_final_norm(chunk([], mtp=1)) is norm
    with pytest.raises(ContractError, match="MTP layers after an empty decoder") as err:
        add_missing_final_norm(types.SimpleNamespace(), chunk([], mtp=1))
    assert "apply_final_norm=False" in err.value.hint


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_the_option_is_validated_before_the_plan_is_built(value: Any) -> None:
    model = enable_output_processor(build_tiny_gpt())
    args, kw = _inputs(tiny_batch())
    with pytest.raises(ContractError) as err:
        build_schedule_plan(model, *args, **kw, apply_final_norm=value)
    assert err.value.field == "apply_final_norm"
    assert repr(value) in str(err.value.actual)

"""The output hook on HybridModel (Megatron Core 0.19+), which has none upstream.

On a CPU with ``torch_impl.testing.tiny_hybrid``: attention (``*``) and MLP (``-``)
layers of local modules, no final norm, an MTP depth after ``/``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip(
    "megatron.core.models.hybrid",
    reason="HybridModel arrives with Megatron Core 0.19 (this one is older)",
)

import hookspec
from hookspec import ContractError, OutputContext
from tests.support.hook_cases import grads, stock_loss, stock_loss_upstream
from torch_impl import enable_output_processor, is_output_processor_enabled
from torch_impl.mtp import default_mtp_loss
from torch_impl.schedule_plan import build_schedule_plan
from torch_impl.testing.tiny import tiny_batch
from torch_impl.testing.tiny_hybrid import build_tiny_hybrid

pytestmark = pytest.mark.usefixtures("megatron_single")

PATTERNS = ["*-*-", "*-*-/*-"]


def run(model: Any, batch: dict[str, Any], **kw: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(batch["input_ids"], batch["position_ids"], None, **kw)
    out.float().sum().backward()
    return out, grads(model)


def assert_bitwise(
    got: tuple[Any, dict[str, torch.Tensor]], want: tuple[Any, dict[str, torch.Tensor]]
) -> None:
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name


@pytest.mark.release_matrix
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("with_labels", [True, False], ids=["loss", "logits"])
def test_without_processor_outputs_and_grads_are_bitwise_stock(
    pattern: str, with_labels: bool
) -> None:
    batch = tiny_batch()
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]} if with_labels else {}
    want = run(build_tiny_hybrid(pattern).eval(), batch, **kw)
    model = enable_output_processor(build_tiny_hybrid(pattern)).eval()
    assert is_output_processor_enabled(model) and type(model).__name__ == "OutputHookHybridModel"
    assert_bitwise(run(model, batch, **kw), want)


@pytest.mark.release_matrix
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    "processor", [stock_loss, stock_loss_upstream], ids=["hookspec", "upstream"]
)
def test_processor_through_output_layer_is_bitwise_stock(
    pattern: str, tied: bool, processor: Any
) -> None:
    batch = tiny_batch()
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
    want = run(
        build_tiny_hybrid(pattern, share_embeddings_and_output_weights=tied).eval(), batch, **kw
    )
    model = enable_output_processor(
        build_tiny_hybrid(pattern, share_embeddings_and_output_weights=tied)
    ).eval()
    assert_bitwise(run(model, batch, **kw, output_processor=processor), want)
    if "/" in pattern:
        assert_bitwise(run(model, batch, **kw, mtp_processor=default_mtp_loss), want)


def test_contexts_of_the_main_head_and_the_mtp_depth() -> None:
    seen: list[OutputContext] = []

    @hookspec.processor
    def record(ctx: OutputContext) -> Any:
        seen.append(ctx)
        return (
            default_mtp_loss(ctx)["loss"]
            if ctx.mtp_depth
            else ctx.hidden_states.sum(-1).transpose(0, 1)
        )

    model = enable_output_processor(build_tiny_hybrid("*-*-/*-")).eval()
    batch = tiny_batch()
    out = model(
        batch["input_ids"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        output_processor=record,
        mtp_processor=record,
        output_processor_context="ctx",
    )
    assert tuple(out.shape) == (2, 8)
    assert [c.mtp_depth for c in seen] == [1, 0]
    for ctx in seen:
        assert tuple(ctx.hidden_states.shape) == (8, 2, 32)
        assert ctx.vocab_weight is model.output_layer.weight
        assert ctx.context == "ctx" and ctx.config is model.config
    assert torch.equal(seen[1].labels, batch["labels"])
    assert torch.equal(seen[0].labels[:, :-1], batch["labels"][:, 1:])


def test_rl_values_from_the_main_head_with_mtp_training() -> None:
    """labels=None: the hook returns a mapping; MTP trains on labels from input_ids,
    the same gradients as the stock model given those labels."""
    batch = tiny_batch()
    ids = batch["input_ids"]
    derived = torch.zeros_like(ids)
    derived[:, :-1] = ids[:, 1:]
    mask = torch.ones(ids.shape)
    mask[:, -1] = 0.0
    stock = build_tiny_hybrid("*-*-/*-").eval()
    (stock(ids, batch["position_ids"], None, labels=derived, loss_mask=mask) * 0.0).sum().backward()

    @hookspec.processor
    def values(ctx: OutputContext) -> Any:
        return {"h2": ctx.hidden_states.pow(2).sum(-1).transpose(0, 1)}

    model = enable_output_processor(build_tiny_hybrid("*-*-/*-")).eval()
    out = model(ids, batch["position_ids"], None, output_processor=values)
    (out["h2"] * 0.0).sum().backward()
    want, got = grads(stock), grads(model)
    assert got.keys() == want.keys() and any(g.abs().sum() > 0 for g in want.values())
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_bad_results_and_no_schedule_plan() -> None:
    model = enable_output_processor(build_tiny_hybrid("*-")).eval()
    batch = tiny_batch()
    with pytest.raises(ContractError, match=r"expected shape \[b=2, s=8\]"):
        model(
            batch["input_ids"],
            batch["position_ids"],
            None,
            labels=batch["labels"],
            output_processor=hookspec.processor(lambda ctx: torch.zeros(8, 2), name="transposed"),
        )
    with pytest.raises(ContractError) as err:
        model(batch["input_ids"], batch["position_ids"], None, mtp_processor=default_mtp_loss)
    assert err.value.field == "mtp_processor"
    with pytest.raises(ContractError, match="no schedule plan"):
        build_schedule_plan(
            model, batch["input_ids"], batch["position_ids"], None, output_processor=stock_loss
        )


def test_detach_encoder_on_a_hybrid_model() -> None:
    """``MTPOptions(detach_encoder=True)`` on a HybridModel's MTP layer: the MTP loss
    trains the MTP layer (its gradients the stock model's, bitwise) and the output
    head, not the embedding or the main stack (those equal the stock model's with
    ``mtp_loss_scaling_factor=0``)."""
    from torch_impl.mtp import MTPOptions

    batch = tiny_batch()
    kw = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
    want, stock = run(build_tiny_hybrid("*-*-/*-").eval(), batch, **kw)
    _, no_mtp = run(build_tiny_hybrid("*-*-/*-", mtp_loss_scaling_factor=0.0).eval(), batch, **kw)
    model = enable_output_processor(
        build_tiny_hybrid("*-*-/*-"), mtp=MTPOptions(detach_encoder=True)
    ).eval()
    for processors in ({}, {"output_processor": stock_loss}):
        got, got_grads = run(model, batch, **kw, **processors)
        assert torch.equal(got, want)
        assert got_grads.keys() == stock.keys()
        for name, grad in got_grads.items():
            expected = (
                stock[name]
                if name.startswith("mtp.") or name == "output_layer.weight"
                else no_mtp[name]
            )
            assert torch.equal(grad, expected), name
    assert not torch.equal(
        stock["embedding.word_embeddings.weight"], no_mtp["embedding.word_embeddings.weight"]
    )

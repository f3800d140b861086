"""The processors through ``enable_output_processor`` on the tiny Megatron GPT (one
process), against the stock model's own logits and loss: native hook on 0.19,
the adapter's ``_postprocess`` path on 0.16."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import torch_impl
from hookspec import ContractError
from torch_impl.processors import (
    PolicyBatch,
    PolicyLossConfig,
    cross_entropy_loss,
    policy_loss,
    selected_logprobs,
)
from torch_impl.testing.tiny import build_tiny_gpt, tiny_batch

pytestmark = pytest.mark.usefixtures("megatron_single")


def _args(batch: dict[str, Any]) -> tuple[Any, ...]:
    return batch["input_ids"], batch["position_ids"], None


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_cross_entropy_equals_megatron_loss_and_gradients(tied: bool) -> None:
    model = build_tiny_gpt(share_embeddings_and_output_weights=tied)
    batch = tiny_batch(3, 8, 64, seed=1)
    batch["labels"][1, 3] = -100
    cot = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    cot[1, 3] = 0.0  # Megatron's loss at an ignored label is the logsumexp; ours is 0
    stock = model(*_args(batch), labels=batch["labels"])
    (stock * cot).sum().backward()
    expected = _grads(model)
    torch_impl.enable_output_processor(model)
    ours = model(
        *_args(batch), labels=batch["labels"], output_processor=cross_entropy_loss(tile_cols=24)
    )
    (ours * cot).sum().backward()
    got = _grads(model)
    keep = batch["labels"] != -100
    torch.testing.assert_close(ours[keep], stock[keep], rtol=1e-6, atol=1e-6)
    assert float(ours[1, 3].detach()) == 0.0
    assert set(got) == set(expected)  # the tied embedding gets a gradient: never passed as None
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_selected_logprobs_equal_stock_logits_with_context_temperature() -> None:
    model = build_tiny_gpt()
    batch = tiny_batch(2, 8, 64, seed=2)
    logits = model(*_args(batch)).double()  # [b, s, V], no labels
    torch_impl.enable_output_processor(model)

    @dataclasses.dataclass(frozen=True)
    class Sampling:
        temperature: torch.Tensor

    t = torch.rand(2, 8) + 0.5
    out = model(
        *_args(batch),
        labels=batch["labels"],
        output_processor=selected_logprobs(entropy=True, tile_cols=10),
        output_processor_context=Sampling(t),
    )
    logp = (logits / t[..., None].double()).log_softmax(-1)
    expected = logp.gather(2, batch["labels"][..., None]).squeeze(-1)
    torch.testing.assert_close(out["logprobs"].double(), expected, rtol=0, atol=2e-6)
    torch.testing.assert_close(
        out["entropy"].double(), -(logp.exp() * logp).sum(-1), rtol=0, atol=2e-6
    )
    with pytest.raises(ContractError, match=r"^temperature: expected one source"):
        model(
            *_args(batch),
            labels=batch["labels"],
            output_processor=selected_logprobs(temperature=0.5),
            output_processor_context=Sampling(t),
        )


def test_mup_output_multiplier_is_applied() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "use_mup" not in {f.name for f in dataclasses.fields(TransformerConfig)}:
        pytest.skip("this megatron-core has no MuP")
    model = build_tiny_gpt(use_mup=True, mup_output_mult=0.37)
    batch = tiny_batch(2, 8, 64, seed=3)
    stock = model(*_args(batch), labels=batch["labels"])
    torch_impl.enable_output_processor(model)
    ours = model(*_args(batch), labels=batch["labels"], output_processor=cross_entropy_loss())
    torch.testing.assert_close(ours, stock, rtol=1e-6, atol=1e-6)


def test_policy_loss_through_the_model_fused_equals_autograd() -> None:
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    batch = tiny_batch(2, 8, 64, seed=4)
    with torch.no_grad():
        lp = model(*_args(batch), labels=batch["labels"], output_processor=selected_logprobs())[
            "logprobs"
        ]
    g = torch.Generator().manual_seed(5)
    pb = PolicyBatch(
        old_logprobs=lp + 0.2 * torch.randn(2, 8, generator=g),
        advantages=torch.randn(2, 8, generator=g),
        ref_logprobs=lp + 0.1 * torch.randn(2, 8, generator=g),
        mask=(torch.rand(2, 8, generator=g) > 0.3).float(),
    )
    results = []
    for fused in (True, False):
        cfg = PolicyLossConfig.grpo(entropy_coef=0.01, dual_clip=3.0, fused=fused)
        out = model(
            *_args(batch),
            labels=batch["labels"],
            output_processor=policy_loss(cfg),
            output_processor_context=pb,
        )
        out["loss"].backward()
        results.append((out, _grads(model)))
    (fused_out, fused_grads), (ref_out, ref_grads) = results
    for key in ref_out:
        torch.testing.assert_close(fused_out[key], ref_out[key], rtol=1e-6, atol=1e-7, msg=key)
    for name in ref_grads:
        torch.testing.assert_close(
            fused_grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name
        )
    assert float(ref_grads["output_layer.weight"].abs().max()) > 0

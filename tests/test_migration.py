"""The replacements of docs/migration.md, one test per entry.

Each test runs the lines the entry documents, on a tiny GPT, and checks the values
(and gradients where the patch computes them) against the stock Megatron model's
materialised logits, or against Megatron's own MTP loss.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

import torch_impl
from tests.test_schedule_plan import decoder_output, post_node
from torch_impl import detached_head
from torch_impl.processors import cross_entropy_loss, selected_logprobs
from torch_impl.testing.tiny import TinyGPTShape, build_tiny_gpt, cpu_layer_spec, tiny_batch, tiny_config

pytestmark = pytest.mark.usefixtures("megatron_single")

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> dict[str, Any]:
    """Selected-token logprobs and entropy from full logits ``[b, s, V]``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return {
        "logprobs": logp.gather(-1, labels[..., None])[..., 0],
        "entropy": -(logp.exp() * logp).sum(-1),
    }


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, grad in want.items():
        # Two fp32 paths (fused tiles and materialised logits) round differently: the
        # tolerance is relative to each gradient's own scale, so a small entry of a
        # bias gradient summed over tokens is held to the same relative error.
        atol = TOL["rtol"] * float(grad.abs().max())
        torch.testing.assert_close(
            got[name], grad, rtol=TOL["rtol"], atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_verl_model_forward_fused() -> None:
    """veRL ``model_forward_fused.py``: per-token logprobs and entropy at a
    temperature, from the hidden states, on every release."""
    batch = tiny_batch()
    input_ids, position_ids, attention_mask, labels = (
        batch["input_ids"],
        batch["position_ids"],
        batch["attention_mask"],
        batch["labels"],
    )
    temperature = 0.7
    model = build_tiny_gpt()

    # --- the documented replacement
    model = torch_impl.enable_output_processor(model)
    out = model(
        input_ids,
        position_ids,
        attention_mask,
        labels=labels,
        output_processor=selected_logprobs(temperature=temperature, entropy=True),
    )
    log_probs, entropy = out["logprobs"], out["entropy"]
    # ---

    stock = build_tiny_gpt()
    want = _reference(stock(input_ids, position_ids, attention_mask), labels, temperature)
    torch.testing.assert_close(log_probs, want["logprobs"], **TOL)
    torch.testing.assert_close(entropy, want["entropy"], **TOL)
    (log_probs.sum() + 0.5 * entropy.sum()).backward()
    (want["logprobs"].sum() + 0.5 * want["entropy"].sum()).backward()
    _assert_grads_close(_grads(model), _grads(stock))


def _mtp_gpt(**overrides: Any) -> Any:
    depths = 2
    config = tiny_config(TinyGPTShape(), mtp_num_layers=depths, **overrides)
    spec = get_gpt_mtp_block_spec(config, cpu_layer_spec(), use_transformer_engine=False)
    return build_tiny_gpt(mtp_block_spec=spec, mtp_num_layers=depths, **overrides).eval()


def test_verl_mtp_patch() -> None:
    """veRL ``mtp_patch.py``: the main head returns logprobs while the MTP layers
    train on Megatron's MTP loss through a detached output head.

    Independent computation: Megatron's stock model with its own MTP loss gives
    every gradient but the output layer's; the same model with
    ``mtp_loss_scaling_factor=0`` gives the output layer's gradient without the
    MTP part, which is what a detached head leaves."""
    batch = tiny_batch()
    input_ids, position_ids, attention_mask, labels = (
        batch["input_ids"],
        batch["position_ids"],
        batch["attention_mask"],
        batch["labels"],
    )
    loss_mask = torch.ones(labels.shape)
    cotangent = torch.randn(labels.shape, generator=torch.Generator().manual_seed(2))
    model = _mtp_gpt()

    # --- the documented replacement
    model = torch_impl.enable_output_processor(model)
    out = model(
        input_ids,
        position_ids,
        attention_mask,
        labels=labels,
        loss_mask=loss_mask,
        output_processor=selected_logprobs(entropy=True),  # main head: logprobs, entropy
        mtp_processor=detached_head(cross_entropy_loss()),  # MTP: trains the MTP layers only
    )
    # ---
    (out["logprobs"] * cotangent).sum().backward()

    stock, no_mtp_grad = _mtp_gpt(), _mtp_gpt(mtp_loss_scaling_factor=0.0)
    for reference in (stock, no_mtp_grad):
        nll = reference(input_ids, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        (-nll * cotangent).sum().backward()
    torch.testing.assert_close(out["logprobs"], -nll.detach(), **TOL)
    want = _grads(stock)
    want["output_layer.weight"] = no_mtp_grad.output_layer.weight.grad
    assert any(name.startswith("mtp.") for name in want)
    assert not torch.allclose(stock.output_layer.weight.grad, want["output_layer.weight"])
    _assert_grads_close(_grads(model), want)


def test_verl_model_forward_1f1b_overlap() -> None:
    """veRL ``model_forward_1f1b_overlap.py``: logprobs and entropy through the
    combined-1F1B plan, with tied embeddings. The mapping reaches the loss
    function whole, the values those of the stock model's logits."""
    model = build_tiny_gpt(share_embeddings_and_output_weights=True)
    batch = tiny_batch()
    received: list[dict[str, torch.Tensor]] = []

    def loss_func(batch: dict[str, Any], output: dict[str, torch.Tensor]) -> Any:
        received.append(output)
        loss = -(output["logprobs"] * batch["loss_mask"]).mean() - 0.01 * output["entropy"].mean()
        return loss, {"loss": loss.detach()}

    # --- the documented replacement (inside forward_step, when return_schedule_plan)
    model = torch_impl.enable_output_processor(model)
    proc = selected_logprobs(entropy=True)
    plan = post_node(
        model, batch, output_processor=proc
    )  # build_schedule_plan(model, ..., output_processor=proc)
    plan_loss = torch_impl.plan_loss_func(plan, partial(loss_func, batch))
    # ---

    packed = plan.post_process.forward_impl(decoder_output(model, batch))
    inputs = [t.detach().requires_grad_(True) for t in packed]
    loss, _ = plan_loss(*inputs)
    (output,) = received
    assert set(output) == {"logprobs", "entropy"}
    stock = build_tiny_gpt(share_embeddings_and_output_weights=True)
    want = _reference(stock(batch["input_ids"], batch["position_ids"], None), batch["labels"])
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(output[key], want[key], **TOL)
    loss.backward()
    plan.post_process.backward_func(packed, tuple(t.grad for t in inputs))
    tied = torch_impl.unwrap_model(model).shared_embedding_or_output_weight()
    assert tied.grad is not None and tied.grad.abs().sum() > 0  # the tied weight was used and trained


def test_nemo_rl_linear_ce_fusion() -> None:
    """NeMo RL ``patch_gpt_model_forward_for_linear_ce_fusion``: selected-token
    logprobs from the hidden states and the (tied) output weight, without a
    class-level patch: another GPTModel in the process stays stock."""
    forward_before = GPTModel.forward
    batch = tiny_batch()
    input_ids, position_ids, attention_mask, labels = (
        batch["input_ids"],
        batch["position_ids"],
        batch["attention_mask"],
        batch["labels"],
    )
    model = build_tiny_gpt(share_embeddings_and_output_weights=True)

    # --- the documented replacement
    model = torch_impl.enable_output_processor(model)
    logprobs = model(
        input_ids, position_ids, attention_mask, labels=labels, output_processor=selected_logprobs()
    )["logprobs"]
    # ---

    stock = build_tiny_gpt(share_embeddings_and_output_weights=True)
    assert GPTModel.forward is forward_before and type(stock).forward is forward_before
    want = _reference(stock(input_ids, position_ids, attention_mask), labels)["logprobs"]
    torch.testing.assert_close(logprobs, want, **TOL)
    logprobs.sum().backward()
    want.sum().backward()
    _assert_grads_close(_grads(model), _grads(stock))
    assert "embedding.word_embeddings.weight" in _grads(model)

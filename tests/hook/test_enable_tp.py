"""Tensor parallel 2 over gloo in two processes, against the same model at tp=1.

Megatron's CPU initialisation splits one master weight, so the tp=2 shards of a
model built with the same seed are exactly the rows of the tp=1 weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hookspec
import torch_impl
from hookspec import OutputContext
from tests.support import hook_cases as cases
from tests.support.distributed import run_distributed
from torch_impl.testing.tiny import build_tiny_gpt, megatron_parallel, tiny_batch


def _logprob_run(
    model: torch.nn.Module, batch: dict[str, Any], cotangent: torch.Tensor
) -> dict[str, Any]:
    """Run the vocab-parallel logprob processor, back-propagate ``cotangent`` and
    return values, the hidden-state gradient and selected parameter gradients."""
    kept: dict[str, Any] = {}

    def keep_hidden(ctx: OutputContext) -> dict[str, torch.Tensor]:
        ctx.hidden_states.retain_grad()
        kept["hidden"] = ctx.hidden_states
        kept["ctx"] = ctx
        return cases.vocab_parallel_logprobs_fn(ctx)

    model.zero_grad(set_to_none=True)
    out = model(
        *cases.model_inputs(batch),
        labels=batch["labels"],
        output_processor=hookspec.processor(keep_hidden),
    )
    (out["logprobs"] * cotangent).sum().backward()
    inner = torch_impl.unwrap_model(model)
    return {
        "logprobs": out["logprobs"].detach(),
        "hidden_grad": kept["hidden"].grad.detach(),
        "output_weight_grad": inner.output_layer.weight.grad.detach(),
        "final_norm_grad": inner.decoder.final_layernorm.weight.grad.detach(),
        "ctx": kept["ctx"],
    }


def _tp2_rank(
    rank: int, expected: dict[str, torch.Tensor], batch: dict[str, Any], cotangent: torch.Tensor
) -> None:
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    got = _logprob_run(model, batch, cotangent)
    ctx = got["ctx"]
    assert ctx.parallel.tp_size == 2 and ctx.parallel.tp_rank == rank
    assert ctx.vocab == hookspec.VocabShard(32 * rank, 32 * (rank + 1), 64)
    assert ctx.vocab_weight.shape == (32, 32)
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got["logprobs"], expected["logprobs"], **tol)
    # The hidden-state gradient holds both vocab shards' contributions, not one rank's part.
    torch.testing.assert_close(got["hidden_grad"], expected["hidden_grad"], **tol)
    assert not torch.allclose(got["hidden_grad"], expected["hidden_grad"] / 2, atol=1e-6)
    rows = slice(32 * rank, 32 * (rank + 1))
    torch.testing.assert_close(
        got["output_weight_grad"], expected["output_weight_grad"][rows], **tol
    )
    torch.testing.assert_close(got["final_norm_grad"], expected["final_norm_grad"], **tol)

    # The stock loss through the processor is bitwise the stock loss at tp=2 as well.
    stock = build_tiny_gpt()(*cases.model_inputs(batch), labels=batch["labels"])
    through = model(
        *cases.model_inputs(batch), labels=batch["labels"], output_processor=cases.stock_loss
    )
    assert torch.equal(stock, through)
    upstream = model(
        *cases.model_inputs(batch),
        labels=batch["labels"],
        output_processor=cases.stock_loss_upstream,
    )
    assert torch.equal(stock, upstream)


@pytest.mark.release_matrix
@pytest.mark.slow
def test_tp2_logprobs_and_gradients_match_tp1() -> None:
    batch = tiny_batch(batch=2, seq=8)
    cotangent = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    with megatron_parallel():
        model = torch_impl.enable_output_processor(build_tiny_gpt())
        expected = _logprob_run(model, batch, cotangent)
        # The tp=1 run agrees with float64 log_softmax of the stock logits.
        logits = model(*cases.model_inputs(batch)).detach()
    torch.testing.assert_close(
        expected["logprobs"].double(),
        cases.reference_logprobs(logits, batch["labels"]),
        rtol=0,
        atol=1e-5,
    )
    expected.pop("ctx")
    run_distributed(_tp2_rank, expected, batch, cotangent, tp=2)

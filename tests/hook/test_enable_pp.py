"""Pipeline parallel 2 over gloo, the stages driven by hand.

The test plays one micro-batch of the schedule itself, with plain ``send``/``recv``,
so that nothing but the two stages lies between the hook and the comparison:
stage 0 runs the embedding and its layer and sends the hidden states; stage 1 sets
them as its input tensor, runs the processor, back-propagates and sends the input
gradient back. The processor must run on the last stage only. Megatron's own
schedules (1F1B, interleaved) also run on a CPU, under
``torch_impl.testing.schedules.cpu_schedule()``; ``tests/hook/test_schedules.py`` tests
the hook through them.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import hookspec
import torch_impl
from hookspec import OutputContext
from tests.support import hook_cases as cases
from tests.support.distributed import run_distributed
from torch_impl.testing.tiny import build_tiny_gpt, megatron_parallel, tiny_batch

CALLS: list[int] = []


def _counting_logprobs(ctx: OutputContext) -> dict[str, torch.Tensor]:
    CALLS.append(ctx.parallel.pp_rank)
    return cases.vocab_parallel_logprobs_fn(ctx)


def _stage_state(
    full: dict[str, torch.Tensor], model: torch.nn.Module, offset: int
) -> dict[str, torch.Tensor]:
    """The full model's tensors under this stage's local names."""

    def global_name(name: str) -> str:
        return re.sub(
            r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + offset}.", name
        )

    return {
        name: full[global_name(name)] for name in model.state_dict() if "_extra_state" not in name
    }


def _pp2_rank(
    rank: int, full_state: dict[str, torch.Tensor], expected: dict[str, Any], batch: dict[str, Any]
) -> None:
    CALLS.clear()
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    # build_tiny_gpt gives each stage the pp=1 model's tensors (a later stage drew its layer
    # from a fresh seed, the numbers of the model's first layer): nothing is copied here, so
    # the first micro-batch below is the pp=1 model's
    held = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    want = _stage_state(full_state, model, offset=rank)
    assert held.keys() == want.keys()
    differ = [k for k in want if not torch.equal(held[k], want[k])]
    assert not differ, f"stage tensors other than the pp=1 model's: {differ}"
    inputs = cases.model_inputs(batch)
    processor = hookspec.processor(_counting_logprobs)
    if rank == 0:
        hidden = model(*inputs, labels=batch["labels"], output_processor=processor)
        assert isinstance(hidden, torch.Tensor) and hidden.shape == (8, 2, 32)
        torch.distributed.send(hidden.detach().contiguous(), dst=1)
        grad = torch.empty_like(hidden)
        torch.distributed.recv(grad, src=1)
        hidden.backward(grad)
        emb = model.embedding.word_embeddings.weight.grad
        torch.testing.assert_close(emb, expected["embedding_grad"], rtol=1e-5, atol=1e-6)
        assert CALLS == []
    else:
        received = torch.empty(8, 2, 32)
        torch.distributed.recv(received, src=0)
        received.requires_grad_(True)
        model.set_input_tensor(received)
        out = model(*inputs, labels=batch["labels"], output_processor=processor)
        torch.testing.assert_close(out["logprobs"], expected["logprobs"], rtol=1e-5, atol=1e-5)
        out["logprobs"].sum().backward()
        torch.distributed.send(received.grad.contiguous(), dst=0)
        torch.testing.assert_close(
            model.output_layer.weight.grad, expected["output_weight_grad"], rtol=1e-5, atol=1e-6
        )
        assert CALLS == [1]


@pytest.mark.slow
def test_pp2_processor_runs_on_the_last_stage_and_matches_pp1() -> None:
    batch = tiny_batch()
    with megatron_parallel():
        model = torch_impl.enable_output_processor(build_tiny_gpt())
        out = model(
            *cases.model_inputs(batch),
            labels=batch["labels"],
            output_processor=cases.vocab_parallel_logprobs,
        )
        out["logprobs"].sum().backward()
        expected = {
            "logprobs": out["logprobs"].detach(),
            "embedding_grad": model.embedding.word_embeddings.weight.grad,
            "output_weight_grad": model.output_layer.weight.grad,
        }
        full_state = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    run_distributed(_pp2_rank, full_state, expected, batch, pp=2)

"""The output processor under Megatron's own schedule: the recipe, runnable on a CPU.

The part between the ``recipe`` markers is what a training loop copies (it is quoted
verbatim in ``docs/schedules.md``, and a test checks that the two agree): a
``forward_step_func`` that passes ``output_processor=`` and a context built from the
micro-batch, and a ``loss_func`` that reads the processor's mapping, under
``get_forward_backward_func()``.

The rest sets up what a real run already has: a tiny GPT on the CPU
(``torch_impl.tiny``), GRPO micro-batches with old and reference logprobs, and
``cpu_schedule()``, which lets Megatron's schedule run without a GPU (it allocates a
token counter on CUDA). Run it as ``python docs/examples/schedule_recipe.py``.
"""

from __future__ import annotations

# fmt: off
# --- recipe start ---
from megatron.core.pipeline_parallel import get_forward_backward_func

from torch_impl.processors import PolicyBatch, PolicyLossConfig, policy_loss

grpo = policy_loss(PolicyLossConfig.grpo(kl_coef=0.1))


def loss_func(result):
    # the processor's mapping; clone the logged loss: the schedule scales the returned one in place
    metrics = {k: result[k].detach().clone() for k in ("loss", "kl", "clip_fraction")}
    return result["loss"], metrics


def forward_step_func(data_iterator, model):
    mb = next(data_iterator)
    context = PolicyBatch(
        old_logprobs=mb["old_logprobs"], advantages=mb["advantages"],
        mask=mb["mask"], ref_logprobs=mb["ref_logprobs"],
    )
    result = model(mb["input_ids"], mb["position_ids"], None, labels=mb["labels"],
                   output_processor=grpo, output_processor_context=context)
    # the last stage's result is the mapping; earlier stages: hidden states
    return result, loss_func


def train_step(model, micro_batches):
    b, s = micro_batches[0]["input_ids"].shape
    return get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=iter(micro_batches), model=[model],
        num_microbatches=len(micro_batches), seq_length=s, micro_batch_size=b,
    )
# --- recipe end ---
# fmt: on

import dataclasses  # noqa: E402  (the set-up, after the recipe)

import torch  # noqa: E402

import torch_impl  # noqa: E402
from torch_impl.processors import selected_logprobs  # noqa: E402
from torch_impl.testing.schedules import cpu_schedule  # noqa: E402
from torch_impl.tiny import build_tiny_gpt, megatron_parallel  # noqa: E402

__all__ = [
    "ExampleRun",
    "WholeBatch",
    "forward_step_func",
    "loss_func",
    "run_example",
    "train_step",
    "whole_batch",
]


@dataclasses.dataclass(frozen=True)
class ExampleRun:
    """What :func:`run_example` did: the micro-batches, the per-micro-batch metrics
    the schedule returned, and the accumulated gradients (by parameter name)."""

    micro_batches: list[dict[str, torch.Tensor]]
    metrics: list[dict[str, torch.Tensor]]
    grads: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class WholeBatch:
    """The same loss over all micro-batches at once, through a plain forward."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def grpo_micro_batches(
    model: torch.nn.Module, n: int, *, batch: int = 4, seq: int = 8, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """``n`` micro-batches of random tokens; old logprobs the model's own plus
    noise, reference logprobs likewise, one advantage per sequence, a loss mask over
    the second half of each sequence (the "completion")."""
    vocab = torch_impl.unwrap_model(model).vocab_size
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        mb = {
            "input_ids": tokens[:, :-1].contiguous(),
            "position_ids": torch.arange(seq).expand(batch, seq).contiguous(),
            "labels": tokens[:, 1:].contiguous(),
        }
        with torch.no_grad():
            logp = model(
                mb["input_ids"],
                mb["position_ids"],
                None,
                labels=mb["labels"],
                output_processor=selected_logprobs(),
            )["logprobs"]
        mask = torch.zeros(batch, seq)
        mask[:, seq // 2 :] = 1.0
        mb |= {
            "old_logprobs": logp + 0.2 * torch.randn(batch, seq, generator=g),
            "ref_logprobs": logp + 0.2 * torch.randn(batch, seq, generator=g),
            "advantages": torch.randn(batch, 1, generator=g).expand(batch, seq).contiguous(),
            "mask": mask,
        }
        out.append(mb)
    return out


def run_example(*, num_microbatches: int = 4) -> ExampleRun:
    """Build the tiny GPT, make GRPO micro-batches and run :func:`train_step` under
    :func:`cpu_schedule`. Needs Megatron's parallel state (``megatron_parallel()``)."""
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    micro_batches = grpo_micro_batches(model, num_microbatches)
    with cpu_schedule():
        metrics = train_step(model, micro_batches)
    grads = {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }
    state = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    return ExampleRun(micro_batches, list(metrics), grads, state)


def whole_batch(run: ExampleRun) -> WholeBatch:
    """The GRPO loss of all of ``run``'s micro-batches concatenated, through one plain
    forward of a model with ``run``'s starting weights, and its gradients."""
    model = torch_impl.enable_output_processor(build_tiny_gpt())
    model.load_state_dict(run.state, strict=False)
    cat = {k: torch.cat([mb[k] for mb in run.micro_batches]) for k in run.micro_batches[0]}
    result = forward_step_func(iter([cat]), model)[0]
    result["loss"].backward()
    grads = {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }
    return WholeBatch(result["loss"].detach(), grads)


def main() -> None:
    with megatron_parallel():
        run = run_example()
    for i, m in enumerate(run.metrics):
        print(f"micro-batch {i}: " + ", ".join(f"{k} {float(v):.4f}" for k, v in m.items()))


if __name__ == "__main__":
    main()

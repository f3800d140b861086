"""The GRPO toy through Megatron's schedule: a DDP-wrapped policy, packed (THD)
micro-batches, ``get_forward_backward_func`` (``torch_impl.testing.examples.grpo_schedule``).

1. One update through the schedule equals the toy's own padded, plain forward on the
   same rollout, model in float64: the forward-only schedule's old and reference
   logprobs, the micro-batch losses (their mean), and every parameter's gradient
   (DDP's ``main_grad``) to ``rtol=1e-10``.
2. The run: over a fixed number of steps with a fixed seed the mean reward rises from
   chance (1/16) above a stated threshold, as the toy's does (``tests/hook/test_rl_step.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import torch_impl
from hookspec import ContractError
from torch_impl.processors import PolicyBatch, PolicyLossConfig, policy_loss
from torch_impl.testing.examples.grpo_schedule import (
    PACKED_FIELDS,
    pack,
    policy_update,
    schedule_logprobs,
    split_rollout,
    train,
    wrap_ddp,
)
from torch_impl.testing.examples.grpo_toy import (
    CountingTask,
    GRPOToyConfig,
    rollout,
    sequence_logprobs,
)
from torch_impl.testing.schedules import cpu_schedule
from torch_impl.testing.tiny import TinyGPTShape, build_tiny_gpt, megatron_parallel

TOY_SHAPE = TinyGPTShape(vocab_size=16, max_sequence_length=16)
NUM_MICROBATCHES = 4


def _policy_and_reference(
    *, double: bool = False, reference_seed: int = 1234
) -> tuple[Any, torch.nn.Module]:
    def build(seed: int) -> torch.nn.Module:
        model = build_tiny_gpt(TOY_SHAPE, seed=seed)
        return torch_impl.enable_output_processor(model.double() if double else model)

    reference = build(reference_seed)
    for p in reference.parameters():
        p.requires_grad_(False)
    with cpu_schedule():
        ddp = wrap_ddp(build(1234))
    return ddp, reference


def _flat(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``[n, s]`` rows -> ``[1, t]``: the first ``lengths[i]`` entries of each row."""
    return torch.cat([x[i, :n] for i, n in enumerate(lengths)])[None]


@pytest.mark.parametrize("varied", [False, True], ids=["equal-lengths", "varied-lengths"])
def test_one_packed_schedule_update_equals_the_padded_forward(varied: bool) -> None:
    """``varied``: sequence i keeps its first ``7 - i % 3`` tokens in the packed batch;
    the padded reference masks the rest (causal: the kept positions see the same)."""
    config = GRPOToyConfig(prompts_per_step=4, group_size=4, kl_coef=0.1, seed=3)
    task = CountingTask(vocab_size=TOY_SHAPE.vocab_size)
    lengths = [7 - i % 3 if varied else 7 for i in range(16)]
    with megatron_parallel():
        ddp, reference = _policy_and_reference(double=True, reference_seed=7)
        batch = rollout(ddp, task, config, generator=torch.Generator().manual_seed(0))
        mask = batch.mask * (torch.arange(7) < torch.tensor(lengths)[:, None])
        if varied:
            rows = {f: getattr(batch, f) for f in PACKED_FIELDS} | {"mask": mask}
            parts = [range(4 * k, 4 * k + 4) for k in range(NUM_MICROBATCHES)]
            mbs = [
                pack({f: v[r] for f, v in rows.items()}, lengths=[lengths[i] for i in r])
                for r in parts
            ]
            assert [mb.input_ids.shape[1] for mb in mbs] == [
                sum(lengths[i] for i in r) for r in parts
            ]
        else:
            mbs = split_rollout(batch, NUM_MICROBATCHES)
            assert all(mb.input_ids.shape == (1, 4 * 7) for mb in mbs)  # 4 sequences of 7 a row
        old = schedule_logprobs(ddp, mbs, schedule_scope=cpu_schedule)
        ref = schedule_logprobs(reference, mbs, schedule_scope=cpu_schedule)

        # the toy's way: padded rows [16, 7], one plain forward each
        want_old = sequence_logprobs(ddp, batch)
        want_ref = sequence_logprobs(reference, batch)
        torch.testing.assert_close(
            torch.cat(old, 1), _flat(want_old, lengths), rtol=1e-10, atol=1e-12
        )
        torch.testing.assert_close(
            torch.cat(ref, 1), _flat(want_ref, lengths), rtol=1e-10, atol=1e-12
        )
        assert not torch.equal(want_old, want_ref)

        # old logprobs moved off the policy's own, so that some ratios clip; the same both ways
        noise = 0.3 * torch.randn(
            16, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64
        )
        mbs = [
            dataclasses.replace(
                mb,
                old_logprobs=o + _flat(noise[4 * k : 4 * k + 4], lengths[4 * k : 4 * k + 4]),
                ref_logprobs=r,
            )
            for k, (mb, o, r) in enumerate(zip(mbs, old, ref, strict=True))
        ]
        metrics = policy_update(ddp, mbs, kl_coef=config.kl_coef, schedule_scope=cpu_schedule)
        got = {name: p.main_grad.clone() for name, p in ddp.module.named_parameters()}

        out = ddp.module(
            batch.input_ids,
            batch.position_ids,
            None,
            labels=batch.labels,
            output_processor=policy_loss(PolicyLossConfig.grpo(kl_coef=config.kl_coef)),
            output_processor_context=PolicyBatch(
                old_logprobs=want_old + noise,
                advantages=batch.advantages,
                mask=mask,
                ref_logprobs=want_ref,
            ),
        )
        ddp.zero_grad_buffer()
        for p in ddp.module.parameters():
            p.grad = None
        out["loss"].backward()
        # DDP's hooks moved the padded forward's gradients into main_grad as well
        want = {name: p.main_grad for name, p in ddp.module.named_parameters()}

    losses = torch.stack([m["loss"] for m in metrics])
    assert len(metrics) == NUM_MICROBATCHES and losses.dtype == torch.float64
    assert 0.0 < float(out["clip_fraction"]) < 1.0
    torch.testing.assert_close(losses.mean(), out["loss"].detach(), rtol=1e-10, atol=0.0)
    assert set(got) == set(want)
    for name, grad in got.items():
        assert want[name].abs().sum() > 0, name
        torch.testing.assert_close(
            grad, want[name], rtol=1e-10, atol=1e-13, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_micro_batches_must_split_the_rollout_evenly() -> None:
    config = GRPOToyConfig(prompts_per_step=3, group_size=2, seed=0)
    with megatron_parallel():
        model = torch_impl.enable_output_processor(build_tiny_gpt(TOY_SHAPE))
        batch = rollout(model, CountingTask(), config, generator=torch.Generator().manual_seed(0))
    assert len(split_rollout(batch, 3)) == 3
    rows = {f: getattr(batch, f) for f in PACKED_FIELDS}
    for lengths in ([8] * 6, [0] * 6, [7] * 5):
        with pytest.raises(ContractError) as err:
            pack(rows, lengths=lengths)
        assert err.value.field == "lengths"
    for bad in (4, 0, 2.0):
        with pytest.raises(ContractError) as err:
            split_rollout(batch, bad)  # type: ignore[arg-type]
        assert err.value.field == "num_microbatches"


# The toy's defaults but 120 steps; 2 micro-batches of 128 packed sequences (896 tokens) each
RUN = GRPOToyConfig(
    prompts_per_step=16, group_size=16, steps=120, updates_per_step=2, lr=2e-3, kl_coef=0.1
)
RUN_MICROBATCHES = 2
# Mean of the last 5 steps; chance is 1/16. Measured on a 2-core CPU, one thread, megatron-core
# 0.16.1: 0.059 over the first 3 steps, 0.906 over the last 5 with seed 0 (0.058 -> 0.899 with
# seed 1). With 160 steps in 4 micro-batches seed 0 reached 0.936 on both 0.16.1 and 0.19.2
# (the same rewards to 3 decimals). megatron-core 0.19.2, torch 2.11, 2026-11-29: 0.058 ->
# 0.91 in 8 micro-batches and in 2 (the sum over micro-batches is the same update), 2 taking
# 30% less time (263 s and 185 s beside a test run on the 2-core machine). The one-update
# equality above splits its rollout in NUM_MICROBATCHES. The toy's test keeps the same margin.
REWARD_THRESHOLD = 0.75


@pytest.mark.slow
@pytest.mark.release_independent  # the one-update equality above runs on every environment
def test_grpo_through_the_schedule_reward_rises() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # oversubscribed threads on two loaded cores make the run slower
    try:
        with megatron_parallel():
            ddp, reference = _policy_and_reference()
            stats = train(
                ddp,
                reference,
                CountingTask(vocab_size=TOY_SHAPE.vocab_size),
                RUN,
                num_microbatches=RUN_MICROBATCHES,
                schedule_scope=cpu_schedule,
            )
    finally:
        torch.set_num_threads(threads)
    rewards = [s.reward for s in stats]
    assert len(stats) == RUN.steps
    assert sum(rewards[:3]) / 3 < 0.15, rewards  # starts near chance
    assert sum(rewards[-5:]) / 5 > REWARD_THRESHOLD, rewards
    assert all(torch.isfinite(torch.tensor([s.loss, s.kl, s.clip_fraction])).all() for s in stats)

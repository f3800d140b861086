"""The GRPO toy of :mod:`torch_impl.testing.examples.grpo_toy` through Megatron's schedule.

The same task, rollout, advantages and loss (``policy_loss(PolicyLossConfig.grpo(...))``
inside the hook), run the way an RL framework runs it:

- the policy is wrapped in Megatron's ``DistributedDataParallel``
  (``DistributedDataParallelConfig()``), whose gradients accumulate in each
  parameter's ``main_grad`` across micro-batches (``config.no_sync_func``) and are
  reduced by ``finalize_model_grads`` (``config.finalize_model_grads_func``);
- every forward and backward pass goes through ``get_forward_backward_func()`` over
  ``num_microbatches`` micro-batches: forward-only for the old and reference
  logprobs (``selected_logprobs``), forward and backward for the loss;
- each micro-batch is packed (THD): its sequences concatenated into one row
  ``[1, n * s]`` with ``PackedSeqParams(qkv_format="thd", cu_seqlens_q=...)``,
  position ids restarting at every sequence, and the policy loss reading the
  sequences from ``packed_seq_params``. (The toy's sequences all have ``P + C - 1``
  tokens; :func:`pack` also packs sequences of different lengths, as the test of one
  update does.)

One update::

    rollout   = grpo_toy.rollout(policy, ...)                       # [n*G, s] rows
    mbs       = pack(rows of micro-batch k) for k < num_microbatches  # [1, n*G*s/M] each
    old, ref  = forward-only schedule, selected_logprobs              # per micro-batch [1, t]
    repeat updates_per_step times:
        ddp.zero_grad_buffer()
        schedule(forward_step: policy_loss on the packed micro-batch; loss_func: its mapping)
        param.grad = param.main_grad; optimizer.step()

The loss of a micro-batch is its seq-mean-token-mean; the schedule divides each by the
number of micro-batches, so with equal micro-batches the step's gradient is the whole
batch's, as in the toy. Sampling calls the model directly (no schedule). On a CPU,
pass ``schedule_scope=torch_impl.testing.schedules.cpu_schedule``: each schedule
call runs inside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from hookspec import ContractError
from torch_impl import unwrap_model
from torch_impl.processors import PolicyBatch, PolicyLossConfig, policy_loss, selected_logprobs

from .grpo_toy import CountingTask, GRPOToyConfig, Rollout, StepStats, rollout

__all__ = [
    "PACKED_FIELDS",
    "PackedMicroBatch",
    "grpo_schedule_step",
    "pack",
    "policy_update",
    "schedule_logprobs",
    "split_rollout",
    "train",
    "wrap_ddp",
]


@dataclasses.dataclass(frozen=True)
class PackedMicroBatch:
    """Sequences packed into one row: every per-token field is ``[1, t]`` (``t`` the
    sum of their lengths); ``packed_seq_params`` carries their boundaries
    (``cu_seqlens_q``)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    packed_seq_params: Any
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


PACKED_FIELDS = ("input_ids", "position_ids", "labels", "mask", "advantages")


def pack(
    rows: Mapping[str, torch.Tensor], /, *, lengths: Sequence[int] | None = None
) -> PackedMicroBatch:
    """Pack ``[n, s]`` rows (``input_ids``, ``position_ids``, ``labels``, ``mask``,
    ``advantages``) into one THD row ``[1, t]``, keeping the first ``lengths[i]``
    tokens of row ``i`` (all ``s`` when ``lengths`` is ``None``)::

        packed[k]  = cat([rows[k][i, :lengths[i]] for i in range(n)])[None]   # [1, t]
        cu_seqlens = [0, cumsum(lengths)]                                    # int32

    Under causal attention a sequence's first ``lengths[i]`` positions see only
    themselves, so they equal the padded row's (whose later positions the loss
    must then mask)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    n, s = rows["input_ids"].shape
    keep = [s] * n if lengths is None else [int(x) for x in lengths]
    if len(keep) != n or not all(1 <= x <= s for x in keep):
        raise ContractError("lengths", expected=f"{n} lengths in [1, {s}]", actual=repr(lengths))
    cu = torch.tensor([0, *keep], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(keep),
        max_seqlen_kv=max(keep),
    )
    flat = {k: torch.cat([rows[k][i, : keep[i]] for i in range(n)])[None] for k in PACKED_FIELDS}
    return PackedMicroBatch(**flat, packed_seq_params=psp)


def split_rollout(batch: Rollout, num_microbatches: int, /) -> list[PackedMicroBatch]:
    """The rollout's rows in ``num_microbatches`` equal, consecutive parts, each packed."""
    b = batch.input_ids.shape[0]
    if (
        isinstance(num_microbatches, bool)
        or not isinstance(num_microbatches, int)
        or num_microbatches < 1
    ):
        raise ContractError(
            "num_microbatches", expected="an int >= 1", actual=repr(num_microbatches)
        )
    if b % num_microbatches:
        raise ContractError(
            "num_microbatches",
            expected=f"a divisor of the rollout's {b} sequences (equal micro-batches)",
            actual=num_microbatches,
        )
    size = b // num_microbatches
    fields = ("input_ids", "position_ids", "labels", "mask", "advantages")
    return [
        pack({f: getattr(batch, f)[k * size : (k + 1) * size] for f in fields})
        for k in range(num_microbatches)
    ]


ScheduleScope = Callable[[], contextlib.AbstractContextManager[Any]]


def _schedule(
    model: torch.nn.Module,
    step: Any,
    mbs: list[PackedMicroBatch],
    *,
    forward_only: bool,
    schedule_scope: ScheduleScope,
) -> Any:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with schedule_scope():
        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(mbs),
            model=[model],
            num_microbatches=len(mbs),
            seq_length=mbs[0].input_ids.shape[1],
            micro_batch_size=1,
            forward_only=forward_only,
        )


def schedule_logprobs(
    model: torch.nn.Module,
    mbs: list[PackedMicroBatch],
    /,
    *,
    temperature: float = 1.0,
    schedule_scope: ScheduleScope = contextlib.nullcontext,
) -> list[torch.Tensor]:
    """Each micro-batch's label logprobs ``[1, t]`` through a forward-only schedule
    (``selected_logprobs`` in the hook; the loss function returns a zero loss and
    the logprobs as its metrics), entered inside ``schedule_scope()``."""
    processor = selected_logprobs(temperature=temperature)

    def loss_func(
        result: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return torch.zeros(()), {"logprobs": result["logprobs"].detach()}

    def step(data_iterator: Iterator[PackedMicroBatch], model: torch.nn.Module) -> Any:
        mb = next(data_iterator)
        result = model(
            mb.input_ids,
            mb.position_ids,
            None,
            labels=mb.labels,
            packed_seq_params=mb.packed_seq_params,
            output_processor=processor,
        )
        return result, loss_func

    with torch.no_grad():
        out = _schedule(model, step, mbs, forward_only=True, schedule_scope=schedule_scope)
    return [m["logprobs"] for m in out]


def wrap_ddp(model: torch.nn.Module, /) -> Any:
    """``model`` (an enabled GPT) inside Megatron's ``DistributedDataParallel`` with
    ``DistributedDataParallelConfig()``, and its config given DDP's ``no_sync`` and
    Megatron's ``finalize_model_grads`` for the schedule (as Megatron's training loop
    sets them). Build it where Megatron's parallel state exists; on a CPU, inside
    ``cpu_schedule()`` (the grad buffers ask for ``torch.cuda.current_device()``)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    inner: Any = unwrap_model(model)
    ddp = DistributedDataParallel(inner.config, DistributedDataParallelConfig(), inner)
    inner.config.no_sync_func = ddp.no_sync
    inner.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def policy_update(
    ddp: Any,
    mbs: list[PackedMicroBatch],
    /,
    *,
    kl_coef: float,
    temperature: float = 1.0,
    schedule_scope: ScheduleScope = contextlib.nullcontext,
) -> list[dict[str, torch.Tensor]]:
    """One forward and backward pass of the GRPO loss over the packed micro-batches
    (each with ``old_logprobs`` and ``ref_logprobs``) through the schedule, inside
    ``schedule_scope()``. DDP's gradient buffer is zeroed first; afterwards each
    parameter's ``main_grad`` holds the gradient of the mean of the micro-batch
    losses. Returns the schedule's per-micro-batch metrics (``loss``, ``kl``,
    ``clip_fraction``)."""
    loss_fn = policy_loss(PolicyLossConfig.grpo(kl_coef=kl_coef))
    scalar_t = None if temperature == 1.0 else temperature

    def loss_func(
        result: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # clone: the schedule divides the returned loss by num_microbatches in place
        return result["loss"], {
            k: result[k].detach().clone() for k in ("loss", "kl", "clip_fraction")
        }

    def step(data_iterator: Iterator[PackedMicroBatch], model: torch.nn.Module) -> Any:
        mb = next(data_iterator)
        if mb.old_logprobs is None or mb.ref_logprobs is None:
            raise ContractError(
                "micro_batch", expected="old_logprobs and ref_logprobs", actual="None"
            )
        context = PolicyBatch(
            old_logprobs=mb.old_logprobs,
            advantages=mb.advantages,
            mask=mb.mask,
            ref_logprobs=mb.ref_logprobs,
            temperature=scalar_t,
        )
        result = model(
            mb.input_ids,
            mb.position_ids,
            None,
            labels=mb.labels,
            packed_seq_params=mb.packed_seq_params,
            output_processor=loss_fn,
            output_processor_context=context,
        )
        return result, loss_func

    ddp.zero_grad_buffer()
    return list(_schedule(ddp, step, mbs, forward_only=False, schedule_scope=schedule_scope))


def grpo_schedule_step(
    ddp: Any,
    reference: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    task: CountingTask,
    config: GRPOToyConfig,
    /,
    *,
    num_microbatches: int,
    generator: torch.Generator,
    schedule_scope: ScheduleScope = contextlib.nullcontext,
) -> StepStats:
    """One rollout and ``updates_per_step`` optimizer steps, every pass through the
    schedule over ``num_microbatches`` packed micro-batches. ``ddp`` from
    :func:`wrap_ddp`; ``reference`` an enabled GPT (its weights are not updated).
    Each schedule call runs inside ``schedule_scope()`` (on a CPU:
    ``torch_impl.testing.schedules.cpu_schedule``); sampling runs outside it."""
    vocab = getattr(unwrap_model(ddp), "vocab_size", None)
    if vocab != task.vocab_size:
        raise ContractError(
            "task.vocab_size",
            expected=f"the model's vocabulary size {vocab}",
            actual=task.vocab_size,
        )
    batch = rollout(ddp, task, config, generator=generator)
    mbs = split_rollout(batch, num_microbatches)
    kw: dict[str, Any] = {"temperature": config.temperature, "schedule_scope": schedule_scope}
    old = schedule_logprobs(ddp, mbs, **kw)
    ref = schedule_logprobs(reference, mbs, **kw)
    mbs = [
        dataclasses.replace(mb, old_logprobs=o, ref_logprobs=r) for mb, o, r in zip(mbs, old, ref)
    ]
    metrics: list[dict[str, torch.Tensor]] = []
    for _ in range(config.updates_per_step):
        optimizer.zero_grad(set_to_none=True)
        metrics = policy_update(ddp, mbs, kl_coef=config.kl_coef, **kw)
        for p in ddp.parameters():
            p.grad = p.main_grad  # DDP accumulated the micro-batches' gradients here
        optimizer.step()

    def mean(key: str) -> float:
        return float(torch.stack([m[key] for m in metrics]).mean())

    return StepStats(
        reward=float(batch.rewards.mean()),
        loss=mean("loss"),
        kl=mean("kl"),
        clip_fraction=mean("clip_fraction"),
    )


def train(
    ddp: Any,
    reference: torch.nn.Module,
    task: CountingTask,
    config: GRPOToyConfig,
    /,
    *,
    num_microbatches: int = 4,
    schedule_scope: ScheduleScope = contextlib.nullcontext,
) -> list[StepStats]:
    """``config.steps`` steps of :func:`grpo_schedule_step` with Adam (``lr``) on
    ``ddp``'s parameters, sampling from a generator seeded with ``config.seed``."""
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=config.lr)
    return [
        grpo_schedule_step(
            ddp,
            reference,
            optimizer,
            task,
            config,
            num_microbatches=num_microbatches,
            generator=generator,
            schedule_scope=schedule_scope,
        )
        for _ in range(config.steps)
    ]

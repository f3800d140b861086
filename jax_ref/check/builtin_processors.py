"""The built-in processors ``hookcheck`` checks, as importable objects, and the
user contexts they read. Imports ``torch_impl.processors``: where it is missing,
``hookcheck`` reports these checks as unavailable and runs the others.

Tile sizes are small on purpose: on the tiny model (V = 64, 24 tokens) the
online logsumexp then spans several vocabulary and token tiles, as it does at
scale.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from typing import Any

import torch

from hookspec import (
    Aggregation,
    DistillDivergence,
    KLEstimator,
    OutputContext,
    Processor,
    TeacherTail,
    processor,
)
from torch_impl.processors import (
    DenseTeacher,
    DistillConfig,
    LinearOptions,
    PolicyBatch,
    PolicyLossConfig,
    PolicyLossMode,
    PreferenceBatch,
    PreferenceConfig,
    RolloutCorrection,
    SamplingSupport,
    SparseTeacher,
    WeightLevel,
    cross_entropy_loss,
    distillation_loss,
    linear_distillation_loss,
    policy_loss,
    preference_loss,
    selected_logprobs,
    topk_logprobs,
)

from .examples import current_logprobs

__all__ = [
    "BYPASS",
    "BYPASS_CONFIG",
    "CORRECTED",
    "CORRECTED_CONFIG",
    "CROSS_ENTROPY",
    "CROSS_ENTROPY_LABEL_SMOOTHING",
    "CROSS_ENTROPY_SOFTCAP",
    "CROSS_ENTROPY_Z_LOSS",
    "DISTILL_DENSE",
    "DISTILL_DENSE_CONFIG",
    "DISTILL_RENORMALIZE",
    "DISTILL_RENORMALIZE_CONFIG",
    "DISTILL_ROWS",
    "DISTILL_SPARSE",
    "DISTILL_SPARSE_CONFIG",
    "GRPO",
    "GRPO_CONFIG",
    "GSPO",
    "GSPO_CONFIG",
    "LOGPROBS",
    "LABEL_SMOOTHING",
    "LOGPROBS_CONTEXT_TEMPERATURE",
    "LOGPROBS_SOFTCAP",
    "LOGPROBS_SUPPORT",
    "LOGPROBS_T07",
    "PPO",
    "PPO_CONFIG",
    "CISPO",
    "CISPO_CONFIG",
    "GEO_MEAN",
    "GEO_MEAN_CONFIG",
    "PREFERENCE_DPO",
    "PREFERENCE_DPO_CONFIG",
    "PREFERENCE_SIMPO",
    "PREFERENCE_SIMPO_CONFIG",
    "SOFTCAP",
    "SEQ_SUM",
    "SEQ_SUM_CONFIG",
    "TOPK",
    "CheckedDenseTeacher",
    "SamplingContext",
    "TemperatureContext",
    "dense_teacher_context",
    "distillation_by_rows",
    "gspo_context",
    "policy_context",
    "rollout_context",
    "sampling_context",
    "preference_context",
    "reference_free_context",
    "softcapped",
    "softcapped_config",
    "sparse_teacher_context",
    "temperature_context",
]

_ROWS, _COLS = 7, 24  # tile_rows x tile_cols

LOGPROBS = selected_logprobs(entropy=True, tile_rows=_ROWS, tile_cols=_COLS)
LOGPROBS_T07 = selected_logprobs(temperature=0.7, entropy=True, tile_rows=_ROWS, tile_cols=_COLS)
LOGPROBS_CONTEXT_TEMPERATURE = selected_logprobs(entropy=True, tile_rows=_ROWS, tile_cols=_COLS)
CROSS_ENTROPY = cross_entropy_loss(tile_rows=_ROWS, tile_cols=_COLS)
CROSS_ENTROPY_Z_LOSS = cross_entropy_loss(z_loss=0.01, tile_rows=_ROWS, tile_cols=_COLS)
LABEL_SMOOTHING = 0.1
CROSS_ENTROPY_LABEL_SMOOTHING = cross_entropy_loss(
    label_smoothing=LABEL_SMOOTHING, z_loss=0.01, tile_rows=_ROWS, tile_cols=_COLS
)

SOFTCAP = 2.0
"""The final-logit softcap of the softcapped checks: on the tiny model's logits
(a few units) it binds, and the capped and uncapped results differ."""


def softcapped_config(config: Any) -> Any:
    """A shallow copy of a model ``config`` with ``final_logit_softcapping = SOFTCAP``
    as an instance attribute of the copy (a namespace holding only it where
    ``config`` is None): the field of Megatron releases that have it, set without
    touching the model's own config or any Megatron class."""
    capped = types.SimpleNamespace() if config is None else copy.copy(config)
    capped.final_logit_softcapping = SOFTCAP
    return capped


def softcapped(proc: Processor, /, *, name: str) -> Processor:
    """``proc`` run on the context with :func:`softcapped_config` of its config: the
    processor as it runs under a model whose config sets ``final_logit_softcapping``."""

    def fn(ctx: OutputContext) -> Any:
        return proc(ctx.replace(config=softcapped_config(ctx.config)))

    return processor(fn, name=name)


LOGPROBS_SOFTCAP = softcapped(LOGPROBS, name="selected_logprobs")
CROSS_ENTROPY_SOFTCAP = softcapped(CROSS_ENTROPY_Z_LOSS, name="cross_entropy_loss")

PPO_CONFIG = PolicyLossConfig.ppo(clip_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01)
PPO = policy_loss(PPO_CONFIG, tile_rows=3)  # fused: 3 tokens x 64 logits per tile
GRPO_CONFIG = PolicyLossConfig.grpo(fused=False)
GRPO = policy_loss(GRPO_CONFIG, tile_rows=_ROWS, tile_cols=_COLS)
GSPO_CONFIG = PolicyLossConfig.gspo(kl_coef=0.02, kl_estimator="k1")
GSPO = policy_loss(GSPO_CONFIG, tile_rows=_ROWS, tile_cols=_COLS)
SEQ_SUM_CONFIG = PolicyLossConfig(
    aggregation=Aggregation.SEQ_MEAN_TOKEN_SUM, kl_coef=0.1, kl_estimator=KLEstimator.K2
)
SEQ_SUM = policy_loss(SEQ_SUM_CONFIG, tile_rows=3)
CISPO_CONFIG = PolicyLossConfig(
    loss_mode=PolicyLossMode.CISPO,
    clip_low=0.1,
    kl_coef=0.05,
    kl_estimator=KLEstimator.K3,
    kl_straight_through=True,  # veRL's "low_var_kl+"
    kl_value_clamp=10.0,
)
CISPO = policy_loss(CISPO_CONFIG, tile_rows=3)  # fused: each token's own logprob
GEO_MEAN_CONFIG = PolicyLossConfig(
    loss_mode=PolicyLossMode.GEO_MEAN, aggregation=Aggregation.SEQ_MEAN_TOKEN_MEAN
)
GEO_MEAN = policy_loss(GEO_MEAN_CONFIG, tile_rows=_ROWS, tile_cols=_COLS)  # autograd
CORRECTED_CONFIG = PolicyLossConfig.grpo(
    rollout_correction=RolloutCorrection(
        rollout_is=WeightLevel.TOKEN,
        rollout_is_threshold=1.2,
        rollout_rs={"token_k1": 1.3, "seq_mean_k3": 0.05},
    )
)


def loss_and_policy_metrics(proc: Processor, /) -> Processor:
    """``proc``'s result without the ``rollout_corr/`` metrics: the JAX reference checks the
    loss, its gradients and the policy metrics; the correction's metrics are checked
    against veRL's own functions in the tests (``tests/processors/test_rollout_correction.py``)."""

    def fn(ctx: OutputContext) -> Any:
        out = proc(ctx)
        return {k: v for k, v in out.items() if not k.startswith("rollout_corr/")}

    return processor(fn, name="policy_loss")


CORRECTED = loss_and_policy_metrics(policy_loss(CORRECTED_CONFIG, tile_rows=3))  # fused
BYPASS_CONFIG = PolicyLossConfig(
    rollout_correction=RolloutCorrection(
        rollout_is=WeightLevel.TOKEN, bypass_mode=True, loss_type="reinforce"
    )
)
BYPASS = loss_and_policy_metrics(policy_loss(BYPASS_CONFIG, tile_rows=_ROWS, tile_cols=_COLS))


@dataclasses.dataclass(frozen=True)
class TemperatureContext:
    """A user context carrying a per-token temperature ``[b, s]``."""

    temperature: torch.Tensor


def temperature_context(ctx: OutputContext) -> TemperatureContext:
    b, s = ctx.batch_size, ctx.seq_len
    g = torch.Generator().manual_seed(11)
    return TemperatureContext(torch.rand(b, s, generator=g) + 0.5)


def _near_policy(ctx: OutputContext, noise: float, seed: int) -> PolicyBatch:
    lp = current_logprobs(ctx)  # [b, s] float64
    g = torch.Generator().manual_seed(seed)
    b, s = lp.shape

    def randn() -> torch.Tensor:
        return torch.randn(b, s, generator=g, dtype=torch.float64)

    old = lp + noise * randn()
    adv = randn()
    old[0, 2], adv[0, 2] = lp[0, 2] - 1.5, -1.0  # ratio e^1.5 > dual clip 3, A < 0
    ref = lp + 0.2 * randn()
    return PolicyBatch(old_logprobs=old.float(), advantages=adv.float(), ref_logprobs=ref.float())


def policy_context(ctx: OutputContext) -> PolicyBatch:
    """Old and reference logprobs near the current ones (log-ratio noise 0.2:
    some tokens clipped, some not), random advantages."""
    return _near_policy(ctx, 0.2, seed=5)


def rollout_context(ctx: OutputContext) -> PolicyBatch:
    """As :func:`policy_context`, with rollout-engine logprobs 0.2 (log ratio) from the old
    ones: some weights truncated at 1.2, some tokens and sequences rejected."""
    batch = _near_policy(ctx, 0.2, seed=7)
    g = torch.Generator().manual_seed(8)
    noise = 0.2 * torch.randn(batch.old_logprobs.shape, generator=g, dtype=torch.float64)
    rollout = (batch.old_logprobs.double() + noise).float()
    return dataclasses.replace(batch, rollout_logprobs=rollout)


def gspo_context(ctx: OutputContext) -> PolicyBatch:
    """As :func:`policy_context` with noise 3e-4, so that GSPO's narrow clip
    (3e-4, 4e-4) on the sequence ratio leaves some sequences unclipped."""
    batch = _near_policy(ctx, 3e-4, seed=6)
    lp = current_logprobs(ctx)
    old = batch.old_logprobs.clone()
    old[0, 2] = lp[0, 2].float()
    return dataclasses.replace(batch, old_logprobs=old)


# ---------------------------------------------------------------- sampling replay

LOGPROBS_SUPPORT = selected_logprobs(entropy=True, tile_rows=_ROWS, tile_cols=_COLS)


@dataclasses.dataclass(frozen=True)
class SamplingContext:
    """A user context carrying a sampler's kept ids (``selected_logprobs`` reads its
    ``sampling_support``)."""

    sampling_support: SamplingSupport


def sampling_context(ctx: OutputContext) -> SamplingContext:
    """Eight kept ids per token in random order, every label among them (where it
    appears twice, once), the last two padding (-1) at every third token."""
    assert ctx.labels is not None and ctx.vocab is not None
    b, s, v = ctx.batch_size, ctx.seq_len, ctx.vocab.size
    g = torch.Generator().manual_seed(12)
    ids = torch.rand(b, s, v, generator=g).argsort(-1)[..., :8].contiguous()
    labels = typing.cast(torch.Tensor, ctx.labels).to("cpu", torch.long)
    ids[..., 3] = torch.where(labels == ctx.ignore_index, ids[..., 3], labels)
    ids[:, ::3, -2:] = -1
    return SamplingContext(SamplingSupport(kept_ids=ids))


# ---------------------------------------------------------------- top-k and distillation

TOPK = topk_logprobs(5, entropy=True, tile_rows=_ROWS, tile_cols=_COLS)
DISTILL_SPARSE_CONFIG = DistillConfig(
    divergence=DistillDivergence.JSD, beta=0.3, tail=TeacherTail.BUCKET, temperature=1.5
)
DISTILL_SPARSE = distillation_loss(DISTILL_SPARSE_CONFIG, tile_rows=3)
DISTILL_RENORMALIZE_CONFIG = DistillConfig(
    aggregation=Aggregation.SEQ_MEAN_TOKEN_MEAN, temperature=1.5
)
DISTILL_RENORMALIZE = distillation_loss(DISTILL_RENORMALIZE_CONFIG, tile_rows=3)
DISTILL_DENSE_CONFIG = DistillConfig(divergence=DistillDivergence.REVERSE_KL, temperature=0.8)
DISTILL_DENSE = distillation_loss(DISTILL_DENSE_CONFIG, tile_rows=3)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[b, s, ...] -> [n, ...]`` in the hidden states' (``s``-major) row order."""
    return x.transpose(0, 1).reshape(-1, *x.shape[2:])


def distillation_by_rows(
    config: DistillConfig, /, *, tile_rows: int | None = 3, compute_dtype: torch.dtype | None = None
) -> Processor:
    """``distillation_loss(config)`` written as an adopter would on the tensor function
    (``linear_distillation_loss``): the context's tensors as rows (a sequence per batch
    row; no packed sequences, no MuP scale), its metrics the masked means of the
    per-row results."""

    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        teacher = ctx.context
        assert isinstance(teacher, (SparseTeacher, DenseTeacher))
        hs, weight = (
            typing.cast(torch.Tensor, ctx.hidden_states),
            typing.cast(torch.Tensor, ctx.vocab_weight),
        )
        b = int(hs.shape[1])
        s = int(hs.shape[0]) * (ctx.parallel.tp_size if ctx.parallel.sequence_parallel else 1)
        labels = None if ctx.labels is None else _rows(typing.cast(torch.Tensor, ctx.labels))
        given = teacher.mask if teacher.mask is not None else ctx.loss_mask
        m = torch.ones(b * s, dtype=torch.float64, device=hs.device)
        m = m if given is None else _rows(typing.cast(torch.Tensor, given)).double()
        if isinstance(teacher, SparseTeacher):
            rows: SparseTeacher | DenseTeacher = dataclasses.replace(
                teacher, ids=_rows(teacher.ids), logprobs=_rows(teacher.logprobs), mask=m
            )
        else:
            th = teacher.hidden_states
            rows = dataclasses.replace(teacher, hidden_states=th.reshape(-1, th.shape[-1]), mask=m)
        options = LinearOptions(
            ignore_index=ctx.ignore_index,
            vocab=ctx.vocab,
            collectives=ctx.collectives,
            compute_dtype=compute_dtype,
            tile_rows=tile_rows,
            check_values=ctx.check_values,
        )
        res = linear_distillation_loss(
            hs.reshape(-1, hs.shape[-1]),
            weight,
            labels,
            rows,
            options=options,
            config=config,
            sequences=(torch.arange(b * s, device=hs.device) % b, b),
        )
        m = m if labels is None else torch.where(labels == ctx.ignore_index, 0.0, m)
        m = m.to(device=res.kl.device, dtype=res.kl.dtype)
        count = torch.where(m.sum() == 0, 1.0, m.sum())
        return {
            "loss": res.loss,
            "kl": (torch.where(m > 0, res.kl, 0.0) * m).sum() / count,
            "top1_agreement": (torch.where(m > 0, res.top1_agreement.to(m.dtype), 0.0) * m).sum()
            / count,
        }

    return processor(fn, name="linear_distillation_loss")


DISTILL_ROWS = distillation_by_rows(DISTILL_SPARSE_CONFIG)

_TEACHER_HIDDEN = 16
_TEACHER_K = 6


def _teacher_model(ctx: OutputContext) -> tuple[torch.Tensor, torch.Tensor]:
    """A random teacher of the context's vocabulary, the same on every rank:
    hidden states ``[s, b, 16]`` (the context's layout) and the whole weight ``[V, 16]``."""
    assert ctx.vocab is not None
    g = torch.Generator().manual_seed(21)
    s, b = ctx.hidden_states.shape[0], ctx.hidden_states.shape[1]
    th = torch.randn(s, b, _TEACHER_HIDDEN, generator=g, dtype=torch.float64)
    tw = torch.randn(ctx.vocab.size, _TEACHER_HIDDEN, generator=g, dtype=torch.float64) * 0.6
    return th, tw


def sparse_teacher_context(ctx: OutputContext) -> SparseTeacher:
    """The random teacher's top-6 ids and logprobs at ``T = 1.5`` (the sparse configs'
    temperature), float32."""
    th, tw = _teacher_model(ctx)
    lp = (torch.einsum("sbh,vh->bsv", th, tw) / 1.5).log_softmax(-1)
    top = torch.sort(lp, dim=-1, descending=True, stable=True)
    return SparseTeacher(
        ids=top.indices[..., :_TEACHER_K].contiguous(),
        logprobs=top.values[..., :_TEACHER_K].float().contiguous(),
    )


@dataclasses.dataclass(frozen=True)
class CheckedDenseTeacher(DenseTeacher):
    """A :class:`DenseTeacher` that also carries the whole teacher weight, which the
    sharded reference slices at its shard (the processor reads ``weight`` only)."""

    full_weight: torch.Tensor | None = None


def dense_teacher_context(ctx: OutputContext) -> CheckedDenseTeacher:
    """The random teacher's hidden states and this rank's rows of its weight, float32."""
    assert ctx.vocab is not None
    th, tw = _teacher_model(ctx)
    return CheckedDenseTeacher(
        hidden_states=th.float(),
        weight=tw[ctx.vocab.start : ctx.vocab.end].float(),
        vocab=ctx.vocab,
        full_weight=tw.float(),
    )


# ---------------------------------------------------------------- preference losses

PREFERENCE_DPO_CONFIG = PreferenceConfig.dpo(beta=0.5, label_smoothing=0.1)
PREFERENCE_DPO = preference_loss(PREFERENCE_DPO_CONFIG, tile_rows=_ROWS, tile_cols=_COLS)
PREFERENCE_SIMPO_CONFIG = PreferenceConfig.simpo(beta=2.0, gamma=0.5, label_smoothing=0.05)
PREFERENCE_SIMPO = preference_loss(PREFERENCE_SIMPO_CONFIG, tile_rows=_ROWS, tile_cols=_COLS)


def preference_context(ctx: OutputContext) -> PreferenceBatch:
    """The pairs (0, 1) and (2, 0) of the cases' three rows, the second counted only
    where rows 2 and 0 both count a token (the masked cases empty row 2); the reference's
    sums 0.3 to 0.9 away from the policy's: the margins -1.5 and 1.2 (times beta), far
    from a tie and from cancelling."""
    lp = current_logprobs(ctx)  # [b, s] float64
    labels = typing.cast(torch.Tensor, ctx.labels)
    counted = labels != ctx.ignore_index
    if ctx.loss_mask is not None:
        counted = counted & (typing.cast(torch.Tensor, ctx.loss_mask).to(labels.device) > 0)
    total = torch.where(counted, lp, 0.0).sum(-1)
    tokens = counted.sum(-1)
    chosen, rejected = torch.tensor([0, 2]), torch.tensor([1, 0])
    both = bool(tokens[2] > 0 and tokens[0] > 0)
    return PreferenceBatch(
        ref_chosen=(total[chosen] + torch.tensor([0.8, -0.9], dtype=total.dtype)).float(),
        ref_rejected=(total[rejected] + torch.tensor([-0.7, 0.3], dtype=total.dtype)).float(),
        chosen=chosen,
        rejected=rejected,
        pair_mask=torch.tensor([True, both]),
    )


def reference_free_context(ctx: OutputContext) -> PreferenceBatch:
    """:func:`preference_context` without the reference's sums (SimPO refuses them)."""
    return dataclasses.replace(preference_context(ctx), ref_chosen=None, ref_rejected=None)

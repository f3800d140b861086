"""Distillation to a teacher through the hook, without logits: :func:`distillation_loss`
with its configuration (:class:`DistillConfig`) and user contexts
(:class:`SparseTeacher`, :class:`DenseTeacher`), on the formulas of
``hookspec.conventions``.

The loss is a weighted sum of per-token divergences with weights known in
advance (the aggregations of ``policy_loss``, :func:`aggregation_weights`), so
its gradients are formed in the forward pass, tile by tile: a tile holds
``rows`` tokens by the whole local vocabulary, the student's (and the dense
teacher's) logits of that tile are formed, reduced over the vocab shards, turned
into the tile's logit gradient and dropped. ``backward`` scales the stored
gradients by the incoming one.

Bad values, one rule per kind (as ``policy_loss``): the mask is read at every
token (NaN, inf or negative: ``ContractError`` naming the mask, at once on a
CPU; on a GPU from a later check without a host read, the loss NaN until
then); the teacher's tensors are read at
counted tokens only; the student's hidden states and weight at every token (a
NaN anywhere makes the loss NaN).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import torch

from hookspec import (
    Aggregation,
    ContractError,
    DistillDivergence,
    OutputContext,
    Processor,
    TeacherTail,
    processor,
    validate_context,
)
from hookspec.arrays import format_shape

from ..value_checks import check_indices_deferred, check_labels_deferred
from ._checks import check_finite_number, check_floating, check_int, resolve_compute_dtype
from ._inputs import logit_scale, to_tokens
from ._policy import sequence_ids
from ._policy_math import aggregation_weights
from ._setup import refuse_double_backward

__all__ = [
    "DISTILL_TILE_ELEMENTS",
    "DenseTeacher",
    "DistillConfig",
    "SparseTeacher",
    "distillation_loss",
    "sparse_divergence",
]

DISTILL_TILE_ELEMENTS: dict[str, int] = {"cpu": 1 << 23, "cuda": 1 << 28}
"""``device.type -> logits per tile`` (rows x the local vocabulary) when not given:
32 MiB of fp32 per logits tile on a CPU, 1 GiB on a GPU (as ``fused_token_loss``)."""

_BIG_ID = 1 << 62


def _enum(field: str, kind: Any, value: Any) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise ContractError(field, expected=f"one of {[k.value for k in kind]}", actual=repr(value)) from None


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """The distillation loss (formulas in ``hookspec.conventions``)::

        D_t = divergence(P_t, Q_t)                 # per token t: forward-kl, reverse-kl, jsd(beta)
        loss = aggregate(D, M, aggregation)        # as policy_loss: token-mean, seq-mean-*

    ``temperature`` ``T > 0`` divides the student's logits and the dense
    teacher's (a sparse teacher's logprobs are taken as given: cache them at
    ``T``). ``beta``: JSD's weight, ``0 < beta < 1`` (read for ``jsd`` only).
    ``tail``: a sparse teacher's mass outside its ``k`` ids (read for the
    sparse form only). Checked at construction (``ContractError``).
    """

    divergence: DistillDivergence = DistillDivergence.FORWARD_KL
    beta: float = 0.5
    tail: TeacherTail = TeacherTail.RENORMALIZE
    temperature: float = 1.0
    aggregation: Aggregation = Aggregation.TOKEN_MEAN

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "divergence", _enum("divergence", DistillDivergence, self.divergence))
        put(self, "tail", _enum("tail", TeacherTail, self.tail))
        put(self, "aggregation", _enum("aggregation", Aggregation, self.aggregation))
        put(
            self,
            "beta",
            check_finite_number("beta", self.beta, low=0.0, high=1.0, low_open=True, high_open=True),
        )
        put(self, "temperature", check_finite_number("temperature", self.temperature, low=0.0, low_open=True))


@dataclasses.dataclass(frozen=True)
class SparseTeacher:
    """The user context of the sparse form: the teacher's top-k per token (say,
    ``topk_logprobs(k)`` of a teacher, cached), ``[b, s, k]`` each.

    ``ids``: global token ids (the first is the teacher's top-1); ``logprobs``:
    its logprobs there, at the distillation temperature. ``mask``: ``[b, s]``
    weights (``None``: the model's ``loss_mask``, else every token; tokens
    labelled ``ignore_index`` never count). ``global_tokens`` /
    ``global_sequences``: as :class:`PolicyBatch`'s (counts over the ranks
    that share the loss). Read at counted tokens only.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor | None = None
    global_tokens: float | None = None
    global_sequences: float | None = None


@dataclasses.dataclass(frozen=True)
class DenseTeacher:
    """The user context of the dense form: the teacher's final hidden states and
    its output weight shard.

    ``hidden_states``: ``[s, b, h_t]`` in the layout of the student's
    ``ctx.hidden_states`` (``[s/tp, b, h_t]`` under sequence parallel);
    ``weight``: ``[V_local, h_t]``, the same vocabulary rows as the student's
    shard. ``h_t`` may differ from the student's. No gradient reaches them.
    ``mask``, ``global_tokens``, ``global_sequences``: as :class:`SparseTeacher`.
    """

    hidden_states: torch.Tensor
    weight: torch.Tensor
    mask: torch.Tensor | None = None
    global_tokens: float | None = None
    global_sequences: float | None = None


# ---------------------------------------------------------------- per-token maths


def _xlogy_terms(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(w * (a - b))`` over the last dim, a term whose ``w`` is 0 being 0 (a NaN
    ``w`` stays NaN)."""
    return torch.where(w == 0, 0.0, w * (a - b)).sum(-1)


def divergence_of(
    log_p: torch.Tensor, log_q: torch.Tensor, kind: DistillDivergence, beta: float
) -> torch.Tensor:
    """``D(P, Q)`` over the last dim of ``log P`` and ``log Q`` (``hookspec.conventions``)."""
    p, q = torch.exp(log_p), torch.exp(log_q)
    if kind == DistillDivergence.FORWARD_KL:
        return _xlogy_terms(p, log_p, log_q)
    if kind == DistillDivergence.REVERSE_KL:
        return _xlogy_terms(q, log_q, log_p)
    log_m = torch.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
    return beta * _xlogy_terms(p, log_p, log_m) + (1 - beta) * _xlogy_terms(q, log_q, log_m)


def sparse_divergence(
    teacher_logprobs: torch.Tensor,
    student_logits: torch.Tensor,
    student_lse: torch.Tensor | None,
    /,
    *,
    divergence: DistillDivergence,
    tail: TeacherTail,
    beta: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D, forward KL)`` per token ``[...]`` of a sparse teacher, from
    ``teacher_logprobs`` ``lp_t [..., k]``, the student's tempered logits at the
    teacher's ids ``u [..., k]`` and its full-vocabulary ``logsumexp(z / T)``
    ``[...]`` (needed for ``tail="bucket"`` only)::

        renormalize: log P = lp_t - logsumexp(lp_t);  log Q = u - logsumexp(u)
        bucket:      log P = [lp_t, log(max(1 - sum(exp(lp_t)), 0))]
                     log Q = [u - lse, log(max(-expm1(logsumexp(u) - lse), tiny))]
        D = divergence(log P, log Q)

    Differentiable in ``u`` and ``lse``.
    """
    lp_t = teacher_logprobs.to(student_logits.dtype)
    if tail == TeacherTail.RENORMALIZE:
        log_p = lp_t - torch.logsumexp(lp_t, -1, keepdim=True)
        log_q = student_logits - torch.logsumexp(student_logits, -1, keepdim=True)
    else:
        if student_lse is None:
            raise ContractError(
                "student_lse", expected="the student's logsumexp (tail 'bucket')", actual="None"
            )
        log_q_ids = student_logits - student_lse[..., None]
        tiny = torch.finfo(log_q_ids.dtype).tiny
        p_tail = (1 - torch.exp(lp_t).sum(-1)).clamp_min(0.0)
        q_tail = (-torch.expm1(torch.logsumexp(log_q_ids, -1))).clamp_min(tiny)
        log_p = torch.cat([lp_t, torch.log(p_tail)[..., None]], -1)
        log_q = torch.cat([log_q_ids, torch.log(q_tail)[..., None]], -1)
    d = divergence_of(log_p, log_q, divergence, beta)
    kl = (
        d
        if divergence == DistillDivergence.FORWARD_KL
        else divergence_of(log_p, log_q, DistillDivergence.FORWARD_KL, beta)
    )
    return d, kl


# ---------------------------------------------------------------- the fused pass


@dataclasses.dataclass(frozen=True)
class _DistillSetup:
    config: DistillConfig
    weights: torch.Tensor  # [n]: the aggregation weight of each token (0: not counted)
    inv_t: float  # the student's: logit scale / T
    teacher_inv_t: float  # the teacher's: 1 / T
    vocab_start: int
    collectives: Any
    compute_dtype: torch.dtype
    acc_dtype: torch.dtype
    rows: int
    teacher_ids: torch.Tensor | None  # [n, k] (sparse), 0 at uncounted tokens
    teacher_logprobs: torch.Tensor | None  # [n, k] (sparse), -log k at uncounted tokens
    teacher_hidden: torch.Tensor | None  # [n, h_t] (dense), detached
    teacher_weight: torch.Tensor | None  # [V_local, h_t] (dense), detached


def _reduce_max(setup: _DistillSetup, x: torch.Tensor) -> torch.Tensor:
    return setup.collectives.all_reduce_max(x) if setup.collectives is not None else x


def _reduce_sum(setup: _DistillSetup, x: torch.Tensor) -> torch.Tensor:
    return setup.collectives.all_reduce_sum(x) if setup.collectives is not None else x


def _tile_logits(x: torch.Tensor, w: torch.Tensor, setup: _DistillSetup, inv_t: float) -> torch.Tensor:
    z = torch.mm(x.to(setup.compute_dtype), w.to(setup.compute_dtype).T).to(setup.acc_dtype)
    return z.mul_(inv_t) if inv_t != 1.0 else z


def _argmax_ids(setup: _DistillSetup, z: torch.Tensor, big_m: torch.Tensor) -> torch.Tensor:
    """The global argmax of each row over the shards (ties: the smaller id), given the
    rows' global max ``big_m`` (already reduced)."""
    local_max, local_arg = z.max(1)  # the first maximal column
    cand = torch.where(local_max == big_m, local_arg + setup.vocab_start, _BIG_ID)
    return -_reduce_max(setup, -cand)


def _dense_tile(
    setup: _DistillSetup, zs: torch.Tensor, zt: torch.Tensor, rows: slice
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(D [r], KL [r], agree [r], lse_s [r], dD/dz_s [r, V_local])`` of a dense tile."""
    cfg = setup.config
    big = _reduce_max(setup, torch.stack([zs.amax(1), zt.amax(1)]))
    ms, mt = big[0], big[1]
    agree = _argmax_ids(setup, zs, ms) == _argmax_ids(setup, zt, mt)
    ls, lt = zs - ms[:, None], zt - mt[:, None]  # shifted
    es, et = torch.exp(ls), torch.exp(lt)
    diff = lt - ls
    sums = _reduce_sum(setup, torch.stack([es.sum(1), et.sum(1), (et * diff).sum(1), (es * diff).sum(1)]))
    log_ss, log_st = torch.log(sums[0]), torch.log(sums[1])
    # log p - log q = (lt - log St) - (ls - log Ss) = diff + (log Ss - log St)
    shift = log_ss - log_st
    kl = sums[2] / sums[1] + shift
    q = es / sums[0][:, None]
    p = et / sums[1][:, None]
    lse_s = ms + log_ss
    if cfg.divergence == DistillDivergence.FORWARD_KL:
        return kl, kl, agree, lse_s, q - p
    if cfg.divergence == DistillDivergence.REVERSE_KL:
        rkl = -(sums[3] / sums[0]) - shift
        a = -(diff + shift[:, None])  # log q - log p
        return rkl, kl, agree, lse_s, q * (a - rkl[:, None])
    beta = cfg.beta
    log_p, log_q = lt - log_st[:, None], ls - log_ss[:, None]
    log_m = torch.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
    a = (1 - beta) * (log_q - log_m)  # dD/dq
    terms = beta * torch.where(p == 0, 0.0, p * (log_p - log_m)) + torch.where(q == 0, 0.0, q * a)
    sums2 = _reduce_sum(setup, torch.stack([terms.sum(1), (q * a).sum(1)]))
    return sums2[0], kl, agree, lse_s, q * (a - sums2[1][:, None])


def _sparse_tile(
    setup: _DistillSetup, zs: torch.Tensor, rows: slice
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(D, KL, agree, lse_s, dD/du [r, k], dD/dlse [r], cols [r, k])`` of a sparse
    tile (``cols``: the teacher ids' local columns, -1 in other shards)."""
    cfg = setup.config
    assert setup.teacher_ids is not None and setup.teacher_logprobs is not None
    ids, lp_t = setup.teacher_ids[rows], setup.teacher_logprobs[rows]
    ms = _reduce_max(setup, zs.amax(1))
    agree = _argmax_ids(setup, zs, ms) == ids[:, 0]
    local = ids - setup.vocab_start
    cols = torch.where((local >= 0) & (local < zs.shape[1]), local, -1)
    picked = torch.where(cols >= 0, zs.gather(1, cols.clamp(min=0)), 0.0)
    sums = _reduce_sum(setup, torch.cat([torch.exp(zs - ms[:, None]).sum(1, keepdim=True), picked], 1))
    lse_s = ms + torch.log(sums[:, 0])
    with torch.enable_grad():
        u = sums[:, 1:].detach().requires_grad_()
        lse = lse_s.detach().requires_grad_()
        d, kl = sparse_divergence(lp_t, u, lse, divergence=cfg.divergence, tail=cfg.tail, beta=cfg.beta)
        w = setup.weights[rows].to(d.dtype)
        gu, glse = torch.autograd.grad((torch.where(w != 0, d, 0.0) * w).sum(), (u, lse), allow_unused=True)
    glse = torch.zeros_like(lse_s) if glse is None else glse
    return d.detach(), kl.detach(), agree, lse_s, gu, glse, cols


class _FusedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, setup: _DistillSetup) -> tuple[torch.Tensor, ...]:
        hd, wd = h.detach(), w.detach()
        n = hd.shape[0]
        acc = setup.acc_dtype
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.zeros(hd.shape, dtype=acc, device=hd.device) if need_dh else None
        dw = torch.zeros(wd.shape, dtype=acc, device=wd.device) if need_dw else None
        loss = torch.zeros((), dtype=acc, device=hd.device)
        kl_all = torch.zeros(n, dtype=acc, device=hd.device)
        agree_all = torch.zeros(n, dtype=torch.bool, device=hd.device)
        lse_all = torch.zeros(n, dtype=acc, device=hd.device)
        sparse = setup.teacher_ids is not None
        renormalized = sparse and setup.config.tail == TeacherTail.RENORMALIZE
        wc = wd.to(setup.compute_dtype)
        for i0 in range(0, n, setup.rows):
            rows = slice(i0, min(i0 + setup.rows, n))
            x = hd[rows]
            zs = _tile_logits(x, wd, setup, setup.inv_t)  # GEMM 1: the student's logits tile
            wts = setup.weights[rows].to(acc)
            if sparse:
                d, kl, agree, lse_s, gu, glse, cols = _sparse_tile(setup, zs, rows)
                gu = torch.where(cols >= 0, gu, 0.0) * setup.inv_t
                if renormalized:  # no full-vocabulary term: k columns per row, no GEMM
                    safe = cols.clamp(min=0)
                    if dh is not None:
                        dh[rows] += torch.bmm(gu.unsqueeze(1), wd[safe].to(acc)).squeeze(1)
                    if dw is not None:
                        contrib = gu.unsqueeze(2) * x.to(acc).unsqueeze(1)
                        dw.index_add_(0, safe.reshape(-1), contrib.reshape(-1, x.shape[1]))
                    gz = None
                else:  # dD/dz = dD/du at the ids + dD/dlse * softmax(z)
                    gz = torch.exp(zs - lse_s[:, None]).mul_(glse[:, None] * setup.inv_t)
                    gz.scatter_add_(1, cols.clamp(min=0), gu)
            else:
                assert setup.teacher_hidden is not None and setup.teacher_weight is not None
                zt = _tile_logits(
                    setup.teacher_hidden[rows], setup.teacher_weight, setup, setup.teacher_inv_t
                )
                d, kl, agree, lse_s, gz = _dense_tile(setup, zs, zt, rows)  # zt: the teacher GEMM
                del zt
                live = wts[:, None] != 0  # a teacher NaN at an uncounted token stays out
                gz = torch.where(live, gz * (wts[:, None] * setup.inv_t), 0.0)
            if gz is not None:
                gzc = gz.to(setup.compute_dtype)
                xc = x.to(setup.compute_dtype)
                if dh is not None:
                    dh[rows] += torch.mm(gzc, wc).to(acc)  # GEMM 2
                if dw is not None:  # GEMM 3, accumulated in place
                    if gzc.dtype == dw.dtype:
                        dw.addmm_(gzc.T, xc)
                    else:
                        dw += torch.mm(gzc.T, xc).to(acc)
            loss = loss + (torch.where(wts != 0, d, 0.0) * wts).sum()
            kl_all[rows], agree_all[rows], lse_all[rows] = kl, agree, lse_s
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(dh, dw)
        ctx.dtypes = (h.dtype, w.dtype)
        ctx.mark_non_differentiable(kl_all, agree_all, lse_all)
        return loss, kl_all, agree_all, lse_all

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None, *_: Any) -> tuple[Any, ...]:
        refuse_double_backward("distillation_loss")
        dh, dw = ctx.saved_tensors
        if g is None:
            return None, None, None
        gh = (dh * g).to(ctx.dtypes[0]) if dh is not None else None
        gw = (dw * g).to(ctx.dtypes[1]) if dw is not None else None
        return gh, gw, None


# ---------------------------------------------------------------- the processor


def _check_shape(field: str, value: Any, want: tuple[int, ...], expected: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise ContractError(field, expected=f"a torch.Tensor {expected}", actual=type(value).__name__)
    if tuple(value.shape) != want:
        raise ContractError(field, expected=f"shape {expected}", actual=format_shape(value.shape))


def _teacher(ctx: OutputContext) -> SparseTeacher | DenseTeacher:
    teacher = ctx.context
    if not isinstance(teacher, (SparseTeacher, DenseTeacher)):
        raise ContractError(
            "context",
            expected="a torch_impl.processors.SparseTeacher or DenseTeacher (output_processor_context=)",
            actual=type(teacher).__name__,
        )
    return teacher


def _counts(teacher: SparseTeacher | DenseTeacher, how: Aggregation, cp: int) -> None:
    for name in ("global_tokens", "global_sequences"):
        value = getattr(teacher, name)
        if value is not None:
            check_finite_number(f"context.{name}", value, low=0.0, low_open=True)
    if cp > 1:
        if how == Aggregation.SEQ_MEAN_TOKEN_MEAN:
            raise ContractError(
                "parallel.cp_size", expected="1 for seq-mean-token-mean (it needs whole sequences)", actual=cp
            )
        need = "global_tokens" if how == Aggregation.TOKEN_MEAN else "global_sequences"
        if getattr(teacher, need) is None:
            raise ContractError(
                f"context.{need}",
                expected=f"the count over the context-parallel ranks (cp={cp}), so that their losses sum",
                actual="None",
            )


def distillation_loss(
    config: DistillConfig | None = None,
    /,
    *,
    tile_elements: int | None = None,
    compute_dtype: torch.dtype | None = None,
) -> Processor:
    """A processor returning the distillation loss and its metrics, scalars::

        {"loss": aggregate(D, M, aggregation),     # D: the config's divergence per token
         "kl": token-mean over M of KL(teacher || student),
         "top1_agreement": token-mean over M of [argmax student == teacher's top-1]}

    with the teacher in the user context: :class:`SparseTeacher` (its top-k ids
    and logprobs) or :class:`DenseTeacher` (its hidden states and output weight
    shard). ``M``: the context's ``mask``, else the model's ``loss_mask``, else
    every token; 0 where the label is the ignore index. Formulas:
    ``hookspec.conventions`` (divergences, the two tails, agreement); the
    metrics carry no gradient; no gradient reaches the teacher.

    Cost per tile of ``rows`` tokens (``rows = tile_elements // V_local``;
    ``tile_elements`` default per device, :data:`DISTILL_TILE_ELEMENTS`), as a
    scalar loss with its gradient formed in the forward pass:

    - dense: three student GEMMs (logits, ``dh = gz @ W``, ``dW = gz.T @ h``)
      and one teacher GEMM (its logits); nothing recomputed in backward;
    - sparse, ``tail="bucket"``: the three student GEMMs;
    - sparse, ``tail="renormalize"``: one student GEMM (the logits, for the
      agreement and the shards' reduction); the gradient reaches only the
      ``k`` ids' rows of ``W`` (``O(rows k h)``, no GEMM).

    Vocab parallel: per tile one all-reduce max, one or two all-reduce sums
    and one all-reduce max of the argmax candidates over the shards.
    """
    config = DistillConfig() if config is None else config
    if not isinstance(config, DistillConfig):
        raise ContractError("config", expected="a DistillConfig", actual=type(config).__name__)
    if tile_elements is not None:
        tile_elements = check_int("tile_elements", tile_elements, low=1)

    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        if not isinstance(ctx, OutputContext):
            raise ContractError(
                "processor 'distillation_loss'",
                expected="a hookspec.OutputContext",
                actual=type(ctx).__name__,
            )
        if ctx.vocab_weight is None or ctx.vocab is None:
            raise ContractError(
                "vocab_weight", expected="the output weight shard [V_local, h]", actual="None"
            )
        hs = check_floating("hidden_states", ctx.hidden_states)
        validate_context(ctx, check_values=False)
        teacher = _teacher(ctx)
        coll = ctx.collectives
        h = coll.gather_hidden_states(hs) if coll is not None else hs
        s, b = int(h.shape[0]), int(h.shape[1])
        weight = typing.cast(torch.Tensor, ctx.vocab_weight)
        device = hs.device
        labels = None if ctx.labels is None else typing.cast(torch.Tensor, ctx.labels).to(device)
        if labels is not None and ctx.check_values and not ctx.labels_checked:
            check_labels_deferred(labels, ctx.vocab.size, ignore_index=ctx.ignore_index)
        _counts(teacher, config.aggregation, ctx.parallel.cp_size)
        cdtype = resolve_compute_dtype(device, hs.dtype, compute_dtype)
        acc = torch.float64 if cdtype == torch.float64 else torch.float32
        given = teacher.mask if teacher.mask is not None else ctx.loss_mask
        if given is not None:
            _check_shape("context.mask", given, (b, s), f"[b={b}, s={s}]")
        mask = (
            torch.ones(b, s, dtype=acc, device=device)
            if given is None
            else typing.cast(torch.Tensor, given).to(device=device, dtype=acc)
        )
        if labels is not None:
            mask = torch.where(labels == ctx.ignore_index, mask * 0.0, mask)
        segments, count = sequence_ids(ctx, b, s, device)
        weights = aggregation_weights(
            mask,
            segments,
            count,
            config.aggregation,
            global_tokens=teacher.global_tokens,
            global_sequences=teacher.global_sequences,
        )
        w_rows = to_tokens(weights)
        counted = w_rows != 0
        t_ids = t_lp = t_h = t_w = None
        if isinstance(teacher, SparseTeacher):
            if not isinstance(teacher.ids, torch.Tensor) or teacher.ids.dim() != 3:
                raise ContractError(
                    "context.ids", expected=f"an integer tensor [b={b}, s={s}, k]", actual=_shape(teacher.ids)
                )
            k = int(teacher.ids.shape[2])
            if teacher.ids.dtype.is_floating_point or teacher.ids.dtype == torch.bool:
                raise ContractError("context.ids", expected="an integer dtype", actual=str(teacher.ids.dtype))
            _check_shape("context.ids", teacher.ids, (b, s, k), f"[b={b}, s={s}, k]")
            check_floating("context.logprobs", teacher.logprobs)
            _check_shape("context.logprobs", teacher.logprobs, (b, s, k), f"[b={b}, s={s}, k={k}] like ids")
            if k < 1:
                raise ContractError("context.ids", expected="k >= 1 ids per token", actual="k = 0")
            ids = teacher.ids.transpose(0, 1).reshape(-1, k).to(device=device, dtype=torch.long)
            # An uncounted token's teacher is never read: a stand-in there (k distinct
            # ids of mass 1 / (k + 1) each) keeps every term and gradient finite.
            stand_in = torch.arange(k, device=device) % ctx.vocab.size
            ids = torch.where(counted[:, None], ids, stand_in)
            if ctx.check_values:
                check_indices_deferred(ids, ctx.vocab.size, field="context.ids")
            lp = teacher.logprobs.detach().transpose(0, 1).reshape(-1, k).to(device=device, dtype=acc)
            t_ids, t_lp = ids, torch.where(counted[:, None], lp, -math.log(k + 1))
        else:
            th, tw = teacher.hidden_states, teacher.weight
            check_floating("context.hidden_states", th)
            check_floating("context.weight", tw)
            if th.dim() != 3 or tuple(th.shape[:2]) != tuple(hs.shape[:2]):
                raise ContractError(
                    "context.hidden_states",
                    expected=f"shape [{hs.shape[0]}, {hs.shape[1]}, h_t] like ctx.hidden_states",
                    actual=format_shape(th.shape),
                )
            if tw.dim() != 2 or tw.shape[0] != weight.shape[0] or tw.shape[1] != th.shape[2]:
                raise ContractError(
                    "context.weight",
                    expected=f"shape [V_local={weight.shape[0]}, h_t={th.shape[2]}]",
                    actual=format_shape(tw.shape),
                )
            th = th.detach().to(device)
            th = coll.gather_hidden_states(th) if coll is not None else th
            t_h, t_w = th.reshape(-1, th.shape[-1]).detach(), tw.detach().to(device)
        local = int(weight.shape[0])
        setup = _DistillSetup(
            config=config,
            weights=w_rows,
            inv_t=logit_scale(ctx) / config.temperature,
            teacher_inv_t=1.0 / config.temperature,
            vocab_start=ctx.vocab.start,
            collectives=coll,
            compute_dtype=cdtype,
            acc_dtype=acc,
            rows=max(1, _tile(tile_elements, device) // local),
            teacher_ids=t_ids,
            teacher_logprobs=t_lp,
            teacher_hidden=t_h,
            teacher_weight=t_w,
        )
        loss, kl, agree, lse = _FusedDistill.apply(h.reshape(-1, h.shape[-1]), weight, setup)
        m_rows = to_tokens(mask)
        total = m_rows.sum()
        denom = torch.where(total == 0, 1.0, total)
        return {
            # + 0 * sum(lse): NaN where the student's hidden states or weight hold NaN/inf anywhere
            "loss": loss + 0.0 * lse.sum(),
            "kl": (torch.where(m_rows > 0, kl, 0.0) * m_rows).sum() / denom,
            "top1_agreement": (torch.where(m_rows > 0, agree.to(acc), 0.0) * m_rows).sum() / denom,
        }

    return processor(fn, name="distillation_loss")


def _tile(given: int | None, device: torch.device) -> int:
    return (
        given if given is not None else DISTILL_TILE_ELEMENTS.get(device.type, DISTILL_TILE_ELEMENTS["cuda"])
    )


def _shape(x: Any) -> str:
    return format_shape(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__

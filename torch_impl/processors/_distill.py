"""Distillation to a teacher without logits: :func:`linear_distillation_loss`, the
processor :func:`distillation_loss` and :class:`DistillConfig`, on the formulas of
``hookspec.conventions``; the teachers are :mod:`._teachers`. The gradients are formed
in the forward pass by two epilogues on the engine's row sweep (``docs/processors.md``'s
"Distillation": their GEMMs and bad-value rules).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from typing import Any, NamedTuple, Never

import torch

from hookspec import (
    TAIL_FLOOR,
    Aggregation,
    ContractError,
    DistillDivergence,
    OutputContext,
    Processor,
    TeacherTail,
    VocabShard,
    processor,
)

from ..value_checks import check_finite_deferred, check_indices_deferred, checked_call
from ._checks import check_enum, check_finite_number, check_instance, check_int
from ._engine import Engine, FormedInForward, TileSetup
from ._gemm import gemm_into, no_autocast, not_traced, scaled_
from ._inputs import counted_mask, hook_inputs, sequence_ids, to_tokens
from ._loss_math import (
    check_counts,
    count_read,
    global_counts,
    masked_mean,
    weighted_sum,
    weights_of,
)
from ._options import LinearOptions, prologue, refuse_unexpected
from ._sink import GradSink
from ._teachers import DenseTeacher, SparseTeacher, check_rows
from ._tiles import cap_factor, soft_cap_

__all__ = [
    "DenseTeacher",
    "DistillConfig",
    "DistillResult",
    "SparseTeacher",
    "distillation_loss",
    "linear_distillation_loss",
]


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """The distillation loss (formulas in ``hookspec.conventions``)::

        D_t = divergence(P_t, Q_t)                 # per token t: forward-kl, reverse-kl, jsd(beta)
        loss = aggregate(D, M, aggregation)        # as policy_loss: token-mean, seq-mean-*

    ``temperature`` ``T > 0`` divides the student's logits and the dense teacher's (a
    sparse teacher's logprobs are taken as given: cache them at ``T``); no ``T**2``
    factor. ``beta``: JSD's weight, ``0 < beta < 1`` (read for ``jsd`` only). ``tail``: a
    sparse teacher's mass outside its ``k`` ids. Checked at construction (``ContractError``).
    """

    divergence: DistillDivergence = DistillDivergence.FORWARD_KL
    beta: float = 0.5
    tail: TeacherTail = TeacherTail.RENORMALIZE
    temperature: float = 1.0
    aggregation: Aggregation = Aggregation.TOKEN_MEAN

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "divergence", check_enum("divergence", DistillDivergence, self.divergence))
        put(self, "tail", check_enum("tail", TeacherTail, self.tail))
        put(self, "aggregation", check_enum("aggregation", Aggregation, self.aggregation))
        if self.aggregation == Aggregation.SEQ_MEAN_TOKEN_SUM_NORM:
            raise ContractError(
                "aggregation",
                expected="not 'seq-mean-token-sum-norm' (Dr. GRPO's constant divides the policy "
                "loss, whose batch has a padded length; use 'seq-mean-token-sum')",
                actual=repr(self.aggregation.value),
            )
        beta = check_finite_number(
            "beta", self.beta, low=0.0, high=1.0, low_open=True, high_open=True
        )
        put(self, "beta", beta)
        put(
            self,
            "temperature",
            check_finite_number("temperature", self.temperature, low=0.0, low_open=True),
        )


# ---------------------------------------------------------------- per-token maths


def _xlogy_terms(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(w * (a - b))`` over the last dim, a term whose ``w`` is 0 being 0 (NaN: NaN)."""
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


def _sparse_divergence(
    lp_t: torch.Tensor,
    u: torch.Tensor,
    lse: torch.Tensor,
    log_tail: torch.Tensor | None,
    cfg: DistillConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D, forward KL)`` per token ``[r]`` of a sparse teacher, from its logprobs
    ``lp_t [r, k]``, the student's tempered logits at the teacher's ids ``u [r, k]``,
    its ``lse = logsumexp(z / T)`` ``[r]`` and (bucket) ``log_tail`` ``[r]``::

        renormalize: log P = lp_t - logsumexp(lp_t);  log Q = u - logsumexp(u)
        bucket:      log P = [lp_t, log(max(-expm1(logsumexp(lp_t)), TAIL_FLOOR))]
                     log Q = [u - lse, log_tail]
        log_tail = log(max(q_tail, TAIL_FLOOR)),  q_tail = -expm1(logsumexp(u) - lse)
        D = divergence(log P, log Q)

    ``q_tail`` summed outside the ids (:func:`_outside`), ``log_tail`` a leaf whose gradient
    the caller carries to the logits (``d log q_tail / dz_j = [j outside] q_j / q_tail - q_j``).
    Differentiable in ``u``, ``lse``, ``log_tail``. The teacher's tail is formed in float64.
    """
    lp = lp_t.to(u.dtype)
    if cfg.tail == TeacherTail.RENORMALIZE:
        log_p = lp - torch.logsumexp(lp, -1, keepdim=True)
        log_q = u - torch.logsumexp(u, -1, keepdim=True)
    else:
        assert log_tail is not None
        p_tail = -torch.expm1(torch.logsumexp(lp_t.double(), -1))
        log_p = torch.cat([lp, torch.log(p_tail.clamp_min(TAIL_FLOOR)).to(lp.dtype)[..., None]], -1)
        log_q = torch.cat([u - lse[..., None], log_tail.to(u.dtype)[..., None]], -1)
    d = divergence_of(log_p, log_q, cfg.divergence, cfg.beta)
    forward = DistillDivergence.FORWARD_KL
    return d, (d if cfg.divergence == forward else divergence_of(log_p, log_q, forward, cfg.beta))


# ---------------------------------------------------------------- the epilogues


class _Outputs(NamedTuple):
    """What the epilogues write: the loss ``[]`` and per token ``[n]`` (acc dtype)."""

    loss: torch.Tensor
    kl: torch.Tensor
    agree: torch.Tensor
    lse: torch.Tensor

    def record(self, rows: slice, loss: torch.Tensor, *per_token: torch.Tensor) -> None:
        self.loss.add_(loss.to(self.loss.dtype))
        self.kl[rows], self.agree[rows], self.lse[rows] = per_token


def _argmax_ids(
    setup: TileSetup, local: tuple[torch.Tensor, ...], big_m: torch.Tensor
) -> torch.Tensor:
    """The global argmax of each row over the shards (ties: the smaller id), from this
    shard's ``(max, argmax)`` of the tempered tile and the rows' global max ``big_m``."""
    local_max, local_arg = local
    cand = torch.where(local_max == big_m, local_arg + setup.vocab_start, 1 << 62)
    return -setup.reduce_max(-cand)


def _dense_terms(
    setup: TileSetup, cfg: DistillConfig, zs: torch.Tensor, zt: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(D [r], KL [r], agree [r], lse_s [r], dD/dz_s [r, V_local])`` of a dense tile
    (tempered logits of the student ``zs`` and the teacher ``zt``)."""
    local_s, local_t = zs.max(1), zt.max(1)  # (max, argmax): one pass over each tile
    ms, mt = setup.reduce_max(torch.stack([local_s[0], local_t[0]]))
    agree = _argmax_ids(setup, local_s, ms) == _argmax_ids(setup, local_t, mt)
    ls, lt = zs.sub_(ms[:, None]), zt.sub_(mt[:, None])  # shifted, in place
    es, et = torch.exp(ls), torch.exp(lt)
    diff = lt - ls
    sums = setup.reduce_sum(
        torch.stack([es.sum(1), et.sum(1), (et * diff).sum(1), (es * diff).sum(1)])
    )
    log_ss, log_st = torch.log(sums[0]), torch.log(sums[1])
    shift = log_ss - log_st  # log p - log q = diff + shift
    kl = sums[2] / sums[1] + shift
    q = es.div_(sums[0][:, None])
    lse_s = ms + log_ss
    if cfg.divergence == DistillDivergence.FORWARD_KL:
        return kl, kl, agree, lse_s, q.sub_(et.div_(sums[1][:, None]))
    if cfg.divergence == DistillDivergence.REVERSE_KL:
        rkl = -(sums[3] / sums[0]) - shift
        a = -(diff + shift[:, None])  # log q - log p
        return rkl, kl, agree, lse_s, q * (a - rkl[:, None])
    beta, p = cfg.beta, et / sums[1][:, None]
    log_p, log_q = lt - log_st[:, None], ls - log_ss[:, None]
    log_m = torch.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
    a = (1 - beta) * (log_q - log_m)  # dD/dq
    terms = beta * torch.where(p == 0, 0.0, p * (log_p - log_m)) + torch.where(q == 0, 0.0, q * a)
    sums2 = setup.reduce_sum(torch.stack([terms.sum(1), (q * a).sum(1)]))
    return sums2[0], kl, agree, lse_s, q * (a - sums2[1][:, None])


Epilogue = Callable[[torch.Tensor, slice, GradSink], None]


def _outside(
    setup: TileSetup, e: torch.Tensor, sumexp: torch.Tensor, cols: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(listed [r, V_local] bool, q_out [r])``: the columns ``cols`` ``[r, k]`` name (local,
    -1 elsewhere; distinct), and the probability of all others, ``e = exp(z - M)`` of the
    tile summed over those entries and the shards: no ``1 - sum`` to cancel."""
    here = (cols >= 0).to(torch.uint8)
    listed = torch.zeros(e.shape, dtype=torch.uint8, device=cols.device)
    listed = listed.scatter_reduce_(
        1, cols.clamp(min=0), here, "amax"
    ).bool()  # -1s land on 0 without a 1
    return listed, setup.reduce_sum(torch.where(listed, 0.0, e).sum(1)) / sumexp


def _dense_epilogue(
    eng: Engine, cfg: DistillConfig, teacher: DenseTeacher, weights: torch.Tensor, out: _Outputs
) -> Epilogue:
    setup = eng.setup
    t_hidden, t_weight = (
        x.to(setup.compute_dtype) for x in (teacher.hidden_states, teacher.weight)
    )
    t_inv = teacher.logit_scale / cfg.temperature
    t_cap = cap_factor(teacher.logit_scale, teacher.softcap, setup.acc_dtype)

    def epilogue(z: torch.Tensor, rows: slice, sink: GradSink) -> None:
        zs = eng.logits_of(z, rows, inplace=True)
        slope = (
            eng.cap_slope_of(zs, rows) if sink.active else 1.0
        )  # a softcap's, before zs is shifted
        zt = eng.buffer("teacher", zs.shape[0], zs.shape[1], setup.acc_dtype)
        gemm_into(zt, t_hidden[rows], t_weight.T, first=True)
        if t_cap is not None:  # its own softcap: s_t * tanh(u_t * c_t / s_t) / c_t
            soft_cap_(zt, t_cap, eng.like("teacher_tanh", zt))
        scaled_(zt, t_inv)  # the teacher's temperature and logit scale
        d, kl, agree, lse, gz = _dense_terms(setup, cfg, zs, zt)
        w = weights[rows]
        if sink.active:  # a teacher NaN at an uncounted token stays out
            sink.put(rows, torch.where(w[:, None] != 0, gz * (w[:, None] * slope), 0.0))
        out.record(rows, weighted_sum(d, w), kl, agree, lse)

    return epilogue


def _sparse_epilogue(
    eng: Engine, cfg: DistillConfig, teacher: SparseTeacher, weights: torch.Tensor, out: _Outputs
) -> Epilogue:
    setup = eng.setup

    def epilogue(z: torch.Tensor, rows: slice, sink: GradSink) -> None:
        ids, lp_t, w = teacher.ids[rows], teacher.logprobs[rows], weights[rows]
        local = ids - setup.vocab_start
        cols = torch.where((local >= 0) & (local < eng.local), local, -1)
        capped = setup.cap_k is not None  # the capped tile (Triton: a copy): its ties, not u's
        zc = eng.logits_of(z, rows) if capped else z
        local_max, local_arg = zc.max(1)  # the first maximal column of the fresh tile
        top = (local_max if capped else eng.logits_of(local_max, rows), local_arg)
        picked = zc.gather(1, cols.clamp(min=0))
        picked = picked if capped else eng.logits_of(picked, rows)
        bucket = capped and sink.active and cfg.tail == TeacherTail.BUCKET
        slope = eng.cap_slope_of(zc, rows) if bucket else 1.0  # for the bucket's gz
        u = setup.reduce_sum(torch.where(cols >= 0, picked, 0.0))  # each id lives in one shard
        stats, e = eng.row_stats(z, rows, with_entropy=False, exps=cfg.tail == TeacherTail.BUCKET)
        if e is not None and capped and eng.triton:  # the kernels' tanh is not torch's: S of this e
            stats = dataclasses.replace(stats, sumexp=setup.reduce_sum(e.sum(1)))
        lse = stats.lse
        listed, q_out = (None, None) if e is None else _outside(setup, e, stats.sumexp, cols)
        need = sink.active  # no autograd where no gradient is wanted (inference mode included)
        with torch.set_grad_enabled(need):
            u_, lse_ = u.detach().requires_grad_(need), lse.detach().requires_grad_(need)
            lqt_ = (
                None
                if q_out is None
                else torch.log(q_out.clamp_min(TAIL_FLOOR)).requires_grad_(need)
            )
            d, kl = _sparse_divergence(lp_t, u_, lse_, lqt_, cfg)
            total = weighted_sum(d, w)
            leaves = (u_, lse_) if lqt_ is None else (u_, lse_, lqt_)
            grads = torch.autograd.grad(total, leaves, materialize_grads=True) if need else ()
        # with a softcap the kernels' tanh may differ from torch's in the last bit: the top's
        # own max
        big_m = setup.reduce_max(top[0]) if capped and eng.triton else stats.max
        agree = _argmax_ids(setup, top, big_m) == ids[:, 0]
        out.record(rows, total.detach(), kl.detach(), agree, lse)
        if not need:
            return
        gu, glse = grads[:2]
        if cfg.tail == TeacherTail.RENORMALIZE:  # the k ids only: no logit gradient tile
            sink.add_sparse(rows, cols, gu * eng.cap_slope_of(picked, rows))
            return
        assert q_out is not None and e is not None and listed is not None
        gt = torch.where(
            q_out < TAIL_FLOOR, 0.0, grads[2]
        )  # 0 where the floor holds it (as clamp_min's)
        # dD/dz_j = gu_j [j in ids] + (glse - gt) q_j + gt [j outside] q_j / q_tail: the last
        # term over the outside entries alone (the earlier gu + glse q_j at the ids summed
        # terms of size p_tail / q_tail that cancel: 65536 in float64 for 0.28)
        q = e / stats.sumexp[:, None]  # the student's probabilities in this shard
        outside = torch.where(listed, 0.0, q / q_out.clamp_min(TAIL_FLOOR)[:, None])
        gz = q * (glse - gt)[:, None] + outside * gt[:, None]
        gz.scatter_add_(1, cols.clamp(min=0), torch.where(cols >= 0, gu, 0.0).to(gz.dtype))
        sink.put(rows, gz.mul_(slope) if capped else gz)

    return epilogue


# ---------------------------------------------------------------- the tensor function


@dataclasses.dataclass(frozen=True)
class DistillResult:
    """What :func:`linear_distillation_loss` returns, in the accumulation dtype (fp32, fp64
    for fp64 inputs): ``loss`` ``[]``, differentiable once in ``hidden`` and ``weight``;
    ``kl`` ``[n]``, ``KL(teacher || student)`` per row; ``top1_agreement`` ``[n]`` bool, the
    student's argmax equal to the teacher's top-1. The two per-row tensors carry no gradient.
    """

    loss: torch.Tensor
    kl: torch.Tensor
    top1_agreement: torch.Tensor


Teacher = SparseTeacher | DenseTeacher


def _checked_config(config: Any) -> DistillConfig:
    config = DistillConfig() if config is None else config
    return check_instance("config", config, DistillConfig, "a DistillConfig")


def _checked_teacher(teacher: Any, config: DistillConfig, field: str, *, cp: int = 1) -> Teacher:
    """``teacher`` a :class:`SparseTeacher` or :class:`DenseTeacher` whose counts are ``None``
    or finite ``> 0``, the one its aggregation reads (over ``cp`` context-parallel ranks:
    required)."""
    expected = "a torch_impl.processors.SparseTeacher or DenseTeacher"
    check_instance(field, teacher, (SparseTeacher, DenseTeacher), expected)
    how = config.aggregation
    check_counts(how, **global_counts(teacher), prefix=f"{field}.")
    if cp > 1 and how == Aggregation.SEQ_MEAN_TOKEN_MEAN:
        raise ContractError(
            "parallel.cp_size",
            expected="1 for seq-mean-token-mean (it needs whole sequences)",
            actual=cp,
        )
    need = count_read(how)
    if cp > 1 and need is not None and getattr(teacher, need) is None:
        raise ContractError(
            f"context.{need}",
            expected=f"the count over the context-parallel ranks (cp={cp}), so that their "
            "losses sum",
            actual="None",
        )
    return teacher


def _fused(
    h: torch.Tensor,
    weight: torch.Tensor,
    setup: TileSetup,
    config: DistillConfig,
    teacher: Teacher,
    weights: torch.Tensor,
) -> DistillResult:
    """The loss of both doors, from the gathered rows ``h``, the teacher as rows
    (``prepare``) and the aggregation's ``weights`` ``[n]``; the gradients formed in
    the forward pass (:class:`~._engine.FormedInForward`)."""
    acc = setup.acc_dtype

    def run(
        need_dh: bool, need_dw: bool, need_db: bool
    ) -> tuple[tuple[torch.Tensor, ...], Any, Any, Any]:
        with no_autocast(h):
            eng = Engine(h, weight, setup, need_db=need_db)
            kl, lse, loss = (
                torch.zeros(shape, dtype=acc, device=h.device) for shape in (eng.n, eng.n, ())
            )
            out = _Outputs(loss, kl, torch.zeros(eng.n, dtype=torch.bool, device=h.device), lse)
            if isinstance(teacher, SparseTeacher):
                epilogue = _sparse_epilogue(eng, config, teacher, weights, out)
            else:
                epilogue = _dense_epilogue(eng, config, teacher, weights, out)
            renorm = isinstance(teacher, SparseTeacher) and config.tail == TeacherTail.RENORMALIZE
            dh, dw = eng.row_sweep(epilogue, need_dh=need_dh, need_dw=need_dw, zeros=renorm)
        return tuple(out), dh, dw, eng.db

    grad = torch.is_grad_enabled()
    loss, kl, agree, lse = FormedInForward.apply(
        h, weight, setup.bias, "distillation_loss", run, grad
    )
    # + 0 * sum(lse): NaN where the student's hidden states or weight hold NaN/inf anywhere
    return DistillResult(loss=loss + 0.0 * lse.sum(), kl=kl, top1_agreement=agree)


def _row_weights(
    teacher: Teacher,
    sequences: Any,
    setup: TileSetup,
    config: DistillConfig,
    check: bool,
    labelled: bool,
) -> torch.Tensor:
    """The aggregation's weights ``[n]`` of the rows: ``M`` the teacher's ``mask`` ``[n]``
    (ones when ``None``; an entry NaN, infinite or negative NaN, refused when ``check``;
    0 at an ignored label where ``labelled``), each row's sequence from ``sequences``."""
    n, device, acc = int(setup.ignored.shape[0]), setup.ignored.device, setup.acc_dtype
    if teacher.mask is None:
        m = torch.ones(n, dtype=acc, device=device)
    else:
        given = check_rows("teacher.mask", teacher.mask, (n,), f"[n={n}]")
        if check:
            check_finite_deferred(given, field="teacher.mask", nonnegative=True)
        m = given.detach().to(device=device, dtype=acc)
        m = torch.where(torch.isfinite(m) & (m >= 0), m, float("nan"))
    m = torch.where(setup.ignored, m * 0.0, m) if labelled else m
    segments, count = torch.zeros(n, dtype=torch.long, device=device), 1
    if sequences is not None:
        if not isinstance(sequences, tuple) or len(sequences) != 2:
            raise ContractError(
                "sequences",
                expected="None or (segments [n], count)",
                actual=type(sequences).__name__,
            )
        segments = check_rows("sequences[0]", sequences[0], (n,), f"[n={n}]", integer=True)
        count = check_int("sequences[1]", sequences[1], low=1)
        if check:
            check_indices_deferred(segments, count, field="sequences[0]")
    segments = segments.to(device=device, dtype=torch.long)
    return weights_of(m, segments, count, config.aggregation, **global_counts(teacher))


def _with_config_temperature(options: Any, config: DistillConfig) -> Any:
    """``options`` (default ``LinearOptions()``) with ``config.temperature``, whose own
    ``temperature`` must be 1 (``ContractError`` else); anything but a
    :class:`LinearOptions` passes on to the prologue's type check."""
    options = LinearOptions() if options is None else options
    if not isinstance(options, LinearOptions):
        return options
    if isinstance(options.temperature, torch.Tensor) or options.temperature != 1.0:
        raise ContractError(
            "options.temperature",
            expected="1.0: the distillation temperature is config.temperature",
            actual=repr(options.temperature),
        )
    return dataclasses.replace(options, temperature=config.temperature)


@not_traced
@checked_call()
def linear_distillation_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    teacher: SparseTeacher | DenseTeacher,
    /,
    *,
    options: LinearOptions | None = None,
    config: DistillConfig | None = None,
    sequences: tuple[torch.Tensor, int] | None = None,
    bias: torch.Tensor | None = None,
    **unexpected: Never,
) -> DistillResult:
    """The distillation loss of the student's rows ``hidden @ weight.T`` to a teacher,
    vocab-parallel, its gradients formed in this call, never materialising the logits. Equal to::

        # [n, V], T = config.temperature
        z = (gather(hidden) @ weight_full.T + bias_full) * logit_scale / T
        log Q = log_softmax(z)                                    # the student
        log P = log_softmax(z_t)  (dense)  |  the teacher's k ids (sparse, config.tail)
        D = divergence(P, Q)                                      # [n], config.divergence
        M = where(labels == ignore_index, 0, teacher.mask)        # [n]; mask None: ones
        loss = sum(aggregation_weights(M, segments, count, config.aggregation) * D)

    Args:
        hidden, weight, labels, bias: the student's, as :func:`linear_logprobs`'.
        teacher: rows: :class:`SparseTeacher` ``ids``, ``logprobs`` ``[n, k]``, or
            :class:`DenseTeacher` ``hidden_states`` ``[n_local, h_t]`` (gathered as ``hidden``) and
            ``weight`` ``[V_local, h_t]``; ``mask`` ``[n]``; the counts as the processor's.
        options: :class:`LinearOptions` whose ``temperature`` stays 1 (the temperature is
            ``config.temperature``); ``check_values`` also reads the teacher, mask, segments.
        config: a :class:`DistillConfig` (``None``: ``DistillConfig()``).
        sequences: ``(segments [n], count)``, each row's sequence in ``[0, count)`` (None: one).

    Returns:
        :class:`DistillResult`. No gradient reaches the teacher; differentiable once
        (``create_graph=True`` raises).
    """
    config = _checked_config(config)
    options = _with_config_temperature(options, config)
    name = "linear_distillation_loss"
    options, h, setup = prologue(name, hidden, weight, labels, options, unexpected, bias=bias)
    teacher = _checked_teacher(teacher, config, "teacher")
    n, check, acc = int(h.shape[0]), options.check_values, setup.acc_dtype
    weights = _row_weights(teacher, sequences, setup, config, check, labels is not None)
    vocab = options.vocab or VocabShard(0, setup.vocab_size, setup.vocab_size)
    if isinstance(teacher, SparseTeacher):  # the rows as b = 1, s = n tokens
        ids = check_rows("teacher.ids", teacher.ids, (n,), f"[n={n}, k]")[None]
        lp = check_rows("teacher.logprobs", teacher.logprobs, (n,), f"[n={n}, k]")[None]
        teacher = dataclasses.replace(teacher, ids=ids, logprobs=lp)
        teacher = teacher.prepare(
            1, n, weights != 0, vocab.size, dtype=acc, check_values=check, field="teacher"
        )
    else:
        th = check_rows(
            "teacher.hidden_states", teacher.hidden_states, hidden.shape[:1], "[n_local, h_t]"
        )
        teacher = dataclasses.replace(teacher, hidden_states=th[:, None])
        teacher = teacher.prepare(hidden[:, None], vocab, options.collectives, "teacher")
    return _fused(h, weight, setup, config, teacher, weights)


# ---------------------------------------------------------------- the processor


def distillation_loss(
    config: DistillConfig | None = None,
    /,
    *,
    tile_rows: int | None = None,
    compute_dtype: torch.dtype | None = None,
    **unexpected: Never,
) -> Processor:
    """A processor returning :func:`linear_distillation_loss`'s loss and metrics, scalars::

        {"loss": aggregate(D, M, aggregation),     # D: the config's divergence per token
         "kl": token-mean over M of KL(teacher || student),
         "top1_agreement": token-mean over M of [argmax student == teacher's top-1]}

    The teacher is the user context: :class:`SparseTeacher` (top-k ids, logprobs ``[b, s, k]``)
    or :class:`DenseTeacher` (hidden states ``[s, b, h_t]``, weight shard). ``M``: the
    context's ``mask``, else ``loss_mask``, else ones; 0 at an ignored label."""
    refuse_unexpected("distillation_loss", unexpected)
    config, tiles = (
        _checked_config(config),
        LinearOptions(tile_rows=tile_rows, compute_dtype=compute_dtype),
    )

    @checked_call()
    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        inputs = hook_inputs(ctx, "distillation_loss", needs_labels=False)
        teacher = _checked_teacher(ctx.context, config, "context", cp=ctx.parallel.cp_size)
        options = inputs.tensor_options(tiles, config.temperature)
        options, h, setup = prologue(
            "distillation_loss", inputs.hidden, inputs.weight, inputs.labels, options, {}
        )
        own = teacher.mask is not None  # M: the teacher's mask, else loss_mask, else ones
        given, field = (teacher.mask, "context.mask") if own else (ctx.loss_mask, "loss_mask")
        mask = to_tokens(counted_mask(ctx, inputs, given, field).to(setup.acc_dtype))
        segments, count = sequence_ids(ctx, inputs.b, inputs.s, mask.device)
        weights = weights_of(
            mask, to_tokens(segments), count, config.aggregation, **global_counts(teacher)
        )
        vocab = typing.cast(VocabShard, ctx.vocab)
        if isinstance(teacher, SparseTeacher):
            check, acc = ctx.check_values, setup.acc_dtype
            teacher = teacher.prepare(
                inputs.b, inputs.s, weights != 0, vocab.size, dtype=acc, check_values=check
            )
        else:
            teacher = teacher.prepare(
                typing.cast(torch.Tensor, ctx.hidden_states), vocab, ctx.collectives
            )
        result = _fused(h, inputs.weight, setup, config, teacher, weights)
        agreement = masked_mean(result.top1_agreement, mask)
        return {
            "loss": result.loss,
            "kl": masked_mean(result.kl, mask),
            "top1_agreement": agreement,
        }

    return processor(fn, name="distillation_loss")

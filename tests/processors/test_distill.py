"""The distillation processor against an independent float64 computation.

The truth takes the full logits of student and teacher in float64, writes the
divergences of ``hookspec.conventions`` out directly (``log_softmax`` of the
whole vocabulary, the tail by ``1 - sum``), aggregates with Python loops over
the sequences and differentiates with autograd. It imports nothing from
``torch_impl.processors`` but the processor and its dataclasses.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any

import pytest
import torch

from hookspec import (
    TAIL_FLOOR,
    Aggregation,
    Collectives,
    ContractError,
    DistillDivergence,
    OutputContext,
    ParallelLayout,
    TeacherTail,
    VocabShard,
)
from tests.support.distributed import GlooSequenceParallel, run_distributed
from tests.support.fake_cuda import deferred_checks
from torch_impl.processors import (
    DenseTeacher,
    DistillConfig,
    LinearOptions,
    SparseTeacher,
    distillation_loss,
    linear_distillation_loss,
)

IGNORE = -100
S, B, H, HT, V, K = 7, 3, 8, 6, 46, 5
DIVS = list(DistillDivergence)
# every aggregation but the policy loss's Dr. GRPO norm, which DistillConfig refuses by name
AGGS = [a for a in Aggregation if a != Aggregation.SEQ_MEAN_TOKEN_SUM_NORM]


def _data(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.8
    th = torch.randn(S, B, HT, generator=g, dtype=torch.float64)
    tw = torch.randn(V, HT, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 2] = IGNORE
    mask = (torch.rand(B, S, generator=g) > 0.2).double()
    mask[-1] = 0.0
    mask[-1, :2] = 1.0
    mask[1, 3] = 2.5  # a weight, not a flag
    zt = torch.einsum("sbh,vh->bsv", th, tw)
    lp_t = zt.log_softmax(-1)
    top = torch.sort(lp_t, dim=-1, descending=True, stable=True)
    return {
        "h": h,
        "w": w,
        "th": th,
        "tw": tw,
        "labels": labels,
        "mask": mask,
        "ids": top.indices[..., :K].contiguous(),
        "lp": top.values[..., :K].contiguous(),
    }


def _ctx(d: dict[str, Any], teacher: Any, **kw: Any) -> OutputContext:
    h = d["h"].clone().requires_grad_()
    w = d["w"].clone().requires_grad_()
    return OutputContext(
        hidden_states=h,
        labels=d["labels"],
        vocab_weight=w,
        vocab=VocabShard(0, V, V),
        context=teacher,
        **kw,
    )


def _div(
    log_p: torch.Tensor, log_q: torch.Tensor, kind: DistillDivergence, beta: float
) -> torch.Tensor:
    p, q = log_p.exp(), log_q.exp()

    def kl(a: torch.Tensor, la: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * (la - lb), torch.zeros_like(a)).sum(-1)

    if kind == DistillDivergence.FORWARD_KL:
        return kl(p, log_p, log_q)
    if kind == DistillDivergence.REVERSE_KL:
        return kl(q, log_q, log_p)
    m = beta * p + (1 - beta) * q
    return beta * kl(p, log_p, m.log()) + (1 - beta) * kl(q, log_q, m.log())


def _aggregate(loss: torch.Tensor, m: torch.Tensor, how: Aggregation) -> torch.Tensor:
    if how == Aggregation.TOKEN_SUM:
        return (loss * m).sum()
    if how == Aggregation.SEQ_MEAN_TOKEN_SUM_NORM:  # the default factor: the padded length
        return _aggregate(loss, m, Aggregation.SEQ_MEAN_TOKEN_SUM) / m.shape[-1]
    if how == Aggregation.TOKEN_MEAN:
        return (loss * m).sum() / m.sum() if m.sum() > 0 else loss.sum() * 0.0
    per = []
    for i in range(m.shape[0]):
        n = m[i].sum()
        if n == 0:
            continue
        t = (loss[i] * m[i]).sum()
        per.append(t / n if how == Aggregation.SEQ_MEAN_TOKEN_MEAN else t)
    return torch.stack(per).mean() if per else loss.sum() * 0.0


def _truth(
    d: dict[str, Any], cfg: DistillConfig, *, dense: bool, mask: torch.Tensor | None = None
) -> dict:
    h = d["h"].clone().requires_grad_()
    w = d["w"].clone().requires_grad_()
    t = cfg.temperature
    lq = (torch.einsum("sbh,vh->bsv", h, w) / t).log_softmax(-1)  # [b, s, V]
    if dense:
        lp = (torch.einsum("sbh,vh->bsv", d["th"], d["tw"]) / t).log_softmax(-1)
        log_p, log_q = lp, lq
        top1 = lp.argmax(-1)
    else:
        lq_ids = lq.gather(-1, d["ids"])
        if cfg.tail == TeacherTail.RENORMALIZE:
            log_p = d["lp"] - d["lp"].logsumexp(-1, keepdim=True)
            log_q = lq_ids - lq_ids.logsumexp(-1, keepdim=True)
        else:
            # both tails floored alike (hookspec.conventions); float64 sums are exact enough here
            p_tail = (1 - d["lp"].double().exp().sum(-1)).clamp_min(TAIL_FLOOR)
            q_tail = (1 - lq_ids.exp().sum(-1)).clamp_min(TAIL_FLOOR)
            log_p = torch.cat([d["lp"].double(), p_tail.log()[..., None]], -1)
            log_q = torch.cat([lq_ids, q_tail.log()[..., None]], -1)
        top1 = d["ids"][..., 0]
    per_token = _div(log_p, log_q, cfg.divergence, cfg.beta)
    fkl = _div(log_p, log_q, DistillDivergence.FORWARD_KL, 0.5)
    m = d["mask"] if mask is None else mask
    m = torch.where(d["labels"] == IGNORE, 0.0, m)
    loss = _aggregate(per_token, m, cfg.aggregation)
    dh, dw = torch.autograd.grad(loss, (h, w))
    agree = (lq.argmax(-1) == top1).double()
    den = m.sum() if m.sum() > 0 else torch.tensor(1.0, dtype=torch.float64)
    return {
        "loss": loss.detach(),
        "kl": ((fkl * m).sum() / den).detach(),
        "top1_agreement": (agree * m).sum() / den,
        "dh": dh,
        "dw": dw,
    }


def _teacher(d: dict[str, Any], dense: bool, **kw: Any) -> Any:
    if dense:
        return DenseTeacher(hidden_states=d["th"], weight=d["tw"], mask=d["mask"], **kw)
    return SparseTeacher(ids=d["ids"], logprobs=d["lp"], mask=d["mask"], **kw)


def _run(d: dict[str, Any], cfg: DistillConfig, dense: bool, tile: int = 3 * V) -> dict:
    ctx = _ctx(d, _teacher(d, dense))
    out = distillation_loss(cfg, tile_rows=max(1, tile // V))(ctx)
    dh, dw = torch.autograd.grad(out["loss"], (ctx.hidden_states, ctx.vocab_weight))
    return {**{k: v.detach() for k, v in out.items()}, "dh": dh, "dw": dw}


def _close(got: dict, want: dict, tol: float = 1e-10) -> None:
    for key in ("loss", "kl", "top1_agreement", "dh", "dw"):
        torch.testing.assert_close(
            got[key], want[key].to(got[key].dtype), rtol=tol, atol=tol, msg=key
        )


@pytest.mark.parametrize("divergence", DIVS)
@pytest.mark.parametrize("aggregation", AGGS)
def test_dense_teacher_against_float64(
    divergence: DistillDivergence, aggregation: Aggregation
) -> None:
    d = _data()
    cfg = DistillConfig(divergence=divergence, aggregation=aggregation, temperature=0.7, beta=0.3)
    _close(_run(d, cfg, dense=True), _truth(d, cfg, dense=True))


@pytest.mark.parametrize("divergence", DIVS)
@pytest.mark.parametrize("tail", list(TeacherTail))
def test_sparse_teacher_against_float64(divergence: DistillDivergence, tail: TeacherTail) -> None:
    d = _data(1)
    cfg = DistillConfig(divergence=divergence, tail=tail, temperature=1.3, beta=0.6)
    _close(_run(d, cfg, dense=False), _truth(d, cfg, dense=False))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[b, s, ...] -> [n, ...]`` in the hidden states' (``s``-major) row order."""
    return x.transpose(0, 1).reshape(-1, *x.shape[2:])


def _tensor_run(d: dict[str, Any], cfg: DistillConfig, dense: bool, tile_rows: int = 4) -> dict:
    """:func:`linear_distillation_loss` on the rows of ``d`` (no hook), its metrics formed
    here from the per-row results as the processor's are."""
    h = d["h"].reshape(-1, H).clone().requires_grad_()
    w = d["w"].clone().requires_grad_()
    if dense:
        teacher: Any = DenseTeacher(
            hidden_states=d["th"].reshape(-1, HT), weight=d["tw"], mask=_rows(d["mask"])
        )
    else:
        teacher = SparseTeacher(ids=_rows(d["ids"]), logprobs=_rows(d["lp"]), mask=_rows(d["mask"]))
    seq = torch.arange(S * B) % B  # row r = s * B + b belongs to sequence b
    res = linear_distillation_loss(
        h,
        w,
        _rows(d["labels"]),
        teacher,
        options=LinearOptions(tile_rows=tile_rows),
        config=cfg,
        sequences=(seq, B),
    )
    dh, dw = torch.autograd.grad(res.loss, (h, w))
    m = torch.where(_rows(d["labels"]) == IGNORE, 0.0, _rows(d["mask"]))
    return {
        "loss": res.loss.detach(),
        "kl": (res.kl * m).sum() / m.sum(),
        "top1_agreement": (res.top1_agreement.double() * m).sum() / m.sum(),
        "dh": dh.reshape(S, B, H),
        "dw": dw,
    }


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("aggregation", AGGS)
def test_the_tensor_function_against_float64_and_equal_to_the_processor(
    dense: bool, aggregation: Aggregation
) -> None:
    """``linear_distillation_loss`` on rows: the float64 truth, and bitwise the
    processor's loss and gradients (both doors share one loss)."""
    d = _data(seed=21)
    cfg = DistillConfig(
        divergence=DistillDivergence.JSD,
        beta=0.3,
        tail=TeacherTail.BUCKET,
        aggregation=aggregation,
        temperature=1.5,
    )
    got = _tensor_run(d, cfg, dense)
    _close(got, _truth(d, cfg, dense=dense))
    via_hook = _run(d, cfg, dense, tile=4 * V)
    for key in ("loss", "dh", "dw"):
        assert torch.equal(got[key], via_hook[key]), key


def test_the_tensor_function_applies_the_temperature_without_options() -> None:
    """``options=None`` is ``LinearOptions()``: the student's logits still divided by
    ``config.temperature`` (they were not, the teacher's alone tempered)."""
    d = _data(seed=23)
    h, w, y = d["h"].reshape(-1, H), d["w"], _rows(d["labels"])
    teacher = SparseTeacher(ids=_rows(d["ids"]), logprobs=_rows(d["lp"]))
    cfg = DistillConfig(temperature=2.0)
    got = linear_distillation_loss(h, w, y, teacher, config=cfg).loss
    assert torch.equal(
        got, linear_distillation_loss(h, w, y, teacher, options=LinearOptions(), config=cfg).loss
    )
    assert not torch.equal(got, linear_distillation_loss(h, w, y, teacher).loss)


def test_the_tensor_function_checks_its_own_arguments() -> None:
    d = _data(seed=22)
    h, w, y = d["h"].reshape(-1, H), d["w"], _rows(d["labels"])
    teacher = SparseTeacher(ids=_rows(d["ids"]), logprobs=_rows(d["lp"]))
    with pytest.raises(ContractError, match=r"^options.temperature: expected 1.0"):
        linear_distillation_loss(h, w, y, teacher, options=LinearOptions(temperature=2.0))
    with pytest.raises(ContractError, match=r"^teacher.ids: expected a tensor \[n=21, k\]"):
        linear_distillation_loss(h, w, y, SparseTeacher(ids=d["ids"], logprobs=d["lp"]))
    with pytest.raises(ContractError, match=r"^teacher.mask: expected a tensor \[n=21\]"):
        linear_distillation_loss(
            h, w, y, SparseTeacher(ids=teacher.ids, logprobs=teacher.logprobs, mask=d["mask"])
        )
    with pytest.raises(
        ContractError, match=r"^teacher: expected a torch_impl.processors.SparseTeacher"
    ):
        linear_distillation_loss(h, w, y, {"ids": teacher.ids})
    with pytest.raises(ContractError, match=r"^sequences\[0\]: expected indices in \[0, 2\)"):
        seq = torch.arange(S * B) % B
        linear_distillation_loss(
            h,
            w,
            y,
            teacher,
            config=DistillConfig(aggregation="seq-mean-token-sum"),
            sequences=(seq, 2),
        )
    bad = teacher.logprobs.clone()
    bad[3, 0] = 0.5  # a logprob > 0 at a counted row
    with pytest.raises(ContractError, match=r"^teacher.logprobs: expected logprobs <= 0"):
        linear_distillation_loss(h, w, y, SparseTeacher(ids=teacher.ids, logprobs=bad))
    with pytest.raises(
        TypeError, match=re.escape("vocab_start= -> LinearOptions(vocab=VocabShard")
    ):
        linear_distillation_loss(h, w, y, teacher, vocab_start=0)  # type: ignore[arg-type]


def test_the_tensor_function_without_labels_counts_every_row() -> None:
    """No labels: no row is ignored (the mask alone counts)."""
    d = _data(seed=23)
    d["labels"] = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(3))
    cfg = DistillConfig()
    h, w = d["h"].reshape(-1, H), d["w"]
    teacher = SparseTeacher(ids=_rows(d["ids"]), logprobs=_rows(d["lp"]), mask=_rows(d["mask"]))
    with_labels = linear_distillation_loss(h, w, _rows(d["labels"]), teacher, config=cfg)
    without = linear_distillation_loss(h, w, None, teacher, config=cfg)
    assert torch.equal(with_labels.loss, without.loss)
    torch.testing.assert_close(
        without.loss, _truth(d, cfg, dense=False)["loss"], rtol=1e-10, atol=1e-10
    )


def test_sparse_aggregations_and_one_tile_per_token() -> None:
    d = _data(2)
    for how in AGGS:
        cfg = DistillConfig(
            divergence=DistillDivergence.JSD, tail=TeacherTail.BUCKET, aggregation=how
        )
        _close(_run(d, cfg, dense=False, tile=1), _truth(d, cfg, dense=False))


def test_float32_student_within_float32_error() -> None:
    d = _data(3)
    d32 = {
        **d,
        "h": d["h"].float(),
        "w": d["w"].float(),
        "th": d["th"].float(),
        "tw": d["tw"].float(),
    }
    for dense in (True, False):
        cfg = DistillConfig(divergence=DistillDivergence.REVERSE_KL, tail=TeacherTail.BUCKET)
        got, want = _run(d32, cfg, dense), _truth(d, cfg, dense=dense)
        _close({k: v.double() for k, v in got.items()}, want, tol=2e-5)


@pytest.mark.parametrize("dense", [True, False])
def test_a_second_backward_raises_as_the_fused_loss_does(dense: bool) -> None:
    """The gradients are formed in the forward pass and handed over by the first
    backward (``FormedInForward``, shared with ``fused_token_loss``)."""
    d = _data()
    ctx = _ctx(d, _teacher(d, dense))
    loss = distillation_loss(DistillConfig(tail=TeacherTail.BUCKET))(ctx)["loss"]
    loss.backward(retain_graph=True)
    with pytest.raises(
        RuntimeError, match="distillation_loss: backward through the same call twice"
    ):
        loss.backward()


def test_no_gradient_reaches_the_teacher() -> None:
    d = _data()
    th, tw = d["th"].clone().requires_grad_(), d["tw"].clone().requires_grad_()
    ctx = _ctx(d, DenseTeacher(hidden_states=th, weight=tw))
    out = distillation_loss(DistillConfig(divergence=DistillDivergence.JSD))(ctx)
    out["loss"].backward()
    assert th.grad is None and tw.grad is None
    assert ctx.hidden_states.grad is not None and bool(ctx.hidden_states.grad.abs().sum() > 0)
    lp = d["lp"].clone().requires_grad_()
    ctx = _ctx(d, SparseTeacher(ids=d["ids"], logprobs=lp))
    distillation_loss(DistillConfig(tail=TeacherTail.BUCKET))(ctx)["loss"].backward()
    assert lp.grad is None


def test_ignored_labels_and_masked_tokens_get_no_gradient_and_are_not_read() -> None:
    clean = _data()
    clean["labels"][:, 4] = IGNORE
    clean["mask"][2, :] = 0.0
    d = {**clean, "th": clean["th"].clone(), "lp": clean["lp"].clone(), "ids": clean["ids"].clone()}
    d["th"][4] = float("nan")  # teacher values at uncounted tokens are never read
    d["lp"][2] = float("nan")
    d["ids"][2] = -7
    for dense in (True, False):
        cfg = DistillConfig(divergence=DistillDivergence.REVERSE_KL, tail=TeacherTail.BUCKET)
        got = _run(d, cfg, dense)
        assert torch.isfinite(got["loss"]) and torch.isfinite(got["dh"]).all()
        assert float(got["dh"][4].abs().max()) == 0.0  # [s, b, h]: position 4 of every sequence
        assert float(got["dh"][:, 2].abs().max()) == 0.0
        _close(got, _truth(clean, cfg, dense=dense))


def test_empty_mask_is_zero_with_zero_gradient() -> None:
    d = _data()
    d["mask"] = torch.zeros(B, S, dtype=torch.float64)
    for dense in (True, False):
        got = _run(d, DistillConfig(), dense)
        assert float(got["loss"]) == 0.0 and float(got["dh"].abs().max()) == 0.0
        assert float(got["kl"]) == 0.0 and float(got["top1_agreement"]) == 0.0


def test_nan_is_visible() -> None:
    """A NaN in the student's hidden states, even at an uncounted token, or in a dense
    teacher's hidden states at a counted one: a NaN loss. A NaN in a sparse teacher's
    logprobs at a counted token, or a negative mask entry: ``ContractError`` (on a CPU
    at once; on a GPU deferred, the loss NaN until the check reports)."""
    d = _data()
    d["mask"][0, 0] = 0.0
    d["mask"][1, 1] = 1.0
    h_nan = d["h"].clone()
    h_nan[0, 0, 0] = float("nan")  # a student hidden state at an uncounted token
    th = d["th"].clone()
    th[1, 1, 0] = float("nan")  # a counted teacher hidden state
    for dense in (True, False):
        assert math.isnan(float(_run({**d, "h": h_nan}, DistillConfig(), dense)["loss"]))
    assert math.isnan(float(_run({**d, "th": th}, DistillConfig(), True)["loss"]))
    lp = d["lp"].clone()
    lp[1, 1, 0] = float("nan")  # a counted sparse teacher value
    with pytest.raises(ContractError) as info:
        _run({**d, "lp": lp}, DistillConfig(), False)
    assert info.value.field == "context.logprobs"


def _negative_mask(d: dict[str, Any]) -> dict[str, Any]:
    bad_mask = d["mask"].clone()
    bad_mask[2, 6] = -1.0
    return {**d, "mask": bad_mask}


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "sparse"])
def test_a_negative_mask_entry_is_refused_at_once_on_a_cpu(dense: bool) -> None:
    """One behaviour per device (the test accepted a NaN loss or the error): on a
    CPU the mask is read at once, and the call raises naming it."""
    with pytest.raises(ContractError) as e:
        _run(_negative_mask(_data()), DistillConfig(), dense)
    assert e.value.field == "context.mask"
    assert e.value.expected == "finite values >= 0"


def _nan_then_refused(d: dict[str, Any], dense: bool) -> None:
    """The deferred check's rule (``torch_impl.value_checks``): the call never raises for
    its own values, so the loss comes back NaN (token-mean: every weight); reading it
    synchronises, so the copy has landed and the next look raises naming the mask."""
    from torch_impl.value_checks import pending_checks, raise_pending_errors

    raise_pending_errors(wait=True)  # nothing left from an earlier test
    got = _run(_negative_mask(d), DistillConfig(), dense)
    assert math.isnan(float(got["loss"]))
    assert pending_checks() >= 1
    with pytest.raises(ContractError) as e:
        raise_pending_errors()  # no wait: float(loss) synchronised, the copy has landed
    assert e.value.field == "context.mask"
    assert e.value.expected == "finite values >= 0"
    while pending_checks():  # the call's later checks (the NaN the mask became) are read too
        with contextlib.suppress(ContractError):
            raise_pending_errors(wait=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "sparse"])
def test_a_negative_mask_entry_is_nan_then_refused_on_a_gpu(dense: bool) -> None:
    _nan_then_refused({k: v.cuda() for k, v in _data().items()}, dense)


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "sparse"])
def test_a_negative_mask_entry_is_nan_then_refused_on_the_gpu_path_on_a_cpu(dense: bool) -> None:
    """The GPU path on a CPU, with each copy landing as it is recorded: the race a fast
    GPU wins, which made the call raise for its own mask before the rule."""
    with deferred_checks(at_once=True):
        _nan_then_refused(_data(), dense)


def _bad_teacher(d: dict[str, Any], what: str) -> dict[str, Any]:
    ids, lp = d["ids"].clone(), d["lp"].clone()
    if what == "a duplicated id":
        ids[1, 1, 3] = ids[1, 1, 1]
    elif what == "an id out of range":
        ids[1, 1, 2] = V
    elif what == "a logprob of +0.5":
        lp[1, 1, 2] = 0.5
    elif what == "logprobs summing to 4.5":
        lp[1, 1] = math.log(4.5 / K)
    elif what == "+inf":
        lp[1, 1, 4] = float("inf")
    elif what == "the first id not the top-1":
        lp[1, 1, [0, 1]] = lp[1, 1, [1, 0]]
    return {**d, "ids": ids, "lp": lp}


@pytest.mark.parametrize(
    ("what", "field"),
    [
        ("a duplicated id", "context.ids"),
        ("an id out of range", "context.ids"),
        ("a logprob of +0.5", "context.logprobs"),
        ("logprobs summing to 4.5", "context.logprobs"),
        ("+inf", "context.logprobs"),
        ("the first id not the top-1", "context.logprobs"),
    ],
)
@pytest.mark.parametrize("tail", list(TeacherTail))
def test_an_invalid_sparse_teacher_is_refused_where_it_counts(
    what: str, field: str, tail: TeacherTail
) -> None:
    """Each of these gave a loss before (1.922, 2.654, 21.34, inf against 1.908); the
    rules are ``hookspec.conventions``'. At a token that does not count, the same
    values are never read."""
    d = _data()
    cfg = DistillConfig(tail=tail)
    with pytest.raises(ContractError) as info:
        _run(_bad_teacher(d, what), cfg, False)
    assert info.value.field == field
    d["mask"][1, 1] = 0.0
    _close(_run(_bad_teacher(d, what), cfg, False), _truth(d, cfg, dense=False))


def test_reverse_kl_with_the_bucket_is_finite_where_the_teacher_lists_its_whole_mass() -> None:
    """k = V (the teacher's ids are the whole vocabulary): both tails are empty and
    contribute 0, so the bucket form equals the dense reverse KL; and a teacher whose
    listed mass rounds to 1 in float32 gives a finite loss, not inf."""
    d = _data()
    lp_full = (torch.einsum("sbh,vh->bsv", d["th"], d["tw"])).log_softmax(-1)
    top = torch.sort(lp_full, dim=-1, descending=True, stable=True)
    full = {**d, "ids": top.indices.contiguous(), "lp": top.values.contiguous()}
    cfg = DistillConfig(divergence=DistillDivergence.REVERSE_KL, tail=TeacherTail.BUCKET)
    got = _run(full, cfg, False)
    _close(got, _truth(d, DistillConfig(divergence=DistillDivergence.REVERSE_KL), dense=True))
    near = {
        **d,
        "lp": (d["lp"] - d["lp"].logsumexp(-1, keepdim=True)).float(),
    }  # its mass rounds to 1
    assert math.isfinite(float(_run(near, cfg, False)["loss"]))


def test_a_small_teacher_tail_in_float32_keeps_its_precision() -> None:
    """A teacher tail of 1e-4 in float32 logprobs: ``1 - sum(exp)`` in float32 cancels
    (1.7e-5 relative error in reverse KL); ``-expm1(logsumexp)`` does not."""
    d = _data(5)
    lp = (
        d["lp"] - d["lp"].logsumexp(-1, keepdim=True) + math.log1p(-1e-4)
    )  # the listed mass: 1 - 1e-4
    d32 = {**d, "lp": lp.float()}
    cfg = DistillConfig(divergence=DistillDivergence.REVERSE_KL, tail=TeacherTail.BUCKET)
    got = _run(d32, cfg, False)
    want = _truth({**d, "lp": lp.float().double()}, cfg, dense=False)
    assert abs(float(got["loss"]) - float(want["loss"])) <= 1e-9 * abs(float(want["loss"]))


def test_a_dense_teacher_names_its_vocabulary_rows() -> None:
    """A shard of the vocabulary: the teacher's weight must say which rows it holds
    (it was taken from the wrong shard without a word, top-1 agreement 0), and they
    must be the student's."""
    d = _data()
    half = V // 2
    w = d["w"][:half].clone().requires_grad_()
    for vocab, expected in (
        (None, "VocabShard of the teacher"),
        (VocabShard(half, V, V), "the student's"),
    ):
        teacher = DenseTeacher(hidden_states=d["th"], weight=d["tw"][half:], vocab=vocab)
        ctx = OutputContext(
            hidden_states=d["h"],
            labels=d["labels"],
            vocab_weight=w,
            vocab=VocabShard(0, half, V),
            context=teacher,
            parallel=ParallelLayout(tp_size=2, tp_rank=0),
            collectives=_TwoRanks(),
        )
        with pytest.raises(ContractError, match=expected) as info:
            distillation_loss()(ctx)
        assert info.value.field == "context.vocab"


def test_a_dense_teachers_logit_scale() -> None:
    """The teacher's own logit scale (MuP) multiplies its logits: the same as scaling
    its weight; no T**2 factor anywhere."""
    d = _data()
    cfg = DistillConfig(divergence=DistillDivergence.JSD, temperature=0.9)
    ctx = _ctx(
        d, DenseTeacher(hidden_states=d["th"], weight=d["tw"], mask=d["mask"], logit_scale=1.7)
    )
    got = distillation_loss(cfg)(ctx)
    want = _truth({**d, "tw": d["tw"] * 1.7}, cfg, dense=True)
    torch.testing.assert_close(got["loss"].detach(), want["loss"], rtol=1e-10, atol=1e-10)


class _TwoRanks(Collectives):
    """Stands for a two-rank group (the checks refuse before any collective runs)."""

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("no collective runs before the teacher is checked")

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("no collective runs before the teacher is checked")

    def gather_hidden_states(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_sparse_teacher_holding_all_its_mass_in_k() -> None:
    """The tail bucket with ``p_tail = 0``: the tail terms vanish (forward KL, JSD)."""
    d = _data()
    d["lp"] = d["lp"] - d["lp"].logsumexp(-1, keepdim=True)  # the k ids hold every bit of mass
    for div in (DistillDivergence.FORWARD_KL, DistillDivergence.JSD):
        cfg = DistillConfig(divergence=div, tail=TeacherTail.BUCKET)
        got = _run(d, cfg, dense=False)
        _close(got, _truth(d, cfg, dense=False))


def _zero_probability(d: dict[str, Any]) -> dict[str, Any]:
    """A teacher that masks ids: ``-inf`` logprobs (probability 0) at counted tokens,
    one id at one token, the last two at another, the last of every id at a third."""
    lp = d["lp"].clone()
    lp[0, 1, -1] = -math.inf
    lp[2, 0, -2:] = -math.inf
    lp[1, 4, 1:] = -math.inf
    return {**d, "lp": lp}


@pytest.mark.parametrize("divergence", DIVS)
@pytest.mark.parametrize("tail", list(TeacherTail))
def test_a_zero_probability_teacher_id_against_float64(
    divergence: DistillDivergence, tail: TeacherTail
) -> None:
    """``-inf`` is probability 0 (``hookspec.conventions``): its terms weigh 0 in
    forward KL and JSD (finite values and gradients equal to float64's); the reverse
    KL of a student that gives the id mass is ``+inf``, as in float64. Refused before,
    as logprobs outside a range that the message showed holding them."""
    d = _zero_probability(_data(1))
    cfg = DistillConfig(divergence=divergence, tail=tail, temperature=1.3, beta=0.6)
    got = _run(d, cfg, dense=False) if divergence != DistillDivergence.REVERSE_KL else None
    if got is None:
        out = distillation_loss(cfg)(_ctx(d, _teacher(d, False)))
        assert float(out["loss"].detach()) == math.inf == float(_truth(d, cfg, dense=False)["loss"])
        return
    _close(got, _truth(d, cfg, dense=False))
    assert all(bool(torch.isfinite(v).all()) for v in got.values())


@pytest.mark.parametrize(("value", "name"), [(math.nan, "NaN"), (math.inf, "+inf")])
def test_nan_and_plus_inf_teacher_logprobs_are_named(value: float, name: str) -> None:
    """Refused as what they are (they were reported as a sum of exp in a range that
    held the bad tokens' values); the count of bad entries is the one given."""
    d = _data()
    d["lp"][1, 2, 3] = value
    d["lp"][0, 5, 2:4] = value
    with pytest.raises(ContractError) as info:
        _run(d, DistillConfig(), dense=False)
    assert info.value.field == "context.logprobs"
    assert f"no {name}" in str(info.value) and f"2 tokens holding {name}" in str(info.value)
    assert "[1.0, 2.0]" in str(info.value)  # one entry at one token, two at the other


def test_a_first_logprob_of_minus_inf_is_refused() -> None:
    """The top-1 has probability > 0: a ``-inf`` first logprob (every id masked) is
    refused by name."""
    d = _data()
    d["lp"][1, 2, :] = -math.inf
    with pytest.raises(ContractError, match="finite first logprob") as info:
        _run(d, DistillConfig(), dense=False)
    assert info.value.field == "context.logprobs"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beta": 0.0}, "beta"),
        ({"beta": 1.0}, "beta"),
        ({"temperature": 0.0}, "temperature"),
        ({"divergence": "kl"}, "divergence"),
        ({"tail": "drop"}, "tail"),
        ({"aggregation": "sum"}, "aggregation"),
    ],
)
def test_config_checks(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ContractError) as info:
        DistillConfig(**kwargs)
    assert info.value.field == field


def test_context_checks() -> None:
    d = _data()
    proc = distillation_loss()
    cases = [
        (None, "context"),
        (SparseTeacher(ids=d["ids"][..., :3], logprobs=d["lp"]), "context.logprobs"),
        (SparseTeacher(ids=d["ids"].float(), logprobs=d["lp"]), "context.ids"),
        (SparseTeacher(ids=d["ids"], logprobs=d["lp"], mask=torch.ones(B, S + 1)), "context.mask"),
        (SparseTeacher(ids=d["ids"] + V, logprobs=d["lp"]), "context.ids"),
        (DenseTeacher(hidden_states=d["th"][:-1], weight=d["tw"]), "context.hidden_states"),
        (DenseTeacher(hidden_states=d["th"], weight=d["tw"][:-1]), "context.weight"),
        (
            DenseTeacher(hidden_states=d["th"], weight=d["tw"], global_tokens=-1.0),
            "context.global_tokens",
        ),
    ]
    for teacher, field in cases:
        with pytest.raises(ContractError) as info:
            proc(_ctx(d, teacher))
        assert info.value.field == field, (teacher, info.value)


# ---------------------------------------------------------------- tensor parallel


def _tp2_case(
    rank: int, d: dict[str, Any], name: str, want: dict, *, sequence_parallel: bool
) -> None:
    from megatron.core import parallel_state

    from torch_impl import TorchCollectives

    cfg, dense = _TP_CASES[name]
    group = parallel_state.get_tensor_model_parallel_group()
    coll: Any = TorchCollectives(group, sequence_parallel=False)
    half = V // 2
    shard = slice(rank * half, (rank + 1) * half)
    s = d["h"].shape[0]
    rows = slice(rank * s // 2, (rank + 1) * s // 2) if sequence_parallel else slice(0, s)
    if sequence_parallel:
        coll = GlooSequenceParallel(coll, group)
    teacher = _teacher(d, dense)
    if dense:
        teacher = DenseTeacher(
            hidden_states=d["th"][rows],
            weight=d["tw"][shard],
            mask=d["mask"],
            vocab=VocabShard(rank * half, (rank + 1) * half, V),
        )
    h = d["h"][rows].clone().requires_grad_()
    w = d["w"][shard].clone().requires_grad_()
    ctx = OutputContext(
        hidden_states=h,
        labels=d["labels"],
        vocab_weight=w,
        vocab=VocabShard(rank * half, (rank + 1) * half, V),
        context=teacher,
        parallel=ParallelLayout(tp_size=2, tp_rank=rank, sequence_parallel=sequence_parallel),
        collectives=coll,
    )
    out = distillation_loss(cfg, tile_rows=4)(ctx)
    out["loss"].backward()
    for key in ("loss", "kl", "top1_agreement"):
        torch.testing.assert_close(out[key], want[key], rtol=1e-10, atol=1e-10, msg=f"{name} {key}")
    torch.testing.assert_close(h.grad, want["dh"][rows], rtol=1e-10, atol=1e-10, msg=f"{name} dh")
    torch.testing.assert_close(w.grad, want["dw"][shard], rtol=1e-10, atol=1e-10, msg=f"{name} dw")


def _tp2(
    rank: int, d: dict[str, Any], truths: dict[str, dict], d_sp: dict[str, Any], sp: dict[str, dict]
) -> None:
    for name, want in truths.items():
        _tp2_case(rank, d, name, want, sequence_parallel=False)
    for name, want in sp.items():  # each rank holds half of the sequence positions
        _tp2_case(rank, d_sp, name, want, sequence_parallel=True)


_TP_CASES = {
    "dense forward-kl": (DistillConfig(temperature=0.8), True),
    "dense jsd": (DistillConfig(divergence=DistillDivergence.JSD, beta=0.2), True),
    "dense reverse-kl seq-mean": (
        DistillConfig(
            divergence=DistillDivergence.REVERSE_KL, aggregation=Aggregation.SEQ_MEAN_TOKEN_MEAN
        ),
        True,
    ),
    "sparse forward-kl renormalize": (DistillConfig(), False),
    "sparse reverse-kl bucket": (
        DistillConfig(divergence=DistillDivergence.REVERSE_KL, tail=TeacherTail.BUCKET),
        False,
    ),
    "sparse jsd bucket": (
        DistillConfig(divergence=DistillDivergence.JSD, tail=TeacherTail.BUCKET),
        False,
    ),
}


@pytest.mark.release_independent
def test_tp2_equals_tp1() -> None:
    """Two gloo ranks, each half of the vocabulary (the teacher's ids falling in
    both halves), against the float64 truth of the whole vocabulary; then sequence
    parallel (each rank half of the positions, a gloo stand-in for Megatron's gather)."""
    d = _data(4)
    truths = {name: _truth(d, cfg, dense=dense) for name, (cfg, dense) in _TP_CASES.items()}
    cut = {"h": 6, "th": 6}  # [s, b, ...]: 6 positions, 3 a rank
    d_sp = {
        k: v[: cut[k]] if k in cut else (v[:, :6] if k != "w" and k != "tw" else v)
        for k, v in d.items()
    }
    sp = {
        name: _truth(d_sp, *_TP_CASES[name][:1], dense=_TP_CASES[name][1])
        for name in ("dense jsd", "sparse jsd bucket")
    }
    run_distributed(_tp2, d, truths, d_sp, sp, tp=2)


def test_the_dr_grpo_norm_is_refused_by_name() -> None:
    with pytest.raises(ContractError, match="seq-mean-token-sum-norm"):
        DistillConfig(aggregation=Aggregation.SEQ_MEAN_TOKEN_SUM_NORM)

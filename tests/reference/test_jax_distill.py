"""``jax_ref.distill``: the float64 references of top-k logprobs and distillation
against numpy, their gradients (``check_grads``), their sharded runs, and the
torch processors held to them by ``hookcheck``'s machinery, with planted bugs
that must fail: a wrong tie order, a missing tail term, a teacher gradient leak.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.test_util import check_grads
from scipy.special import logsumexp

import jax_ref
from hookspec import DistillDivergence, OutputContext, TeacherTail, processor
from jax_ref import distill as D
from jax_ref.check import builtin_processors as B
from jax_ref.check.cases import synthetic_context
from jax_ref.check.comparison import cross_check
from torch_impl.processors import DenseTeacher, DistillConfig

ROOT = Path(__file__).resolve().parents[2]

# module-level references, for hookcheck's --reference module:attr
TOPK_REF = D.topk_logprobs(5, entropy=True)
SPARSE_REF = D.distillation_loss(B.DISTILL_SPARSE_CONFIG)
DENSE_REF = D.distillation_loss(B.DISTILL_DENSE_CONFIG)


# ---------------------------------------------------------------- references against numpy


def _np_tailed(tp: np.ndarray, sq: np.ndarray, tail: str) -> tuple[np.ndarray, np.ndarray]:
    """The teacher's and the student's logprobs at the k ids as the tail rule reads them:
    renormalised over the ids, or with the mass outside them as one more entry."""
    if tail == "renormalize":
        return tp - logsumexp(tp, -1, keepdims=True), sq - logsumexp(sq, -1, keepdims=True)
    log_p = np.concatenate([tp, np.log(1 - np.exp(tp).sum(-1))[:, None]], -1)
    return log_p, np.concatenate([sq, np.log(1 - np.exp(sq).sum(-1))[:, None]], -1)


def _np_divergence(log_p: np.ndarray, log_q: np.ndarray, kind: str, beta: float) -> np.ndarray:
    p, q = np.exp(log_p), np.exp(log_q)
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == "forward-kl":
            return np.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
        if kind == "reverse-kl":
            return np.where(q > 0, q * (log_q - log_p), 0.0).sum(-1)
        m = beta * p + (1 - beta) * q
        a = np.where(p > 0, p * (log_p - np.log(m)), 0.0).sum(-1)
        c = np.where(q > 0, q * (log_q - np.log(m)), 0.0).sum(-1)
        return beta * a + (1 - beta) * c


@pytest.fixture(autouse=True)
def _x64() -> Any:
    with jax_ref.float64():
        yield


def test_topk_reference_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    n, h, v, k = 11, 5, 29, 4
    hidden, weight = rng.normal(size=(n, h)), rng.normal(size=(v, h))
    weight[7] = weight[3]  # a tie: 3 before 7
    hidden[0] = weight[3] * 4
    labels = rng.integers(0, v, size=n)
    labels[2] = -100
    t = rng.uniform(0.5, 2.0, size=n)
    res = D.linear_topk_logprobs(
        jnp.asarray(hidden),
        jnp.asarray(weight),
        k=k,
        labels=jnp.asarray(labels),
        temperature=t,
        with_entropy=True,
    )
    z = hidden @ weight.T / t[:, None]
    lp = z - logsumexp(z, axis=-1, keepdims=True)
    ids = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
    first = list(ids[0])
    assert np.array_equal(np.asarray(res.ids), ids) and first[first.index(3) + 1] == 7
    np.testing.assert_allclose(
        np.asarray(res.logprobs), np.take_along_axis(lp, ids, -1), rtol=1e-13, atol=1e-13
    )
    want_label = np.where(
        labels == -100, 0.0, np.take_along_axis(lp, np.maximum(labels, 0)[:, None], -1)[:, 0]
    )
    np.testing.assert_allclose(np.asarray(res.label_logprobs), want_label, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(
        np.asarray(res.entropy), -(np.exp(lp) * lp).sum(-1), rtol=1e-12, atol=1e-12
    )

    def values(hh: jax.Array, ww: jax.Array) -> jax.Array:
        return D.linear_topk_logprobs(hh, ww, k=k, temperature=t).logprobs

    weight[7] += 0.3  # no tie: the order must not change under check_grads' steps
    check_grads(values, (jnp.asarray(hidden), jnp.asarray(weight)), order=1, modes=("rev",))


@pytest.mark.parametrize("kind", [d.value for d in DistillDivergence])
@pytest.mark.parametrize("tail", [t.value for t in TeacherTail])
def test_divergences_match_numpy_and_their_gradients(kind: str, tail: str) -> None:
    rng = np.random.default_rng(1)
    v, k = 17, 5
    zt, zs = rng.normal(size=(4, v)) * 2, rng.normal(size=(4, v))
    lp_t = zt - logsumexp(zt, -1, keepdims=True)
    lq = zs - logsumexp(zs, -1, keepdims=True)
    dense = D.divergence(jnp.asarray(lp_t), jnp.asarray(lq), kind=kind, beta=0.3)
    np.testing.assert_allclose(
        np.asarray(dense), _np_divergence(lp_t, lq, kind, 0.3), rtol=1e-12, atol=1e-13
    )
    ids = np.argsort(-lp_t, -1, kind="stable")[:, :k]
    tp, sq = np.take_along_axis(lp_t, ids, -1), np.take_along_axis(lq, ids, -1)
    log_p, log_q = _np_tailed(tp, sq, tail)
    got = D.sparse_divergence(jnp.asarray(tp), jnp.asarray(sq), kind=kind, tail=tail, beta=0.3)
    np.testing.assert_allclose(
        np.asarray(got), _np_divergence(log_p, log_q, kind, 0.3), rtol=1e-12, atol=1e-13
    )

    def of_student(z: jax.Array) -> jax.Array:
        lq_ = jax.nn.log_softmax(z, -1)
        return D.sparse_divergence(
            jnp.asarray(tp),
            jnp.take_along_axis(lq_, jnp.asarray(ids), -1),
            kind=kind,
            tail=tail,
            beta=0.3,
        )

    check_grads(of_student, (jnp.asarray(zs),), order=1, modes=("rev",))


@pytest.mark.parametrize("kind", [d.value for d in DistillDivergence])
@pytest.mark.parametrize("tail", [t.value for t in TeacherTail])
def test_a_zero_probability_teacher_id_in_the_reference(kind: str, tail: str) -> None:
    """``-inf`` teacher logprobs are probability 0 (``hookspec.conventions``): forward
    KL and JSD finite, with finite gradients, equal to numpy's sum over the listed
    ids without the zero-weight terms; reverse KL ``+inf``."""
    rng = np.random.default_rng(2)
    zs = rng.normal(size=(3, 11))
    lq = zs - logsumexp(zs, -1, keepdims=True)
    sq = lq[:, :4]
    with np.errstate(divide="ignore"):
        tp = np.log(np.array([[0.5, 0.2, 0.1, 0.0], [0.6, 0.0, 0.0, 0.0], [0.4, 0.3, 0.2, 0.1]]))
        log_p, log_q = _np_tailed(tp, sq, tail)
    want = _np_divergence(log_p, log_q, kind, 0.3)
    got = np.asarray(
        D.sparse_divergence(jnp.asarray(tp), jnp.asarray(sq), kind=kind, tail=tail, beta=0.3)
    )
    if kind == "reverse-kl":
        assert np.isinf(got[:2]).all() and np.isfinite(got[2]) and np.isinf(want[:2]).all()
        np.testing.assert_allclose(got[2], want[2], rtol=1e-12)
        return
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
    grad = jax.grad(
        lambda z: D.sparse_divergence(
            jnp.asarray(tp), jax.nn.log_softmax(z, -1)[:, :4], kind=kind, tail=tail, beta=0.3
        ).sum()
    )(jnp.asarray(zs))
    assert np.isfinite(np.asarray(grad)).all()


# ---------------------------------------------------------------- torch against the references


@pytest.mark.release_independent
def test_processors_pass_every_synthetic_case() -> None:
    cases = [
        (B.TOPK, TOPK_REF, None),
        (B.DISTILL_SPARSE, SPARSE_REF, B.sparse_teacher_context),
        (
            B.DISTILL_RENORMALIZE,
            D.distillation_loss(B.DISTILL_RENORMALIZE_CONFIG),
            B.sparse_teacher_context,
        ),
        (B.DISTILL_DENSE, DENSE_REF, B.dense_teacher_context),
    ]
    for kind in ("random", "masked", "ties"):
        for proc, ref, make in cases:
            ctx = synthetic_context(kind)
            ctx = ctx.replace(context=make(ctx)) if make is not None else ctx
            report = cross_check(proc, ref, ctx, case_name=kind)
            assert report.passed, str(report)


@processor
def wrong_tie_order(ctx: OutputContext) -> dict[str, torch.Tensor]:
    """Planted bug: equal logprobs ordered by the larger id first."""
    out = dict(B.TOPK(ctx))
    w = ctx.vocab_weight
    assert isinstance(w, torch.Tensor)
    flipped = B.TOPK(ctx.replace(vocab_weight=w.flip(0)))
    v = w.shape[0]
    out["topk_logprobs"] = flipped["topk_logprobs"]
    out["topk_ids"] = v - 1 - flipped["topk_ids"]
    return out


def _materialised_sparse(ctx: OutputContext, *, with_tail: bool) -> dict[str, torch.Tensor]:
    """The sparse bucket JSD of ``DISTILL_SPARSE_CONFIG`` with the full logits (tp=1)."""
    cfg, t = B.DISTILL_SPARSE_CONFIG, B.DISTILL_SPARSE_CONFIG.temperature
    h, w = ctx.hidden_states, ctx.vocab_weight
    assert isinstance(h, torch.Tensor) and isinstance(w, torch.Tensor) and ctx.labels is not None
    lq = (torch.einsum("sbh,vh->bsv", h.float(), w.float()) / t).log_softmax(-1)
    teacher = ctx.context
    lq_ids = lq.gather(-1, teacher.ids)
    lp = teacher.logprobs.float()
    if with_tail:
        lp = torch.cat([lp, (1 - lp.exp().sum(-1)).clamp_min(0).log()[..., None]], -1)
        lq_ids = torch.cat([lq_ids, (1 - lq_ids.exp().sum(-1)).log()[..., None]], -1)
    m = torch.where(
        ctx.labels == ctx.ignore_index,
        0.0,
        ctx.loss_mask.float(),  # type: ignore[union-attr]
    )
    pm = cfg.beta * lp.exp() + (1 - cfg.beta) * lq_ids.exp()
    d = cfg.beta * (lp.exp() * (lp - pm.log())).sum(-1) + (1 - cfg.beta) * (
        lq_ids.exp() * (lq_ids - pm.log())
    ).sum(-1)
    kl = (lp.exp() * (lp - lq_ids)).sum(-1)
    agree = (lq.argmax(-1) == teacher.ids[..., 0]).float()
    return {
        "loss": (d * m).sum() / m.sum(),
        "kl": (kl * m).sum().detach() / m.sum(),
        "top1_agreement": (agree * m).sum() / m.sum(),
    }


@processor
def missing_tail(ctx: OutputContext) -> dict[str, torch.Tensor]:
    """Planted bug: the bucket's tail term left out (the k ids only, not renormalised)."""
    return _materialised_sparse(ctx, with_tail=False)


@processor
def materialised_sparse(ctx: OutputContext) -> dict[str, torch.Tensor]:
    """The same computation with the tail: it must pass (the bug is the tail, not the recipe)."""
    return _materialised_sparse(ctx, with_tail=True)


def self_teacher_context(ctx: OutputContext) -> DenseTeacher:
    """Self-distillation: the teacher shares the student's output weight (the very
    tensor) with other hidden states; a processor must not differentiate through it."""
    h = ctx.hidden_states
    assert isinstance(h, torch.Tensor) and isinstance(ctx.vocab_weight, torch.Tensor)
    g = torch.Generator().manual_seed(3)
    th = 0.5 * h.detach() + torch.randn(h.shape, generator=g).to(h.dtype)
    return DenseTeacher(hidden_states=th, weight=ctx.vocab_weight)


@processor
def leaky_teacher(ctx: OutputContext) -> dict[str, torch.Tensor]:
    """Planted bug: the dense reverse KL with the teacher's logits not detached."""
    cfg = B.DISTILL_DENSE_CONFIG
    h, w, teacher = ctx.hidden_states, ctx.vocab_weight, ctx.context
    assert isinstance(h, torch.Tensor) and isinstance(w, torch.Tensor) and ctx.labels is not None
    lq = (torch.einsum("sbh,vh->bsv", h, w) / cfg.temperature).log_softmax(-1)
    lp = (
        torch.einsum("sbh,vh->bsv", teacher.hidden_states, teacher.weight) / cfg.temperature
    ).log_softmax(-1)
    m = torch.where(
        ctx.labels == ctx.ignore_index,
        0.0,
        ctx.loss_mask.float(),  # type: ignore[union-attr]
    )
    d = (lq.exp() * (lq - lp)).sum(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).detach()
    agree = (lq.argmax(-1) == lp.argmax(-1)).float()
    return {
        "loss": (d * m).sum() / m.sum(),
        "kl": (kl * m).sum() / m.sum(),
        "top1_agreement": (agree * m).sum() / m.sum(),
    }


def _failing(report: Any) -> set[tuple[str, str]]:
    return {(r.output, r.quantity) for r in report.failures()}


def test_planted_wrong_tie_order_fails() -> None:
    ctx = synthetic_context("ties")
    assert cross_check(B.TOPK, TOPK_REF, ctx).passed
    report = cross_check(wrong_tie_order, TOPK_REF, ctx)
    assert ("topk_ids", "value") in _failing(report), str(report)


def test_planted_missing_tail_fails() -> None:
    ctx = synthetic_context("random")
    ctx = ctx.replace(context=B.sparse_teacher_context(ctx))
    assert cross_check(materialised_sparse, SPARSE_REF, ctx).passed
    assert cross_check(B.DISTILL_SPARSE, SPARSE_REF, ctx).passed
    failing = _failing(cross_check(missing_tail, SPARSE_REF, ctx))
    assert {
        ("loss", "value"),
        ("loss", "d/d hidden"),
        ("loss", "d/d weight"),
        ("kl", "value"),
    } <= failing


def test_planted_teacher_gradient_leak_fails() -> None:
    ctx = synthetic_context("random")
    ctx = ctx.replace(context=self_teacher_context(ctx))
    assert ctx.context.weight is ctx.vocab_weight  # the teacher holds the student's own weight
    assert cross_check(B.DISTILL_DENSE, DENSE_REF, ctx).passed
    assert _failing(cross_check(leaky_teacher, DENSE_REF, ctx)) == {("loss", "d/d weight")}


def test_config_is_read_by_attribute_without_torch() -> None:
    cfg = DistillConfig(divergence="jsd", tail="bucket", beta=0.25)
    assert D.distillation_loss(dataclasses.replace(cfg)) is not None
    code = "import sys, jax_ref.distill; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# ---------------------------------------------------------------- two ranks


@pytest.mark.slow
@pytest.mark.release_independent
def test_hookcheck_two_ranks_and_sharded_references() -> None:
    """hookcheck --tp 2: top-k and both distillation forms on two gloo ranks against
    the references sharded over two virtual JAX devices (all_gather in shard_map)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("XLA_FLAGS", None)
    b, t = "jax_ref.check.builtin_processors", "tests.reference.test_jax_distill"
    argv = [
        sys.executable, "-m", "jax_ref.check.hookcheck", "--tp", "2", "--no-synthetic", "--quiet",
        "--processor", f"{b}:TOPK", "--reference", f"{t}:TOPK_REF", "--context", "-",
        "--processor", f"{b}:DISTILL_SPARSE", "--reference", f"{t}:SPARSE_REF",
        "--context", f"{b}:sparse_teacher_context",
        "--processor", f"{b}:DISTILL_DENSE", "--reference", f"{t}:DENSE_REF",
        "--context", f"{b}:dense_teacher_context",
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=550)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "reference sharded over 2 JAX devices" in out
    for name in ("TOPK", "DISTILL_SPARSE", "DISTILL_DENSE"):
        for rank in (0, 1):
            assert re.search(rf"^{name}\s+gpt tp2 rank{rank}\s+float32\s.*\sok", out, flags=re.M), (
                out
            )

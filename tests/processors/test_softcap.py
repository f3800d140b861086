"""Final-logit soft-capping (``LinearOptions(softcap=s)``, a config's
``final_logit_softcapping``): ``z = s * tanh(u * logit_scale / s) / T`` of ``u = h @
W.T``, against float64 autograd through materialised logits (values, ``dh``, ``dW``)
at several caps, scalar and per-token temperatures, on both backends, at tp=1 and
tp=2 (gloo); top-k and distillation (a dense teacher's own softcap); bf16 compute
against float64 beside the naive bf16 path; bad caps, by name."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import types
from typing import Any

import pytest
import torch

from hookspec import ContractError, OutputContext, VocabShard
from tests.support.backend_support import close_to_float64, skip_fp64_triton, token_problem
from tests.support.distributed import run_distributed
from tests.support.peer_options import peer_options
from torch_impl.processors import (
    DenseTeacher,
    DistillConfig,
    LinearOptions,
    PolicyBatch,
    SparseTeacher,
    cross_entropy_loss,
    distillation_loss,
    fused_token_loss,
    linear_distillation_loss,
    linear_logprobs,
    linear_topk_logprobs,
    policy_loss,
    selected_logprobs,
    topk_logprobs,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

IGNORE = -100
N, H, V = 13, 6, 29
B, S = 3, 5
SCALE = 0.7
CAPS = (1.0, 5.0, 30.0)
BF16 = torch.bfloat16


def _problem(seed: int = 0, n: int = N, v: int = V) -> dict[str, torch.Tensor]:
    # |u| up to ~20: the cap bites
    return token_problem(seed, n, H, v, scale=3.0, coefficients=("c_lp", "c_ent", "c_lse"))


def _capped(u: torch.Tensor, cap: float, t: Any) -> torch.Tensor:
    """The convention, written independently: ``s * tanh(u * logit_scale / s) / T``."""
    return cap * torch.tanh(u * SCALE / cap) / t


def _truth(
    p: dict[str, torch.Tensor], cap: float, t: Any, dtype: torch.dtype = torch.float64
) -> dict[str, Any]:
    """``sum(c_lp logprobs + c_ent entropy + c_lse lse**2)`` by float64 autograd."""
    h = p["h"].to(dtype).double().clone().requires_grad_()
    w = p["w"].to(dtype).double().clone().requires_grad_()
    z = _capped(h @ w.T, cap, t)
    logp = z.log_softmax(-1)
    y = p["y"]
    lp = torch.where(y == IGNORE, 0.0, logp.gather(1, y.clamp(min=0)[:, None]).squeeze(1))
    ent = -(logp.exp() * logp).sum(-1)
    lse = torch.logsumexp(z, -1)
    loss = (p["c_lp"] * lp + p["c_ent"] * ent + p["c_lse"] * lse**2).sum()
    loss.backward()
    return {
        "lp": lp.detach(),
        "ent": ent.detach(),
        "lse": lse.detach(),
        "loss": loss.detach(),
        "dh": h.grad,
        "dw": w.grad,
    }


@pytest.mark.parametrize("per_token", [False, True], ids=["T", "T[n]"])
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_linear_logprobs_against_float64(
    dtype: torch.dtype, cap: float, per_token: bool, backend: str
) -> None:
    """Logprobs, entropy and lse, and their gradient, through tiles that split rows and
    columns (the vocabulary sweep's online statistics across column tiles)."""
    skip_fp64_triton(backend, dtype)
    p = _problem()
    t = p["t"] if per_token else 0.8
    truth = _truth(p, cap, t[:, None] if per_token else t, dtype)
    h = p["h"].to(dtype).clone().requires_grad_()
    w = p["w"].to(dtype).clone().requires_grad_()
    temp = p["t"].to(dtype) if per_token else t
    opts = LinearOptions(temperature=temp, logit_scale=SCALE, softcap=cap, tile_rows=4, tile_cols=8)
    r = linear_logprobs(h, w, p["y"], with_entropy=True, options=opts)
    assert r.entropy is not None
    (p["c_lp"] * r.logprobs + p["c_ent"] * r.entropy + p["c_lse"] * r.lse**2).sum().backward()
    assert h.grad is not None and w.grad is not None
    for got, key in (
        (r.logprobs, "lp"),
        (r.entropy, "ent"),
        (r.lse, "lse"),
        (h.grad, "dh"),
        (w.grad, "dw"),
    ):
        close_to_float64(got, truth[key], dtype)


def _token_loss(p: dict[str, torch.Tensor], entropy_grad: bool) -> Any:
    def loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        out = (p["c_lp"][rows] * lp).sum()
        return out + (p["c_ent"][rows] * ent).sum() if entropy_grad else out

    return loss


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_fused_token_loss_against_float64(
    dtype: torch.dtype, cap: float, entropy_grad: bool, backend: str
) -> None:
    """The single pass (``entropy_grad=False``: the slope in the buffer, the label's
    column scaled at the flush) and the two-pass tile, with an lse loss and an
    upstream gradient 0.7."""
    skip_fp64_triton(backend, dtype)
    p = _problem(1)
    if not entropy_grad:
        p["c_ent"] = torch.zeros_like(p["c_ent"])
    truth = _truth(p, cap, p["t"][:, None], dtype)
    h = p["h"].to(dtype).clone().requires_grad_()
    w = p["w"].to(dtype).clone().requires_grad_()
    f = fused_token_loss(
        h,
        w,
        p["y"],
        _token_loss(p, entropy_grad),
        options=LinearOptions(
            temperature=p["t"].to(dtype), logit_scale=SCALE, softcap=cap, tile_rows=4
        ),
        entropy_grad=entropy_grad,
        lse_loss=lambda lse, rows: (p["c_lse"][rows] * lse**2).sum(),
    )
    (f.loss * 0.7).backward()
    assert h.grad is not None and w.grad is not None
    close_to_float64(f.loss, truth["loss"], dtype)
    close_to_float64(f.logprobs, truth["lp"], dtype)
    close_to_float64(f.entropy, truth["ent"], dtype)
    close_to_float64(h.grad, 0.7 * truth["dh"], dtype)
    close_to_float64(w.grad, 0.7 * truth["dw"], dtype)


@pytest.mark.parametrize("entropy_grad", [None, False, True], ids=["linear", "single", "two-pass"])
def test_whole_blocks_against_float64(entropy_grad: bool | None, backend: str) -> None:
    """A vocabulary of 150: the kernels' unmasked full blocks (64 columns under the
    interpreter) and a ragged tail, fp32."""
    p = _problem(9, v=150)
    if not entropy_grad:
        p["c_ent"] = torch.zeros_like(p["c_ent"])
    truth = _truth(p, 5.0, p["t"][:, None], torch.float32)
    h = p["h"].float().requires_grad_()
    w = p["w"].float().requires_grad_()
    opts = LinearOptions(temperature=p["t"].float(), logit_scale=SCALE, softcap=5.0)
    if entropy_grad is None:
        r = linear_logprobs(h, w, p["y"], with_entropy=True, options=opts)
        assert r.entropy is not None
        (p["c_lp"] * r.logprobs + p["c_ent"] * r.entropy + p["c_lse"] * r.lse**2).sum().backward()
    else:
        lse_loss = lambda lse, rows: (p["c_lse"][rows] * lse**2).sum()  # noqa: E731
        f = fused_token_loss(
            h,
            w,
            p["y"],
            _token_loss(p, entropy_grad),
            options=opts,
            entropy_grad=entropy_grad,
            lse_loss=lse_loss,
        )
        f.loss.backward()
        close_to_float64(f.loss, truth["loss"], torch.float32)
    assert h.grad is not None and w.grad is not None
    close_to_float64(h.grad, truth["dh"], torch.float32)
    close_to_float64(w.grad, truth["dw"], torch.float32)


def test_gathered_values_are_capped(backend: str) -> None:
    """The engine's ``logits_of`` (the epilogues' gathers and maxima) reads capped,
    tempered logits on both backends, whole tiles and gathered columns alike."""
    from torch_impl.processors._engine import Engine
    from torch_impl.processors._options import prologue

    p = _problem(10)
    h, w = p["h"].float(), p["w"].float()
    opts = LinearOptions(softcap=5.0, temperature=p["t"].float(), logit_scale=SCALE)
    _, hh, setup = prologue("test", h, w, p["y"], opts, {})
    eng = Engine(hh, w, setup)
    rows, cols = slice(2, 9), torch.tensor([[0, 3], [5, 28]]).repeat(4, 1)[:7]
    z = eng.logits(rows, eng.weight_all())
    want = _capped(p["h"][rows] @ p["w"].T, 5.0, p["t"][rows, None])
    torch.testing.assert_close(
        eng.logits_of(z.gather(1, cols), rows).double(), want.gather(1, cols), rtol=2e-6, atol=2e-6
    )
    torch.testing.assert_close(
        eng.logits_of(z.amax(1), rows).double(), want.amax(1), rtol=2e-6, atol=2e-6
    )
    torch.testing.assert_close(
        eng.logits_of(z, rows, inplace=True).double(), want, rtol=2e-6, atol=2e-6
    )


def test_nan_hidden_states_give_nan_rows_only() -> None:
    p = _problem(2)
    h = p["h"].clone()
    h[3, 1] = float("nan")
    r = linear_logprobs(h, p["w"], p["y"], options=LinearOptions(softcap=5.0))
    assert math.isnan(float(r.logprobs[3]))
    assert torch.isfinite(torch.cat([r.logprobs[:3], r.logprobs[4:]])).all()


def test_an_infinite_logit_is_capped(backend: str) -> None:
    """``u = +-inf`` (an infinite hidden state against finite weights) is capped to
    ``+-s / T`` like any other logit, on both backends (the kernels' masked lanes are
    told apart from a logit of -inf): finite logprobs, equal to float64's."""
    p = _problem(8)
    h = p["h"].float()
    h[4] = 0.0
    h[4, 0] = float("inf")  # u[4] = inf * w[:, 0]: +-inf, no NaN
    r = linear_logprobs(
        h, p["w"].float(), p["y"], options=LinearOptions(softcap=5.0, temperature=0.8)
    )
    z = 5.0 * torch.tanh(h.double() @ p["w"].float().double().T / 5.0) / 0.8
    want = torch.where(
        p["y"] == IGNORE, 0.0, z.log_softmax(-1).gather(1, p["y"].clamp(min=0)[:, None]).squeeze(1)
    )
    assert torch.isfinite(r.logprobs).all()
    torch.testing.assert_close(r.logprobs.double(), want, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------- the processors


def _ctx(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cap: Any) -> OutputContext:
    return OutputContext(
        hidden_states=h,
        labels=y,
        vocab_weight=w,
        vocab=VocabShard(0, V, V),
        scale_logits=lambda x: x * SCALE,
        config=types.SimpleNamespace(final_logit_softcapping=cap),
    )


def _ce_problem(seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (B, S), generator=g)
    y[0, 2] = IGNORE
    return {
        "h": torch.randn(S, B, H, generator=g, dtype=torch.float64) * 3.0,
        "w": torch.randn(V, H, generator=g, dtype=torch.float64),
        "y": y,
    }


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_cross_entropy_honours_the_configs_softcap(
    dtype: torch.dtype, cap: float, backend: str
) -> None:
    """``config.final_logit_softcapping`` (where a release has it) applied after MuP's
    ``scale_logits`` factor, before the temperature: the mean cross-entropy and its
    gradients equal float64 of the capped logits."""
    skip_fp64_triton(backend, dtype)
    p, t = _ce_problem(), 0.8
    hh, ww = p["h"].clone().requires_grad_(), p["w"].clone().requires_grad_()
    z = _capped(torch.einsum("sbh,vh->bsv", hh, ww), cap, t)
    y = p["y"]
    ce = torch.where(
        y == IGNORE, 0.0, -z.log_softmax(-1).gather(2, y.clamp(min=0)[..., None]).squeeze(-1)
    )
    want = ce.sum() / (y != IGNORE).sum()
    want.backward()
    h = p["h"].to(dtype).clone().requires_grad_()
    w = p["w"].to(dtype).clone().requires_grad_()
    out = cross_entropy_loss(reduction="mean", temperature=t, tile_rows=4, tile_cols=8)(
        _ctx(h, w, y, cap)
    )
    out["loss"].backward()
    assert h.grad is not None and w.grad is not None and hh.grad is not None and ww.grad is not None
    close_to_float64(out["loss"], want.detach(), dtype)
    close_to_float64(h.grad, hh.grad, dtype)
    close_to_float64(w.grad, ww.grad, dtype)


def test_selected_logprobs_honours_the_configs_softcap() -> None:
    p, cap = _ce_problem(4), 2.0
    z = _capped(torch.einsum("sbh,vh->bsv", p["h"], p["w"]), cap, 1.0)
    logp = z.log_softmax(-1)
    y = p["y"]
    out = selected_logprobs(entropy=True)(_ctx(p["h"], p["w"], y, cap))
    want = torch.where(y == IGNORE, 0.0, logp.gather(2, y.clamp(min=0)[..., None]).squeeze(-1))
    torch.testing.assert_close(out["logprobs"].double(), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        out["entropy"].double(), -(logp.exp() * logp).sum(-1), rtol=1e-12, atol=1e-12
    )
    off = selected_logprobs()(_ctx(p["h"], p["w"], y, 0))  # 0 (or None, False): off
    plain = (
        torch.einsum("sbh,vh->bsv", p["h"], p["w"])
        .mul(SCALE)
        .log_softmax(-1)
        .gather(2, y.clamp(min=0)[..., None])
    )
    torch.testing.assert_close(
        off["logprobs"].double(), torch.where(y == IGNORE, 0.0, plain.squeeze(-1))
    )


def test_policy_loss_honours_the_configs_softcap() -> None:
    """``policy_loss`` with the config's cap equals ``policy_loss`` on the capped logits
    materialised in float64 (hidden states = the logits, weight = the identity): every
    output, and ``dh``, ``dW`` through autograd of the cap."""
    p, cap = _ce_problem(6), 2.0
    g = torch.Generator().manual_seed(7)
    batch = PolicyBatch(
        old_logprobs=-torch.rand(B, S, generator=g, dtype=torch.float64) * 2,
        advantages=torch.randn(B, S, generator=g, dtype=torch.float64),
        mask=torch.ones(B, S, dtype=torch.float64),
    )
    outs, grads = [], []
    for materialised in (False, True):
        h, w = p["h"].clone().requires_grad_(), p["w"].clone().requires_grad_()
        if materialised:
            z = _capped(torch.einsum("sbh,vh->sbv", h, w), cap, 1.0)
            ctx = dataclasses.replace(
                _ctx(z, torch.eye(V, dtype=torch.float64), p["y"], None), scale_logits=None
            )
        else:
            ctx = _ctx(h, w, p["y"], cap)
        out = policy_loss()(dataclasses.replace(ctx, context=batch))
        outs.append(out)
        grads.append(torch.autograd.grad(out["loss"], (h, w)))
    for key in outs[1]:
        torch.testing.assert_close(outs[0][key], outs[1][key], rtol=1e-12, atol=1e-12)
    for got, want in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "5"], ids=repr)
def test_a_bad_config_softcap_is_refused_by_name(bad: Any) -> None:
    p = _ce_problem()
    with pytest.raises(ContractError) as info:
        cross_entropy_loss(reduction="sum")(_ctx(p["h"], p["w"], p["y"], bad))
    assert info.value.field == "config.final_logit_softcapping"


@pytest.mark.parametrize(
    "bad", [0.0, -1.0, float("nan"), float("inf"), True, "5", torch.tensor(5.0)], ids=repr
)
def test_bad_softcap_raises_by_name(bad: Any) -> None:
    with pytest.raises(ContractError, match=r"^softcap: expected a finite number > 0") as info:
        LinearOptions(softcap=bad)
    assert repr(bad) in str(info.value) or "tensor" in str(info.value)


# ---------------------------------------------------------------- top-k and distillation


def _u(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return h @ w.T + b


def _topk_truth(
    p: dict[str, torch.Tensor],
    b: torch.Tensor,
    cap: float,
    t: Any,
    ids: torch.Tensor,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """Float64 autograd of ``sum(c_k * lp[ids]) + sum(c_lp * lp[y]) + sum(c_ent * H)`` at
    the implementation's ``ids`` (its ties are its own values'), and the true top-k values."""
    hr, wr, br = (x.to(dtype).double().clone().requires_grad_() for x in (p["h"], p["w"], b))
    logp = _capped(_u(hr, wr, br), cap, t).log_softmax(-1)
    y = p["y"]
    lp = torch.where(y == IGNORE, 0.0, logp.gather(1, y.clamp(min=0)[:, None]).squeeze(1))
    ent = -(logp.exp() * logp).sum(-1)
    at_ids = logp.gather(1, ids)
    (p["c_k"] * at_ids).sum().add((p["c_lp"] * lp + p["c_ent"] * ent).sum()).backward()
    top = logp.detach().topk(ids.shape[1], dim=1).values
    return {"top": top, "at_ids": at_ids.detach(), "lp": lp.detach(), "ent": ent.detach(),
            "dh": hr.grad, "dw": wr.grad, "db": br.grad}  # fmt: skip


@pytest.mark.parametrize(("cap", "per_token"), [(1.0, True), (5.0, False), (30.0, True)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_topk_against_float64(
    dtype: torch.dtype, cap: float, per_token: bool, backend: str
) -> None:
    """``linear_topk_logprobs`` with a bias: the top-k values (ids checked against the
    truth's values at them), the label's logprob, the entropy, and ``dh``, ``dW``, ``db``
    of a loss on all three (the top-k's slope taken from the gathered capped values)."""
    skip_fp64_triton(backend, dtype)
    p, k = _problem(11), 4
    p["c_k"] = torch.randn(N, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    b64 = torch.randn(V, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 3.0
    h, w, b = (x.to(dtype).clone().requires_grad_() for x in (p["h"], p["w"], b64))
    temp = p["t"].to(dtype) if per_token else 0.8
    opts = LinearOptions(temperature=temp, logit_scale=SCALE, softcap=cap, tile_rows=4, tile_cols=8)
    r = linear_topk_logprobs(h, w, k=k, labels=p["y"], options=opts, with_entropy=True, bias=b)
    assert r.label_logprobs is not None and r.entropy is not None
    (p["c_k"] * r.logprobs).sum().add(
        (p["c_lp"] * r.label_logprobs + p["c_ent"] * r.entropy).sum()
    ).backward()
    truth = _topk_truth(p, b64, cap, p["t"][:, None] if per_token else 0.8, r.ids, dtype)
    for got, want in (
        (r.logprobs, truth["top"]),
        (r.logprobs, truth["at_ids"]),
        (r.label_logprobs, truth["lp"]),
        (r.entropy, truth["ent"]),
        (h.grad, truth["dh"]),
        (w.grad, truth["dw"]),
        (b.grad, truth["db"]),
    ):
        assert got is not None
        close_to_float64(got, want, dtype)


@pytest.mark.parametrize("tile_cols", [4, 16])
def test_topk_ties_of_capped_values(tile_cols: int, backend: str) -> None:
    """Logits that differ before the cap but round to one capped value are a tie (the
    smaller id first), on both backends (the Triton tiles hold ``u``: their order is
    not the capped values'): top-k's ids and distillation's top-1 agreement."""
    w = torch.zeros(V, 2)
    w[:, 1] = torch.linspace(-1, 1, V)
    w[[1, 2, 5, 7], 0] = torch.tensor([30.0, 35.0, 40.0, 45.0])  # tanh rounds to 1 in fp32
    h = torch.tensor([[1.0, 0.1], [1.0, -0.2]])
    r = linear_topk_logprobs(h, w, k=3, options=LinearOptions(softcap=1.0, tile_cols=tile_cols))
    assert torch.equal(r.ids, torch.tensor([[1, 2, 5], [1, 2, 5]]))
    teacher = SparseTeacher(
        ids=torch.tensor([[1, 0], [2, 0]]), logprobs=torch.tensor([[-0.1, -3.0]] * 2)
    )
    opts = LinearOptions(softcap=1.0, tile_rows=1)
    d = linear_distillation_loss(
        h, w, None, teacher, options=opts, config=DistillConfig(tail="bucket")
    )
    assert d.top1_agreement.tolist() == [True, False]  # the student's top-1: id 1


def _divergence(log_p: torch.Tensor, log_q: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """The conventions' divergences, written independently (every probability > 0 here)."""
    p, q = log_p.exp(), log_q.exp()
    if kind == "forward-kl":
        return (p * (log_p - log_q)).sum(-1)
    if kind == "reverse-kl":
        return (q * (log_q - log_p)).sum(-1)
    log_m = torch.logaddexp(math.log(beta) + log_p, math.log(1 - beta) + log_q)
    return beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)


def _teacher(
    form: str, seed: int, h: torch.Tensor, w: torch.Tensor, t: float = 0.8
) -> tuple[Any, Any]:
    """``(teacher, log_p_of(z))``: a sparse teacher's top-4 (renormalize or bucket) of
    float64 logits, or a dense teacher with its own logit scale and softcap, near the
    student's ``h @ w.T``; ``log_p_of`` maps the student's capped logits ``z`` ``[n, V]``
    to ``(log P, log Q)`` rows."""
    g, n = torch.Generator().manual_seed(seed), h.shape[0]
    th = torch.cat([h, torch.randn(n, 2, generator=g, dtype=torch.float64) * 2], 1)
    tw = torch.cat([w, torch.randn(V, 2, generator=g, dtype=torch.float64)], 1)
    if form == "dense":
        log_p = _capped(th @ tw.T * (1.3 / SCALE), 4.0, t).log_softmax(-1)  # c_t = 1.3, s_t = 4
        return DenseTeacher(th, tw, logit_scale=1.3, softcap=4.0), lambda z: (
            log_p,
            z.log_softmax(-1),
        )
    lp_t, ids = (th @ tw.T).log_softmax(-1).topk(4, dim=1)
    teacher = SparseTeacher(ids=ids, logprobs=lp_t.float())
    lp_t = lp_t.float().double()

    def log_pq(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        zi = z.gather(1, ids)
        if form == "renormalize":
            return lp_t.log_softmax(-1), zi.log_softmax(-1)
        lq = zi - torch.logsumexp(z, -1, keepdim=True)
        tails = [torch.log(-torch.expm1(torch.logsumexp(x, -1, keepdim=True))) for x in (lp_t, lq)]
        return torch.cat([lp_t, tails[0]], -1), torch.cat([lq, tails[1]], -1)

    return teacher, log_pq


@pytest.mark.parametrize("form", ["renormalize", "bucket", "dense"])
@pytest.mark.parametrize("kind", ["forward-kl", "reverse-kl", "jsd"])
def test_distillation_against_float64(kind: str, form: str, backend: str) -> None:
    """``linear_distillation_loss`` with a capped student (and a bias), each divergence
    and teacher form (the dense teacher capped by its own softcap): the token-mean loss,
    the per-row KL, ``dh``, ``dW``, ``db`` against float64 autograd (fp64 on the torch
    backend, fp32 on Triton)."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    cap = CAPS[
        (
            ["forward-kl", "reverse-kl", "jsd"].index(kind)
            + ["renormalize", "bucket", "dense"].index(form)
        )
        % 3
    ]
    p, t, beta = _problem(12), 0.8, 0.3
    b64 = torch.randn(V, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3.0
    teacher, log_pq = _teacher(form, 13, p["h"], p["w"])
    hr, wr, br = (x.to(dtype).double().clone().requires_grad_() for x in (p["h"], p["w"], b64))
    log_p, log_q = log_pq(_capped(_u(hr, wr, br), cap, t))
    m = (p["y"] != IGNORE).double()
    want = (m * _divergence(log_p, log_q, kind, beta)).sum() / m.sum()
    want.backward()
    h, w, b = (x.to(dtype).clone().requires_grad_() for x in (p["h"], p["w"], b64))
    tail = "renormalize" if form == "renormalize" else "bucket"
    cfg = DistillConfig(
        divergence=kind,  # type: ignore[arg-type]
        tail=tail,  # type: ignore[arg-type]
        beta=beta,
        temperature=t,
    )
    opts = LinearOptions(logit_scale=SCALE, softcap=cap, tile_rows=4)
    r = linear_distillation_loss(h, w, p["y"], teacher, options=opts, config=cfg, bias=b)
    r.loss.backward()
    close_to_float64(r.loss, want.detach(), dtype)
    kl = _divergence(log_p, log_q, "forward-kl", beta).detach()
    close_to_float64(torch.where(m > 0, r.kl, 0.0), m * kl, dtype)
    for got, ref in ((h.grad, hr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert got is not None and ref is not None
        close_to_float64(got, ref, dtype)
    z = _capped(_u(*(x.to(dtype).double() for x in (p["h"], p["w"], b64))), cap, t)
    top2 = z.topk(2).values  # agreement where the student's top-1 is clear of ties
    clear = (top2[:, 0] - top2[:, 1] > 1e-5) & (m > 0)
    top1 = log_p.argmax(1) if form == "dense" else teacher.ids[:, 0]
    agree = z.argmax(1) == top1
    assert agree[clear].any() and torch.equal(r.top1_agreement[clear], agree[clear])


def test_topk_and_distillation_follow_the_configs_softcap() -> None:
    """The processors take ``config.final_logit_softcapping`` as ``cross_entropy_loss``
    does: ``topk_logprobs`` and ``distillation_loss`` (sparse teacher) equal float64 of
    the capped logits; a dense teacher's bad softcap is refused by name."""
    p, cap, t = _ce_problem(5), 2.0, 0.9
    z = _capped(torch.einsum("sbh,vh->bsv", p["h"], p["w"]), cap, t)
    logp = z.log_softmax(-1)
    out = topk_logprobs(3, temperature=t)(_ctx(p["h"], p["w"], p["y"], cap))
    torch.testing.assert_close(
        out["topk_logprobs"].double(), logp.topk(3).values, rtol=1e-12, atol=1e-12
    )
    assert torch.equal(out["topk_ids"], logp.topk(3).indices)
    lp_t, ids = (torch.einsum("sbh,vh->bsv", p["h"], p["w"]) * 0.5).log_softmax(-1).topk(3)
    cfg = DistillConfig(temperature=t)
    ctx = dataclasses.replace(
        _ctx(p["h"], p["w"], p["y"], cap), context=SparseTeacher(ids=ids, logprobs=lp_t)
    )
    got = distillation_loss(cfg)(ctx)["loss"]
    lq = z.gather(2, ids).log_softmax(-1)
    d = (lp_t.softmax(-1) * (lp_t.log_softmax(-1) - lq)).sum(-1)
    m = (p["y"] != IGNORE).double()
    torch.testing.assert_close(got.double(), (m * d).sum() / m.sum(), rtol=1e-12, atol=1e-12)
    bad = DenseTeacher(p["h"], p["w"], softcap=-1.0)
    with pytest.raises(ContractError) as info:
        distillation_loss(cfg)(dataclasses.replace(ctx, context=bad))
    assert info.value.field == "context.softcap"


# ---------------------------------------------------------------- bf16 beside the naive path


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize(
    "form", ["linear_logprobs", "fused single pass", "fused two-pass", "top-k", "distillation"]
)
def test_bf16_compute_against_float64_beside_the_naive_path(form: str, backend: str) -> None:
    """Ours at ``compute_dtype=bf16`` on bf16 inputs, the naive path (a bf16 GEMM's
    logits, rounded to bf16, capped and normalised in fp32) and the truth (float64 of
    the same bf16 inputs): each value and gradient within a third of the naive error,
    or twice the bf16 rounding of the truth. The loss: ``sum(c * logprobs + 0.3 *
    entropy)`` (the entropy's term only in the two-pass form and top-k, whose top-4
    logprobs add ``sum(c_k * top)`` at our ids); distillation: the forward KL to a
    dense teacher capped at 3 (its logit scale 1.2), token-mean."""
    g = torch.Generator().manual_seed(6)
    n, hid, vocab, cap, t = 24, 16, 512 if backend == "triton" else 2048, 5.0, 0.9
    h0 = (torch.randn(n, hid, generator=g) * 2.0).to(BF16)
    w0 = (torch.randn(vocab, hid, generator=g) * 0.5).to(BF16)
    th, tw = (
        (torch.randn(n, 8, generator=g) * 2.0).to(BF16),
        (torch.randn(vocab, 8, generator=g) * 0.5).to(BF16),
    )
    y = torch.randint(0, vocab, (n,), generator=g)
    y[3] = IGNORE
    cot, cot_k = (
        torch.randn(n, generator=g, dtype=torch.float64),
        torch.randn(n, 4, generator=g, dtype=torch.float64),
    )
    c_ent = 0.3 if form in ("fused two-pass", "top-k") else 0.0
    m = (y != IGNORE).double()
    ids: list[torch.Tensor] = []

    def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        out = (cot[rows] * lp.double()).sum()
        return out + c_ent * ent.double().sum() if c_ent else out

    def run(how: str) -> dict[str, torch.Tensor]:
        h = h0.to(torch.float64 if how == "truth" else BF16).requires_grad_()
        w = w0.to(h.dtype).requires_grad_()
        out: dict[str, torch.Tensor] = {}
        if how == "ours":
            opts = LinearOptions(compute_dtype=BF16, temperature=t, logit_scale=SCALE, softcap=cap)
            if form == "distillation":
                opts = dataclasses.replace(opts, temperature=1.0)
                teacher = DenseTeacher(th, tw, logit_scale=1.2, softcap=3.0)
                loss = linear_distillation_loss(
                    h, w, y, teacher, options=opts, config=DistillConfig(temperature=t)
                ).loss
            elif form == "top-k":
                r = linear_topk_logprobs(h, w, k=4, labels=y, options=opts, with_entropy=True)
                assert r.label_logprobs is not None and r.entropy is not None
                ids.append(r.ids)
                lp, ent, out["top"] = r.label_logprobs, r.entropy, r.logprobs.detach()
                loss = token_loss(lp, ent, slice(None)) + (cot_k * r.logprobs.double()).sum()
            elif form == "linear_logprobs":
                r = linear_logprobs(h, w, y, with_entropy=True, options=opts)
                lp, ent = r.logprobs, r.entropy
                assert ent is not None
                loss = token_loss(lp, ent, slice(None))
            else:
                f = fused_token_loss(h, w, y, token_loss, options=opts, entropy_grad=bool(c_ent))
                lp, ent, loss = f.logprobs, f.entropy, f.loss
        else:
            u = h @ w.T  # bf16 for the naive path: rounded to bf16
            logp = _capped(u.float() if how == "naive" else u, cap, t).log_softmax(-1)
            lp = torch.where(y == IGNORE, 0.0, logp.gather(1, y.clamp(min=0)[:, None]).squeeze(1))
            ent = -(logp.exp() * logp).sum(-1)
            loss = token_loss(lp, ent, slice(None))
            if form == "top-k":
                out["top"] = logp.gather(1, ids[0]).detach()
                loss = loss + (cot_k * logp.gather(1, ids[0]).double()).sum()
            if form == "distillation":
                ut = th.to(h.dtype) @ tw.to(h.dtype).T
                log_p = _capped(
                    (ut.float() if how == "naive" else ut) * (1.2 / SCALE), 3.0, t
                ).log_softmax(-1)
                d = (log_p.exp() * (log_p - logp)).sum(-1)
                loss = (m * d.double()).sum() / m.sum()
        dh, dw = torch.autograd.grad(loss, (h, w))
        if form == "distillation":
            return {"loss": loss.detach(), "dh": dh, "dw": dw}
        return {**out, "lp": lp.detach(), "ent": ent.detach(), "dh": dh, "dw": dw}

    ours, truth, naive = run("ours"), run("truth"), run("naive")
    for key, want in truth.items():
        err, naive_err, rounding = (
            _rel(ours[key], want),
            _rel(naive[key], want),
            _rel(want.to(BF16), want),
        )
        assert err <= max(naive_err / 3, 2 * rounding), (key, err, naive_err, rounding)


# ---------------------------------------------------------------- tp=2


def _tp2(rank: int, p: dict[str, torch.Tensor], truth: dict[str, Any], backends: list[str]) -> None:
    from megatron.core import parallel_state

    from torch_impl import TorchCollectives

    coll = TorchCollectives(
        parallel_state.get_tensor_model_parallel_group(), sequence_parallel=False
    )
    lo, hi = (0, 14) if rank == 0 else (14, V)
    for be in backends:
        dtype = torch.float64 if be == "torch" else torch.float32
        tol = {"rtol": 1e-10, "atol": 1e-10} if be == "torch" else {"rtol": 2e-5, "atol": 1e-4}
        base = {
            "temperature": p["t"].to(dtype),
            "logit_scale": SCALE,
            "softcap": 5.0,
            "vocab": VocabShard(lo, hi, V),
            "collectives": coll,
            "backend": be,
        }
        h = p["h"].to(dtype).clone().requires_grad_()
        w = p["w"][lo:hi].to(dtype).clone().requires_grad_()
        r = linear_logprobs(
            h, w, p["y"], with_entropy=True, options=LinearOptions(tile_rows=4, tile_cols=8, **base)
        )
        assert r.entropy is not None
        (p["c_lp"] * r.logprobs + p["c_ent"] * r.entropy + p["c_lse"] * r.lse**2).sum().backward()
        torch.testing.assert_close(r.logprobs.double(), truth["lp"], **tol)
        torch.testing.assert_close(h.grad.double(), truth["dh"], **tol)
        torch.testing.assert_close(w.grad.double(), truth["dw"][lo:hi], **tol)
        for entropy_grad in (False, True):  # the single pass and the two-pass tile
            h = p["h"].to(dtype).clone().requires_grad_()
            w = p["w"][lo:hi].to(dtype).clone().requires_grad_()
            f = fused_token_loss(
                h,
                w,
                p["y"],
                _token_loss(p, entropy_grad),
                options=LinearOptions(tile_rows=4, **base),
                entropy_grad=entropy_grad,
                lse_loss=lambda lse, rows: (p["c_lse"][rows] * lse**2).sum(),
            )
            f.loss.backward()
            want = truth["ent0" if not entropy_grad else "full"]
            torch.testing.assert_close(f.loss.double(), want["loss"], **tol)
            torch.testing.assert_close(h.grad.double(), want["dh"], **tol)
            torch.testing.assert_close(w.grad.double(), want["dw"][lo:hi], **tol)
        _tp2_topk_distill(p, truth, dtype, base, (lo, hi), tol)


def _tp2_topk_distill(
    p: dict[str, torch.Tensor],
    truth: dict[str, Any],
    dtype: torch.dtype,
    base: Any,
    shard: Any,
    tol: Any,
) -> None:
    """Top-k (with a bias) and distillation (a dense teacher's jsd, a sparse teacher's
    bucket reverse KL) on this rank's shard, against the float64 truths."""
    lo, hi = shard
    h, w, b = (x.to(dtype).clone().requires_grad_() for x in (p["h"], p["w"][lo:hi], p["b"][lo:hi]))
    opts = LinearOptions(tile_rows=4, tile_cols=8, **base)
    r = linear_topk_logprobs(h, w, k=4, labels=p["y"], options=opts, with_entropy=True, bias=b)
    assert r.label_logprobs is not None and r.entropy is not None
    (p["c_k"] * r.logprobs).sum().add(
        (p["c_lp"] * r.label_logprobs + p["c_ent"] * r.entropy).sum()
    ).backward()
    want = truth["topk"]
    assert torch.equal(r.ids, want["ids"])
    for got, key in ((r.logprobs, "at_ids"), (r.entropy, "ent"), (h.grad, "dh")):
        torch.testing.assert_close(got.double(), want[key], **tol)
    torch.testing.assert_close(w.grad.double(), want["dw"][lo:hi], **tol)
    torch.testing.assert_close(b.grad.double(), want["db"][lo:hi], **tol)
    for kind, form in (("jsd", "dense"), ("reverse-kl", "bucket")):
        teacher, want = _teacher(form, 14, p["h"], p["w"])[0], truth[form]
        if form == "dense":
            teacher = dataclasses.replace(
                teacher, weight=teacher.weight[lo:hi], vocab=base["vocab"]
            )
        h, w = (
            p["h"].to(dtype).clone().requires_grad_(),
            p["w"][lo:hi].to(dtype).clone().requires_grad_(),
        )
        cfg = DistillConfig(
            divergence=kind,  # type: ignore[arg-type]
            tail="bucket",  # type: ignore[arg-type]
            beta=0.3,
            temperature=0.8,
        )
        opts = LinearOptions(tile_rows=4, **{**base, "temperature": 1.0})
        d = linear_distillation_loss(h, w, p["y"], teacher, options=opts, config=cfg)
        d.loss.backward()
        torch.testing.assert_close(d.loss.double(), want["loss"], **tol)
        torch.testing.assert_close(h.grad.double(), want["dh"], **tol)
        torch.testing.assert_close(w.grad.double(), want["dw"][lo:hi], **tol)


def _distill_truth(p: dict[str, torch.Tensor], kind: str, form: str, cap: float) -> dict[str, Any]:
    h, w = p["h"].clone().requires_grad_(), p["w"].clone().requires_grad_()
    log_p, log_q = _teacher(form, 14, p["h"], p["w"])[1](_capped(h @ w.T, cap, 0.8))
    m = (p["y"] != IGNORE).double()
    loss = (m * _divergence(log_p, log_q, kind, 0.3)).sum() / m.sum()
    loss.backward()
    return {"loss": loss.detach(), "dh": h.grad, "dw": w.grad}


@pytest.mark.release_independent
def test_tp2_against_float64() -> None:
    """Two gloo processes, unequal vocabulary shards: linear_logprobs and both forms
    of the fused loss, top-k and distillation, torch (fp64) and, where installed,
    Triton (fp32, interpreter)."""
    p = _problem(7)
    g = torch.Generator().manual_seed(8)
    p["c_k"], p["b"] = (
        torch.randn(N, 4, generator=g, dtype=torch.float64),
        torch.randn(V, generator=g, dtype=torch.float64),
    )
    truth = _truth(p, 5.0, p["t"][:, None])
    no_ent = {**p, "c_ent": torch.zeros_like(p["c_ent"])}
    truth = {**truth, "full": truth, "ent0": _truth(no_ent, 5.0, p["t"][:, None])}
    hr, wr, br = (x.double() for x in (p["h"], p["w"], p["b"]))
    ids = _capped(_u(hr, wr, br), 5.0, p["t"][:, None]).topk(4, dim=1).indices
    truth["topk"] = {"ids": ids, **_topk_truth(p, p["b"], 5.0, p["t"][:, None], ids, torch.float64)}
    truth["dense"] = _distill_truth(p, "jsd", "dense", 5.0)
    truth["bucket"] = _distill_truth(p, "reverse-kl", "bucket", 5.0)
    backends = ["torch"] + (["triton"] if importlib.util.find_spec("triton") is not None else [])
    run_distributed(_tp2, p, truth, backends, tp=2)


@pytest.mark.parametrize("entropy_grad", [None, False, True], ids=["linear", "single", "two-pass"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_a_bias_enters_before_the_cap(
    dtype: torch.dtype, entropy_grad: bool | None, backend: str
) -> None:
    """``z = s * tanh((h @ W.T + b) * logit_scale / s) / T``: values and ``dh``, ``dW``,
    ``db`` against float64 autograd, the linear function and both fused passes."""
    skip_fp64_triton(backend, dtype)
    p, cap = _problem(5), 5.0
    b64 = torch.randn(V, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 4.0
    hr, wr, br = (x.to(dtype).double().clone().requires_grad_() for x in (p["h"], p["w"], b64))
    z = _capped(hr @ wr.T + br, cap, p["t"][:, None])
    logp, y = z.log_softmax(-1), p["y"]
    lp = torch.where(y == IGNORE, 0.0, logp.gather(1, y.clamp(min=0)[:, None]).squeeze(1))
    ent = -(logp.exp() * logp).sum(-1)
    c_ent = p["c_ent"] if entropy_grad is not False else torch.zeros_like(p["c_ent"])
    (p["c_lp"] * lp + c_ent * ent).sum().backward()
    h, w, b = (x.to(dtype).clone().requires_grad_() for x in (p["h"], p["w"], b64))
    opts = LinearOptions(
        temperature=p["t"].to(dtype), logit_scale=SCALE, softcap=cap, tile_rows=4, tile_cols=8
    )
    if entropy_grad is None:
        r = linear_logprobs(h, w, y, with_entropy=True, options=opts, bias=b)
        assert r.entropy is not None
        got_lp = r.logprobs
        (p["c_lp"] * r.logprobs + c_ent * r.entropy).sum().backward()
    else:
        loss = _token_loss(dict(p, c_ent=c_ent), entropy_grad)
        f = fused_token_loss(h, w, y, loss, options=opts, entropy_grad=entropy_grad, bias=b)
        got_lp = f.logprobs
        f.loss.backward()
    assert h.grad is not None and w.grad is not None and b.grad is not None
    close_to_float64(got_lp, lp.detach(), dtype)
    for got, want in ((h.grad, hr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert want is not None
        close_to_float64(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_gpu_checks_body_on_the_cpu(dtype: torch.dtype, backend: str) -> None:
    """``tests/processors/test_gpu_checks.py``'s softcap-and-bias check at a small size, so that its
    body's API drift fails here and not on the GPU."""
    peer_options(67, 24, 301, dtype, "cpu", backend)


@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "weighted"])
@pytest.mark.parametrize("fused", [False, True], ids=["linear", "fused"])
def test_the_mean_logit_is_of_the_capped_logits(fused: bool, weighted: bool, backend: str) -> None:
    """Label smoothing's mean logit ``sum_j c_j z_j / V`` under a cap (and a bias): of the
    capped, tempered logits, its gradient through the cap's slope, against float64
    autograd (fp32 compute; 150 columns reach the kernels' whole and partial blocks)."""
    v, cap = 150, 5.0
    p = _problem(6, v=v)
    g = torch.Generator().manual_seed(4)
    b64 = torch.randn(v, generator=g, dtype=torch.float64) * 3.0
    cw = (
        torch.rand(v, generator=g, dtype=torch.float64) + 0.5
        if weighted
        else torch.ones(v, dtype=torch.float64)
    )
    c_mean = torch.randn(N, generator=g, dtype=torch.float64)
    hr, wr, br = (x.float().double().clone().requires_grad_() for x in (p["h"], p["w"], b64))
    z = _capped(hr @ wr.T + br, cap, p["t"][:, None])
    y = p["y"]
    lp = torch.where(
        y == IGNORE, 0.0, z.log_softmax(-1).gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    )
    mean = (z * cw).sum(-1) / v
    (p["c_lp"] * lp + c_mean * mean).sum().backward()
    h, w, b = (x.float().clone().requires_grad_() for x in (p["h"], p["w"], b64))
    opts = LinearOptions(
        temperature=p["t"].float(), logit_scale=SCALE, softcap=cap, tile_rows=4, tile_cols=64
    )
    weights = cw.float() if weighted else None
    if fused:
        f = fused_token_loss(
            h, w, y, lambda lp, _, rows: (p["c_lp"][rows] * lp).sum(), options=opts, bias=b,
            mean_logit_loss=lambda m, rows: (c_mean[rows] * m).sum(), mean_logit_weights=weights,
        )  # fmt: skip
        got_mean, _ = f.mean_logit, f.loss.backward()
    else:
        r = linear_logprobs(
            h, w, y, options=opts, bias=b, with_mean_logit=True, mean_logit_weights=weights
        )
        got_mean, _ = (
            r.mean_logit,
            (p["c_lp"] * r.logprobs + c_mean * r.mean_logit).sum().backward(),
        )
    assert got_mean is not None
    close_to_float64(got_mean, mean.detach(), torch.float32)
    for got, want in ((h.grad, hr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert got is not None and want is not None
        close_to_float64(got, want, torch.float32)

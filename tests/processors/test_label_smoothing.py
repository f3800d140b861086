"""Label smoothing: the per-token mean logit of :func:`linear_logprobs`
(``with_mean_logit``), :func:`fused_token_loss`'s ``mean_logit_loss``, and
``cross_entropy_loss(label_smoothing=eps)``, against float64 materialised logits
(values, hidden-state and weight gradients) and against PyTorch's own
``F.cross_entropy(label_smoothing=eps)`` in float64, on both backends, at tp=1 and tp=2
(gloo); the option checked by name, and refused beside class weights."""

from __future__ import annotations

import importlib.util
import math
import typing
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hookspec import ContractError, OutputContext, ParallelLayout, VocabShard
from tests.support.backend_support import (
    close_to_float64,
    masked_context,
    masked_problem,
    skip_fp64_triton,
    token_problem,
)
from tests.support.distributed import run_distributed
from torch_impl.processors import (
    LinearOptions,
    cross_entropy_loss,
    fused_token_loss,
    linear_logprobs,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

IGNORE = -100
N, H, V = 13, 6, 29
B, S = 3, 5  # the processors' [b, s] = 15 tokens
SCALE = 0.7


def _problem(seed: int = 0) -> dict[str, torch.Tensor]:
    return token_problem(seed, N, H, V, coefficients=("c_lp", "c_mean"))


def _truth(
    p: dict[str, torch.Tensor], dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    """``sum(c_lp * logprobs + c_mean * z.mean(-1))`` from float64 logits of the inputs
    rounded to ``dtype``."""
    h = p["h"].to(dtype).double().clone().requires_grad_()
    w = p["w"].to(dtype).double().clone().requires_grad_()
    z = (h @ w.T) / p["t"][:, None]
    y = p["y"]
    lp = torch.where(
        y == IGNORE, 0.0, z.log_softmax(-1).gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    )
    mean = z.mean(-1) if "cw" not in p else (z * p["cw"]).sum(-1) / z.shape[-1]
    loss = (p["c_lp"] * lp + p["c_mean"] * mean).sum()
    loss.backward()
    assert h.grad is not None and w.grad is not None
    return {"mean": mean.detach(), "loss": loss.detach(), "dh": h.grad, "dw": w.grad}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_linear_logprobs_mean_logit_against_float64(dtype: torch.dtype, backend: str) -> None:
    """The mean logit at every token (ignored labels too), its gradient ``1 / V`` beside
    the logprobs', per-token temperature, tiles that split rows and columns (8 does not
    divide 29: a partial last column tile)."""
    skip_fp64_triton(backend, dtype)
    p = _problem()
    truth = _truth(p, dtype)
    h = p["h"].to(dtype).clone().requires_grad_()
    w = p["w"].to(dtype).clone().requires_grad_()
    opts = LinearOptions(temperature=p["t"], tile_rows=4, tile_cols=8)
    r = linear_logprobs(h, w, p["y"], options=opts, with_mean_logit=True)
    assert r.mean_logit is not None and r.mean_logit.shape == (N,)
    (p["c_lp"] * r.logprobs + p["c_mean"] * r.mean_logit).sum().backward()
    assert h.grad is not None and w.grad is not None
    close_to_float64(r.mean_logit, truth["mean"], dtype)
    close_to_float64(h.grad, truth["dh"], dtype)
    close_to_float64(w.grad, truth["dw"], dtype)
    assert linear_logprobs(h, w, p["y"], options=opts).mean_logit is None


@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "weighted"])
@pytest.mark.parametrize("fused", [False, True], ids=["linear_logprobs", "fused_token_loss"])
def test_wide_rows_against_float64(fused: bool, weighted: bool, backend: str) -> None:
    """150 columns: full kernel blocks (64 under the interpreter) and a partial one,
    in column tiles of 128 (linear_logprobs) and whole rows (the fused loss), fp32;
    the plain and the column-weighted mean logit."""
    g = torch.Generator().manual_seed(7)
    n, v = 5, 150
    p = {
        "h": torch.randn(n, H, generator=g, dtype=torch.float64),
        "w": torch.randn(v, H, generator=g, dtype=torch.float64),
        "y": torch.tensor([0, v - 1, IGNORE, 70, 3]),
        "t": torch.full((n,), 1.25, dtype=torch.float64),
        "c_lp": torch.randn(n, generator=g, dtype=torch.float64),
        "c_mean": torch.randn(n, generator=g, dtype=torch.float64),
    }
    c = None
    if weighted:
        c = p["cw"] = torch.rand(v, generator=g, dtype=torch.float64) * 2
    truth = _truth(p, torch.float32)
    h = p["h"].float().requires_grad_()
    w = p["w"].float().requires_grad_()
    opts = LinearOptions(temperature=1.25, tile_rows=4, tile_cols=128)  # a scalar T
    if fused:
        f = fused_token_loss(
            h,
            w,
            p["y"],
            lambda lp, ent, rows: (p["c_lp"][rows] * lp).sum(),
            options=opts,
            entropy_grad=False,
            mean_logit_loss=lambda mean, rows: (p["c_mean"][rows] * mean).sum(),
            mean_logit_weights=c,
        )
        f.loss.backward()
        mean = f.mean_logit
    else:
        r = linear_logprobs(h, w, p["y"], options=opts, with_mean_logit=True, mean_logit_weights=c)
        assert r.mean_logit is not None
        (p["c_lp"] * r.logprobs + p["c_mean"] * r.mean_logit).sum().backward()
        mean = r.mean_logit
    assert mean is not None and h.grad is not None and w.grad is not None
    close_to_float64(mean, truth["mean"], torch.float32)
    close_to_float64(h.grad, truth["dh"], torch.float32)
    close_to_float64(w.grad, truth["dw"], torch.float32)


def test_mean_logit_alone_has_the_uniform_gradient() -> None:
    """A loss of the mean logit alone: ``dh = c * W.mean(0) / T`` exactly as autograd."""
    p = _problem(1)
    h = p["h"].clone().requires_grad_()
    r = linear_logprobs(
        h, p["w"], p["y"], options=LinearOptions(tile_rows=4, tile_cols=8), with_mean_logit=True
    )
    assert r.mean_logit is not None
    (p["c_mean"] * r.mean_logit).sum().backward()
    assert h.grad is not None
    torch.testing.assert_close(
        h.grad, p["c_mean"][:, None] * p["w"].mean(0), rtol=1e-13, atol=1e-13
    )


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_fused_token_loss_mean_logit_loss_against_float64(
    dtype: torch.dtype, entropy_grad: bool, backend: str
) -> None:
    """``mean_logit_loss`` beside the token loss, with an upstream gradient 0.7."""
    skip_fp64_triton(backend, dtype)
    p = _problem(1)
    truth = _truth(p, dtype)
    h = p["h"].to(dtype).clone().requires_grad_()
    w = p["w"].to(dtype).clone().requires_grad_()
    f = fused_token_loss(
        h,
        w,
        p["y"],
        lambda lp, ent, rows: (p["c_lp"][rows] * lp).sum(),
        options=LinearOptions(temperature=p["t"], tile_rows=4),
        entropy_grad=entropy_grad,
        mean_logit_loss=lambda mean, rows: (p["c_mean"][rows] * mean).sum(),
    )
    (f.loss * 0.7).backward()
    assert h.grad is not None and w.grad is not None and f.mean_logit is not None
    close_to_float64(f.loss, truth["loss"], dtype)
    close_to_float64(f.mean_logit, truth["mean"], dtype)
    close_to_float64(h.grad, 0.7 * truth["dh"], dtype)
    close_to_float64(w.grad, 0.7 * truth["dw"], dtype)


def test_fused_mean_logit_loss_without_grad_and_checked_by_name() -> None:
    p = _problem()
    args = (p["h"], p["w"], p["y"], lambda lp, ent, rows: lp.sum())
    with torch.no_grad():
        f = fused_token_loss(*args, mean_logit_loss=lambda m, rows: m.sum())
    assert f.mean_logit is not None
    close_to_float64(
        f.mean_logit, _truth({**p, "t": torch.ones(N, dtype=torch.float64)})["mean"], torch.float64
    )
    assert fused_token_loss(*args).mean_logit is None
    with pytest.raises(ContractError, match=r"^mean_logit_loss: expected None or a callable"):
        fused_token_loss(*args, mean_logit_loss=3.0)  # type: ignore[arg-type]
    with pytest.raises(
        ContractError, match=r"^mean_logit_loss: expected a callable returning a 0-dim"
    ):
        fused_token_loss(*args, mean_logit_loss=lambda m, rows: m)


# ---------------------------------------------------------- cross_entropy_loss(label_smoothing=...)


def _ce_problem(seed: int = 2, v: int = V) -> dict[str, torch.Tensor]:
    return masked_problem(seed, B, S, H, v)


def _ce_truth(
    p: dict[str, torch.Tensor],
    reduction: str,
    eps: float,
    t: float,
    z_loss: float,
    mask: bool,
    cw: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """PyTorch's ``F.cross_entropy(weight=cw, label_smoothing=eps, ignore_index=-100)``
    in float64 (reduction ``"none"``, weighted by the mask for ``"sum"``/``"mean"``, the
    mean divided by ``sum(M * cw[y])``; without a mask PyTorch's own ``"sum"``/``"mean"``),
    plus the unweighted z-loss."""
    h = p["h"].clone().requires_grad_()
    w = p["w"].clone().requires_grad_()
    z = torch.einsum("sbh,vh->bsv", h, w) * SCALE / t
    y, v = p["y"], z.shape[-1]
    zl = torch.where(y == IGNORE, 0.0, z_loss * torch.logsumexp(z, -1) ** 2)
    kw: dict[str, Any] = {"weight": cw, "ignore_index": IGNORE, "label_smoothing": eps}
    if reduction == "none" or mask:
        ce = F.cross_entropy(z.reshape(-1, v), y.reshape(-1), reduction="none", **kw).view(B, S)
        if reduction == "none":
            loss = ce + zl
            cot = torch.linspace(-1.0, 1.0, B * S, dtype=torch.float64).view(B, S)
            (loss * cot).sum().backward()
        else:
            m = torch.where(y == IGNORE, 0.0, p["mask"])
            cwy = 1.0 if cw is None else cw[y.clamp(min=0)]
            loss = (m * ce).sum() + (m * zl).sum()
            if reduction == "mean":
                loss = (m * ce).sum() / (m * cwy).sum() + (m * zl).sum() / m.sum()
            loss.backward()
    else:
        ce = F.cross_entropy(z.reshape(-1, v), y.reshape(-1), reduction=reduction, **kw)
        loss = ce + (zl.sum() if reduction == "sum" else zl.sum() / (y != IGNORE).sum())
        loss.backward()
    assert h.grad is not None and w.grad is not None
    return {"loss": loss.detach(), "dh": h.grad, "dw": w.grad}


def _ctx(
    h: torch.Tensor, w: torch.Tensor, p: dict[str, torch.Tensor], mask: bool = True
) -> OutputContext:
    return masked_context(h, w, p, scale=SCALE, mask=mask)


def _run_ce(
    proc: Any,
    h: torch.Tensor,
    w: torch.Tensor,
    p: dict[str, torch.Tensor],
    reduction: str,
    mask: bool,
):
    out = proc(_ctx(h, w, p, mask))
    if reduction == "none":
        loss = out
        cot = torch.linspace(-1.0, 1.0, B * S, dtype=torch.float64).view(B, S).to(loss.dtype)
        (loss * cot).sum().backward()
    else:
        loss = out["loss"]
        loss.backward()
    return loss


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "no-mask"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_cross_entropy_label_smoothing_against_pytorch(
    reduction: str, dtype: torch.dtype, mask: bool, backend: str
) -> None:
    """Against ``F.cross_entropy(label_smoothing=0.1)`` in float64, with a z-loss and a
    temperature; without a mask against PyTorch's own ``"sum"`` and ``"mean"``."""
    skip_fp64_triton(backend, dtype)
    if reduction == "none" and not mask:
        pytest.skip("the unreduced loss takes no mask")
    p = _ce_problem()
    eps, z_loss, t = 0.1, 0.03, 0.8
    truth = _ce_truth(p, reduction, eps, t, z_loss, mask)
    h = p["h"].to(dtype).clone().requires_grad_()
    w = p["w"].to(dtype).clone().requires_grad_()
    proc = cross_entropy_loss(
        reduction=reduction,
        label_smoothing=eps,
        z_loss=z_loss,
        temperature=t,
        tile_rows=4,
        tile_cols=8,
    )
    loss = _run_ce(proc, h, w, p, reduction, mask)
    assert h.grad is not None and w.grad is not None
    close_to_float64(loss, truth["loss"], dtype)
    close_to_float64(h.grad, truth["dh"], dtype)
    close_to_float64(w.grad, truth["dw"], dtype)


@pytest.mark.parametrize("eps", [1.0, 0.5])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_label_smoothing_ends_against_pytorch(eps: float, reduction: str) -> None:
    """``eps = 1`` (the uniform target alone) and ``0.5``, float64."""
    p = _ce_problem(3)
    truth = _ce_truth(p, reduction, eps, 1.0, 0.0, True)
    h = p["h"].clone().requires_grad_()
    w = p["w"].clone().requires_grad_()
    loss = _run_ce(
        cross_entropy_loss(reduction=reduction, label_smoothing=eps), h, w, p, reduction, True
    )
    assert h.grad is not None and w.grad is not None
    close_to_float64(loss, truth["loss"], torch.float64)
    close_to_float64(h.grad, truth["dh"], torch.float64)
    close_to_float64(w.grad, truth["dw"], torch.float64)


def test_ignored_labels_contribute_nothing() -> None:
    """An ignored label: 0 loss and no gradient to its hidden state, whatever eps."""
    p = _ce_problem(4)
    h = p["h"].clone().requires_grad_()
    out = cross_entropy_loss(label_smoothing=0.3)(_ctx(h, p["w"], p))
    assert float(out.detach()[0, 2]) == 0.0 and float(out.detach()[2, 4]) == 0.0
    out.sum().backward()
    assert h.grad is not None
    assert torch.equal(
        h.grad[2, 0], torch.zeros(H, dtype=torch.float64)
    )  # [s, b]: token (b=0, s=2)
    assert torch.equal(h.grad[4, 2], torch.zeros(H, dtype=torch.float64))


def test_zero_label_smoothing_is_the_plain_cross_entropy_bitwise() -> None:
    """``label_smoothing=0`` (the default) takes exactly the path without it."""
    p = _ce_problem(5)
    for reduction in ("none", "sum", "mean"):
        a = cross_entropy_loss(reduction=reduction, label_smoothing=0.0)(_ctx(p["h"], p["w"], p))
        b = cross_entropy_loss(reduction=reduction)(_ctx(p["h"], p["w"], p))
        assert torch.equal(a, b) if reduction == "none" else torch.equal(a["loss"], b["loss"])


def test_label_smoothing_is_nan_for_nan_hidden_states() -> None:
    p = _ce_problem(6)
    h = p["h"].clone()
    h[1, 1] = float("nan")  # a counted token
    out = cross_entropy_loss(reduction="mean", label_smoothing=0.1)(_ctx(h, p["w"], p))
    assert math.isnan(float(out["loss"]))


@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), -0.1, 1.5, "0.1", True, None, torch.tensor(0.1)], ids=repr
)
def test_bad_label_smoothing_raises_by_name(bad: Any) -> None:
    with pytest.raises(
        ContractError, match=r"^label_smoothing: expected a finite number in \[0, 1\]"
    ):
        cross_entropy_loss(reduction="mean", label_smoothing=bad)


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "no-mask"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_label_smoothing_with_class_weights_against_pytorch(
    reduction: str, dtype: torch.dtype, mask: bool, backend: str
) -> None:
    """``F.cross_entropy(weight=cw, label_smoothing=0.2)`` in float64: the uniform term
    weighted per class (a weighted mean logit, ``sum_j cw[j] z_j / V``, in the engine),
    the mean over ``sum(M * cw[y])``; one class weight 0, the z-loss unweighted."""
    skip_fp64_triton(backend, dtype)
    if reduction == "none" and not mask:
        pytest.skip("the unreduced loss takes no mask")
    p = _ce_problem(10)
    cw = torch.linspace(0.0, 2.0, V, dtype=torch.float64)
    eps, z_loss, t = 0.2, 0.03, 0.8
    truth = _ce_truth(p, reduction, eps, t, z_loss, mask, cw)
    h = p["h"].to(dtype).clone().requires_grad_()
    w = p["w"].to(dtype).clone().requires_grad_()
    proc = cross_entropy_loss(
        reduction=typing.cast(Any, reduction),
        label_smoothing=eps,
        class_weights=cw.to(dtype),
        z_loss=z_loss,
        temperature=t,
        tile_rows=4,
        tile_cols=8,
    )
    loss = _run_ce(proc, h, w, p, reduction, mask)
    assert h.grad is not None and w.grad is not None
    close_to_float64(loss, truth["loss"], dtype)
    close_to_float64(h.grad, truth["dh"], dtype)
    close_to_float64(w.grad, truth["dw"], dtype)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_class_weights_of_the_wrong_size_are_named_with_label_smoothing(reduction: str) -> None:
    p = _ce_problem(12)
    proc = cross_entropy_loss(
        reduction=typing.cast(Any, reduction), label_smoothing=0.1, class_weights=torch.ones(V + 1)
    )
    with pytest.raises(ContractError, match=r"^class_weights: expected a tensor \[V=29\]"):
        proc(_ctx(p["h"], p["w"], p))


def test_mean_logit_weights_against_float64_and_checked_by_name() -> None:
    """``linear_logprobs(mean_logit_weights=c)``: ``sum_j c_j z_j / V`` and its gradient;
    a weight vector of the wrong size is refused by name."""
    p = _problem(11)
    c = torch.linspace(-1.0, 2.0, V, dtype=torch.float64)
    h = p["h"].clone().requires_grad_()
    w = p["w"].clone().requires_grad_()
    opts = LinearOptions(temperature=p["t"], tile_rows=4, tile_cols=8)
    r = linear_logprobs(h, w, p["y"], options=opts, with_mean_logit=True, mean_logit_weights=c)
    assert r.mean_logit is not None
    (p["c_mean"] * r.mean_logit).sum().backward()
    hh = p["h"].clone().requires_grad_()
    ww = p["w"].clone().requires_grad_()
    want = ((hh @ ww.T) / p["t"][:, None] * c).sum(-1) / V
    (p["c_mean"] * want).sum().backward()
    close_to_float64(r.mean_logit, want.detach(), torch.float64)
    assert h.grad is not None and w.grad is not None and hh.grad is not None and ww.grad is not None
    close_to_float64(h.grad, hh.grad, torch.float64)
    close_to_float64(w.grad, ww.grad, torch.float64)
    for bad in (torch.ones(V - 1), torch.ones(V, dtype=torch.long), [1.0] * V):
        with pytest.raises(
            ContractError, match=r"^mean_logit_weights: expected None or a floating tensor"
        ):
            linear_logprobs(
                p["h"],
                p["w"],
                p["y"],
                with_mean_logit=True,
                mean_logit_weights=bad,  # type: ignore[arg-type]
            )


def test_the_peers_weighted_smoothing_is_as_conventions_write_it() -> None:
    """The formula ``hookspec.conventions`` gives for the refused combination, pinned
    against ``F.cross_entropy(weight=cw, label_smoothing=eps)`` in float64: the uniform
    term weighted per class, the mean divided by ``sum(cw[y])`` of the counted tokens."""
    g = torch.Generator().manual_seed(8)
    z = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, V, (N,), generator=g)
    y[3] = IGNORE
    cw = torch.rand(V, generator=g, dtype=torch.float64) + 0.1
    eps = 0.2
    lse = torch.logsumexp(z, -1)
    counted = y != IGNORE
    yc = y.clamp(min=0)
    ce = cw[yc] * (lse - z.gather(1, yc[:, None]).squeeze(1))
    smooth = (cw * (lse[:, None] - z)).sum(-1) / V
    tok = torch.where(counted, (1 - eps) * ce + eps * smooth, 0.0)
    kw: dict[str, Any] = {"weight": cw, "ignore_index": IGNORE, "label_smoothing": eps}
    torch.testing.assert_close(
        F.cross_entropy(z, y, reduction="none", **kw), tok, rtol=1e-13, atol=1e-13
    )
    mean = tok.sum() / cw[yc][counted].sum()
    torch.testing.assert_close(
        F.cross_entropy(z, y, reduction="mean", **kw), mean, rtol=1e-13, atol=1e-13
    )


# ---------------------------------------------------------------- tp=2


_TP2_CE = {"eps": 0.1, "z_loss": 0.03, "t": 0.8}


def _tp2(
    rank: int,
    p: dict[str, torch.Tensor],
    truth: dict[str, torch.Tensor],
    backends: list[str],
    pce: dict[str, torch.Tensor],
    ce_truths: dict[str, dict[str, torch.Tensor]],
) -> None:
    from megatron.core import parallel_state

    from torch_impl import TorchCollectives

    coll = TorchCollectives(
        parallel_state.get_tensor_model_parallel_group(), sequence_parallel=False
    )
    lo, hi = (0, 14) if rank == 0 else (14, V)  # unequal shards: 14 and 15 rows
    shard = VocabShard(lo, hi, V)
    for be in backends:
        dtype = torch.float64 if be == "torch" else torch.float32
        tol = {"rtol": 1e-10, "atol": 1e-10} if be == "torch" else {"rtol": 2e-5, "atol": 1e-4}
        base = {"temperature": p["t"], "vocab": shard, "collectives": coll, "backend": be}
        # linear_logprobs: the mean over both shards (divided by the whole V),
        # its gradient through both
        h = p["h"].to(dtype).clone().requires_grad_()
        w = p["w"][lo:hi].to(dtype).clone().requires_grad_()
        r = linear_logprobs(
            h,
            w,
            p["y"],
            options=LinearOptions(tile_rows=4, tile_cols=8, **base),
            with_mean_logit=True,
        )
        assert r.mean_logit is not None
        (p["c_lp"] * r.logprobs + p["c_mean"] * r.mean_logit).sum().backward()
        torch.testing.assert_close(r.mean_logit.double(), truth["mean"], **tol)
        torch.testing.assert_close(h.grad.double(), truth["dh"], **tol)
        torch.testing.assert_close(w.grad.double(), truth["dw"][lo:hi], **tol)
        # fused_token_loss with a mean-logit loss
        h = p["h"].to(dtype).clone().requires_grad_()
        w = p["w"][lo:hi].to(dtype).clone().requires_grad_()
        f = fused_token_loss(
            h,
            w,
            p["y"],
            lambda lp, ent, rows: (p["c_lp"][rows] * lp).sum(),
            options=LinearOptions(tile_rows=4, **base),
            entropy_grad=False,
            mean_logit_loss=lambda mean, rows: (p["c_mean"][rows] * mean).sum(),
        )
        f.loss.backward()
        assert f.mean_logit is not None
        torch.testing.assert_close(f.loss.double(), truth["loss"], **tol)
        torch.testing.assert_close(f.mean_logit.double(), truth["mean"], **tol)
        torch.testing.assert_close(h.grad.double(), truth["dh"], **tol)
        torch.testing.assert_close(w.grad.double(), truth["dw"][lo:hi], **tol)
        # the processor, unreduced and reduced, with and without class weights, on equal
        # shards of 30 (as the hook has them)
        lo2, hi2 = 15 * rank, 15 * (rank + 1)
        for key, want in ce_truths.items():
            reduction, weighted = key.split(",")
            h = pce["h"].to(dtype).clone().requires_grad_()
            w = pce["w"][lo2:hi2].to(dtype).clone().requires_grad_()
            ctx = _ctx(h, w, pce).replace(
                vocab=VocabShard(lo2, hi2, 30),
                parallel=ParallelLayout(tp_size=2, tp_rank=rank),
                collectives=coll,
            )
            proc = cross_entropy_loss(
                reduction=typing.cast(Any, reduction),
                label_smoothing=_TP2_CE["eps"],
                class_weights=pce["cw"].to(dtype) if weighted else None,
                z_loss=_TP2_CE["z_loss"],
                temperature=_TP2_CE["t"],
                tile_rows=4,
                tile_cols=8,
            )
            out = proc(ctx)
            loss = out if reduction == "none" else out["loss"]
            cot = torch.linspace(-1.0, 1.0, B * S, dtype=torch.float64).view(B, S).to(loss.dtype)
            (loss * cot if reduction == "none" else loss).sum().backward()
            torch.testing.assert_close(loss.detach().double(), want["loss"], **tol)
            torch.testing.assert_close(h.grad.double(), want["dh"], **tol)
            torch.testing.assert_close(w.grad.double(), want["dw"][lo2:hi2], **tol)


@pytest.mark.release_independent
def test_tp2_mean_logit_and_mean_logit_loss_against_float64() -> None:
    """Two gloo processes, each a vocabulary shard of unequal size: the mean logit and
    its gradient, the fused loss's ``mean_logit_loss``, ``cross_entropy_loss(
    label_smoothing=)`` unreduced and reduced (against PyTorch's), on the torch backend
    (fp64) and, where Triton is installed, the Triton backend under the interpreter (fp32)."""
    p = _problem(5)
    backends = ["torch"] + (["triton"] if importlib.util.find_spec("triton") is not None else [])
    pce = _ce_problem(9, v=30)
    pce["cw"] = torch.linspace(0.0, 2.0, 30, dtype=torch.float64)
    eps, t, zl = _TP2_CE["eps"], _TP2_CE["t"], _TP2_CE["z_loss"]
    ce = {
        f"{r},{'w' if cw else ''}": _ce_truth(pce, r, eps, t, zl, True, pce["cw"] if cw else None)
        for r in ("none", "mean")
        for cw in (False, True)
    }
    run_distributed(_tp2, p, _truth(p), backends, pce, ce, tp=2)

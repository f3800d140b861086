"""The per-token log-partition ``lse`` of :func:`linear_logprobs` (and
:func:`fused_token_loss`'s ``lse_loss``) and ``cross_entropy_loss(z_loss=...)``,
against float64 materialised logits (values, hidden-state and weight gradients), on
both backends, at tp=1 and tp=2 (gloo); the z-loss as the peers define it
(Liger-Kernel's ``lse_square_scale``: ``lse_square_scale * lse ** 2`` per counted
token, divided by the count of counted tokens for ``"mean"``; Cut Cross-Entropy's
``compute_z_loss``: the mean of ``lse ** 2`` over the tokens whose label is not
ignored); its option checked by name."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest
import torch

from hookspec import ContractError, OutputContext, VocabShard
from tests.support.backend_support import (
    close_to_float64,
    masked_context,
    masked_problem,
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


def _problem(seed: int = 0, n: int = N) -> dict[str, torch.Tensor]:
    return token_problem(seed, n, H, V, coefficients=("c_lp", "c_lse"))


def _truth(
    p: dict[str, torch.Tensor], dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    """``sum(c_lp * logprobs + c_lse * lse ** 2)`` from float64 logits of the inputs
    rounded to ``dtype``."""
    h = p["h"].to(dtype).double().clone().requires_grad_()
    w = p["w"].to(dtype).double().clone().requires_grad_()
    z = (h @ w.T) / p["t"][:, None]
    lse = torch.logsumexp(z, -1)
    y = p["y"]
    lp = torch.where(
        y == IGNORE, 0.0, z.log_softmax(-1).gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    )
    loss = (p["c_lp"] * lp + p["c_lse"] * lse**2).sum()
    loss.backward()
    assert h.grad is not None and w.grad is not None
    return {
        "lse": lse.detach(),
        "lp": lp.detach(),
        "loss": loss.detach(),
        "dh": h.grad,
        "dw": w.grad,
    }


def test_lse_gradient_sign_and_value_in_float64() -> None:
    """``d lse / dz_j = softmax(z)_j``: a loss of the ``lse`` alone, then beside the
    logprobs and the entropy, equals autograd through materialised logits."""
    p = _problem()
    h = p["h"].clone().requires_grad_()
    w = p["w"].clone().requires_grad_()
    r = linear_logprobs(
        h, w, p["y"], options=LinearOptions(temperature=p["t"], tile_rows=4, tile_cols=8)
    )
    (p["c_lse"] * r.lse).sum().backward()
    hh = p["h"].clone().requires_grad_()
    ww = p["w"].clone().requires_grad_()
    want = torch.logsumexp((hh @ ww.T) / p["t"][:, None], -1)
    (p["c_lse"] * want).sum().backward()
    torch.testing.assert_close(r.lse, want.detach(), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(h.grad, hh.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, ww.grad, rtol=1e-12, atol=1e-12)
    assert r.lse.shape == (N,) and r.lse.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_linear_logprobs_lse_against_float64(dtype: torch.dtype, backend: str) -> None:
    """The lse at every token (ignored labels too), its gradient beside the logprobs',
    per-token temperature, tiles that split rows and columns."""
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernels take fp32/bf16/fp16")
    p = _problem()
    truth = _truth(p, dtype)
    h = p["h"].to(dtype).clone().requires_grad_()
    w = p["w"].to(dtype).clone().requires_grad_()
    r = linear_logprobs(
        h, w, p["y"], options=LinearOptions(temperature=p["t"], tile_rows=4, tile_cols=8)
    )
    (p["c_lp"] * r.logprobs + p["c_lse"] * r.lse**2).sum().backward()
    assert h.grad is not None and w.grad is not None
    close_to_float64(r.lse, truth["lse"], dtype)
    close_to_float64(h.grad, truth["dh"], dtype)
    close_to_float64(w.grad, truth["dw"], dtype)


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_fused_token_loss_lse_loss_against_float64(
    dtype: torch.dtype, entropy_grad: bool, backend: str
) -> None:
    """``lse_loss`` in the single pass (``entropy_grad=False``: the lse gradient folded
    into the buffer's scale) and in the two-pass tile, with an upstream gradient 0.7."""
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernels take fp32/bf16/fp16")
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
        lse_loss=lambda lse, rows: (p["c_lse"][rows] * lse**2).sum(),
    )
    (f.loss * 0.7).backward()
    assert h.grad is not None and w.grad is not None
    close_to_float64(f.loss, truth["loss"], dtype)
    close_to_float64(f.lse, truth["lse"], dtype)
    close_to_float64(h.grad, 0.7 * truth["dh"], dtype)
    close_to_float64(w.grad, 0.7 * truth["dw"], dtype)


def test_fused_lse_loss_checked_by_name() -> None:
    p = _problem()
    args = (p["h"], p["w"], p["y"], lambda lp, ent, rows: lp.sum())
    with pytest.raises(ContractError, match=r"^lse_loss: expected None or a callable"):
        fused_token_loss(*args, lse_loss=3.0)  # type: ignore[arg-type]
    with pytest.raises(ContractError, match=r"^lse_loss: expected a callable returning a 0-dim"):
        fused_token_loss(*args, lse_loss=lambda lse, rows: lse)


# ---------------------------------------------------------------- cross_entropy_loss(z_loss=...)


def _ce_problem(seed: int = 2) -> dict[str, torch.Tensor]:
    return masked_problem(seed, B, S, H, V)


def _ce_truth(
    p: dict[str, torch.Tensor], reduction: str, z_loss: float, t: float
) -> dict[str, torch.Tensor]:
    """The peers' z-loss in float64: ``ce + z_loss * lse ** 2`` per counted token, the
    mean divided by the count of counted tokens (for both terms)."""
    h = p["h"].clone().requires_grad_()
    w = p["w"].clone().requires_grad_()
    z = torch.einsum("sbh,vh->bsv", h, w) * SCALE / t
    y = p["y"]
    ce = torch.where(
        y == IGNORE, 0.0, -z.log_softmax(-1).gather(2, y.clamp(min=0)[..., None]).squeeze(-1)
    )
    zl = torch.where(y == IGNORE, 0.0, z_loss * torch.logsumexp(z, -1) ** 2)
    if reduction == "none":
        loss = ce + zl
        cot = torch.linspace(-1.0, 1.0, B * S, dtype=torch.float64).view(B, S)
        (loss * cot).sum().backward()
    else:
        m = torch.where(y == IGNORE, 0.0, p["mask"])
        loss = (m * (ce + zl)).sum()
        if reduction == "mean":
            loss = loss / m.sum()
        loss.backward()
    assert h.grad is not None and w.grad is not None
    return {"loss": loss.detach(), "dh": h.grad, "dw": w.grad}


def _ctx(h: torch.Tensor, w: torch.Tensor, p: dict[str, torch.Tensor]) -> OutputContext:
    return masked_context(h, w, p, scale=SCALE)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_cross_entropy_z_loss_against_float64(
    reduction: str, dtype: torch.dtype, backend: str
) -> None:
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernels take fp32/bf16/fp16")
    p = _ce_problem()
    z_loss, t = 0.03, 0.8
    truth = _ce_truth(p, reduction, z_loss, t)
    h = p["h"].to(dtype).clone().requires_grad_()
    w = p["w"].to(dtype).clone().requires_grad_()
    proc = cross_entropy_loss(
        reduction=reduction, z_loss=z_loss, temperature=t, tile_rows=4, tile_cols=8
    )
    out = proc(_ctx(h, w, p))
    if reduction == "none":
        loss = out
        (
            loss * torch.linspace(-1.0, 1.0, B * S, dtype=torch.float64).view(B, S).to(loss.dtype)
        ).sum().backward()
    else:
        loss = out["loss"]
        loss.backward()
        assert float(out["tokens"]) == float(torch.where(p["y"] == IGNORE, 0.0, p["mask"]).sum())
    assert h.grad is not None and w.grad is not None
    close_to_float64(loss, truth["loss"], dtype)
    close_to_float64(h.grad, truth["dh"], dtype)
    close_to_float64(w.grad, truth["dw"], dtype)


def test_zero_z_loss_is_the_plain_cross_entropy_bitwise() -> None:
    """``z_loss=0`` (the default) takes exactly the path without it."""
    p = _ce_problem(3)
    for reduction in ("none", "sum", "mean"):
        a = cross_entropy_loss(reduction=reduction, z_loss=0.0)(_ctx(p["h"], p["w"], p))
        b = cross_entropy_loss(reduction=reduction)(_ctx(p["h"], p["w"], p))
        assert torch.equal(a, b) if reduction == "none" else torch.equal(a["loss"], b["loss"])


def test_z_loss_is_nan_for_nan_hidden_states() -> None:
    p = _ce_problem(4)
    h = p["h"].clone()
    h[1, 1] = float("nan")  # a counted token
    out = cross_entropy_loss(reduction="mean", z_loss=1e-4)(_ctx(h, p["w"], p))
    assert math.isnan(float(out["loss"]))


@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), -1e-4, "0.1", True, None, torch.tensor(0.1)], ids=repr
)
def test_bad_z_loss_raises_by_name(bad: Any) -> None:
    with pytest.raises(ContractError, match=r"^z_loss: expected a finite number >= 0"):
        cross_entropy_loss(reduction="mean", z_loss=bad)


# ---------------------------------------------------------------- tp=2


def _tp2(
    rank: int, p: dict[str, torch.Tensor], truth: dict[str, torch.Tensor], backends: list[str]
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
        # linear_logprobs: the lse reduced over both shards, its gradient through both
        h = p["h"].to(dtype).clone().requires_grad_()
        w = p["w"][lo:hi].to(dtype).clone().requires_grad_()
        r = linear_logprobs(h, w, p["y"], options=LinearOptions(tile_rows=4, tile_cols=8, **base))
        (p["c_lp"] * r.logprobs + p["c_lse"] * r.lse**2).sum().backward()
        torch.testing.assert_close(r.lse.double(), truth["lse"], **tol)
        torch.testing.assert_close(h.grad.double(), truth["dh"], **tol)
        torch.testing.assert_close(w.grad.double(), truth["dw"][lo:hi], **tol)
        # fused_token_loss: the single pass with an lse loss
        h = p["h"].to(dtype).clone().requires_grad_()
        w = p["w"][lo:hi].to(dtype).clone().requires_grad_()
        f = fused_token_loss(
            h,
            w,
            p["y"],
            lambda lp, ent, rows: (p["c_lp"][rows] * lp).sum(),
            options=LinearOptions(tile_rows=4, **base),
            entropy_grad=False,
            lse_loss=lambda lse, rows: (p["c_lse"][rows] * lse**2).sum(),
        )
        f.loss.backward()
        torch.testing.assert_close(f.loss.double(), truth["loss"], **tol)
        torch.testing.assert_close(f.lse.double(), truth["lse"], **tol)
        torch.testing.assert_close(h.grad.double(), truth["dh"], **tol)
        torch.testing.assert_close(w.grad.double(), truth["dw"][lo:hi], **tol)


@pytest.mark.release_independent
def test_tp2_lse_and_lse_loss_against_float64() -> None:
    """Two gloo processes, each a vocabulary shard: ``lse`` and its gradient, the fused
    loss's ``lse_loss``, on the torch backend (fp64) and, where Triton is installed,
    the Triton backend under the interpreter (fp32)."""
    p = _problem(5)
    backends = ["torch"] + (["triton"] if importlib.util.find_spec("triton") is not None else [])
    run_distributed(_tp2, p, _truth(p), backends, tp=2)


# ---------------------------------------------------------------- class weights


def _weighted_truth(
    p: dict[str, torch.Tensor],
    cw: torch.Tensor,
    reduction: str,
    z_loss: float,
    mask: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """``hookspec.conventions``' class-weighted cross entropy in float64; with no mask,
    ``F.cross_entropy(weight=cw, ignore_index=-100)`` (the peers' definition) plus
    Liger-Kernel's unweighted z-loss."""
    h = p["h"].clone().requires_grad_()
    w = p["w"].clone().requires_grad_()
    z = torch.einsum("sbh,vh->bsv", h, w) * SCALE
    y = p["y"]
    lse = torch.logsumexp(z, -1)
    counted = y != IGNORE
    if mask is None:
        ce = torch.nn.functional.cross_entropy(
            z.reshape(-1, V), y.reshape(-1), weight=cw, ignore_index=IGNORE, reduction=reduction
        )
        zl = torch.where(counted, lse**2, 0.0)
        zl = {"none": zl.reshape(-1), "sum": zl.sum(), "mean": zl.sum() / counted.sum()}[reduction]
        loss = ce + z_loss * zl
        loss = loss.reshape(B, S) if reduction == "none" else loss
    else:
        m = torch.where(counted, mask, 0.0)
        cwy = torch.where(counted, cw[y.clamp(min=0)], 0.0)
        lp = z.log_softmax(-1).gather(2, y.clamp(min=0)[..., None]).squeeze(-1)
        ce, zl = (m * cwy * -lp).sum(), (m * lse**2).sum()
        loss = (
            ce / (m * cwy).sum() + z_loss * zl / m.sum()
            if reduction == "mean"
            else ce + z_loss * zl
        )
    cot = torch.linspace(-1.0, 1.0, B * S, dtype=torch.float64).view(B, S)
    (loss * cot).sum().backward() if reduction == "none" else loss.backward()
    assert h.grad is not None and w.grad is not None
    return {"loss": loss.detach(), "dh": h.grad, "dw": w.grad}


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_class_weights_against_float64(
    reduction: str, dtype: torch.dtype, masked: bool, backend: str
) -> None:
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernels take fp32/bf16/fp16")
    if masked and reduction == "none":
        pytest.skip("the unreduced loss reads no mask")
    p = _ce_problem(6)
    cw = (
        (torch.rand(V, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 2)
        .float()
        .double()
    )
    cw[3] = 0.0  # a class that counts nothing
    z_loss = 0.02
    truth = _weighted_truth(p, cw, reduction, z_loss, p["mask"] if masked else None)
    h = p["h"].to(dtype).clone().requires_grad_()
    w = p["w"].to(dtype).clone().requires_grad_()
    ctx = masked_context(h, w, p, scale=SCALE, mask=masked)
    proc = cross_entropy_loss(
        reduction=reduction, z_loss=z_loss, class_weights=cw.float(), tile_rows=4
    )
    out = proc(ctx)
    loss = out if reduction == "none" else out["loss"]
    cot = torch.linspace(-1.0, 1.0, B * S, dtype=torch.float64).view(B, S)
    (loss * cot.to(loss.dtype)).sum().backward() if reduction == "none" else loss.backward()
    assert h.grad is not None and w.grad is not None
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for got, want in ((loss, truth["loss"]), (h.grad, truth["dh"]), (w.grad, truth["dw"])):
        torch.testing.assert_close(
            got.detach().double(), want, rtol=tol, atol=tol * float(want.abs().max())
        )


def test_class_weights_checked_by_name() -> None:
    p = _ce_problem(7)
    for bad in (torch.ones(V, dtype=torch.long), torch.ones(2, V), [1.0] * V):
        with pytest.raises(
            ContractError, match=r"^class_weights: expected None or a floating tensor \[V\]"
        ):
            cross_entropy_loss(class_weights=bad)
    with pytest.raises(ContractError, match=r"^class_weights: expected a tensor \[V=29\]"):
        cross_entropy_loss(reduction="mean", class_weights=torch.ones(V + 1))(
            _ctx(p["h"], p["w"], p)
        )
    for value in (float("nan"), -1.0, float("inf")):
        cw = torch.ones(V)
        cw[5] = value
        with pytest.raises(ContractError, match=r"^class_weights: expected finite values >= 0"):
            cross_entropy_loss(reduction="sum", class_weights=cw)(_ctx(p["h"], p["w"], p))
    ctx = OutputContext(
        hidden_states=p["h"],
        labels=p["y"],
        vocab_weight=p["w"],
        vocab=VocabShard(0, V, V),
        context={"global_tokens": 10},
    )
    with pytest.raises(
        ContractError, match=r"^context\.global_tokens: expected None with class_weights"
    ):
        cross_entropy_loss(reduction="mean", class_weights=torch.ones(V))(ctx)


def test_unit_class_weights_equal_none() -> None:
    p = _ce_problem(8)
    for reduction in ("none", "sum", "mean"):
        a = cross_entropy_loss(reduction=reduction, class_weights=torch.ones(V))(
            _ctx(p["h"], p["w"], p)
        )
        b = cross_entropy_loss(reduction=reduction)(_ctx(p["h"], p["w"], p))
        if reduction == "none":
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:
            torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-15, atol=1e-15)

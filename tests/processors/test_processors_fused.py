"""``fused_token_loss`` (gradients formed in the forward pass) against autograd
through ``linear_logprobs`` and against float64 truth."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hookspec import ContractError
from torch_impl.processors import LinearOptions, fused_token_loss, linear_logprobs

IGNORE = -100
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _inputs(dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    n, h, v = 41, 12, 157
    y = torch.randint(0, v, (n,), generator=g)
    y[[3, 17]] = IGNORE
    return {
        "h": torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype),
        "w": (torch.randn(v, h, generator=g, dtype=torch.float64) * 0.6).to(dtype),
        "y": y,
        "t": torch.rand(n, generator=g, dtype=torch.float64) + 0.5,
        "a": torch.randn(n, generator=g, dtype=torch.float64),
        "b": torch.randn(n, generator=g, dtype=torch.float64),
    }


def _loss(x: dict[str, Any]) -> Any:
    """A nonlinear per-token loss of both the logprob and the entropy."""

    def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        lp, ent = lp.double(), ent.double()
        return (
            x["a"][rows] * torch.exp(lp.clamp(max=0)) + x["b"][rows] * ent**2 + 0.1 * lp * ent
        ).sum()

    return token_loss


def _autograd(x: dict[str, Any], scale: float) -> tuple[torch.Tensor, ...]:
    h = x["h"].clone().requires_grad_()
    w = x["w"].clone().requires_grad_()
    r = linear_logprobs(
        h, w, x["y"], with_entropy=True, options=LinearOptions(temperature=x["t"].to(x["h"].dtype))
    )
    assert r.entropy is not None
    loss = _loss(x)(r.logprobs, r.entropy, slice(None))
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("tile", [157, 5 * 157, 10_000])  # one row per tile, several, all rows
def test_fused_equals_autograd_float64(tile: int) -> None:
    x = _inputs(torch.float64)
    loss_a, dh_a, dw_a = _autograd(x, 2.5)
    h = x["h"].clone().requires_grad_()
    w = x["w"].clone().requires_grad_()
    f = fused_token_loss(
        h,
        w,
        x["y"],
        _loss(x),
        options=LinearOptions(temperature=x["t"], tile_rows=max(1, tile // w.shape[0])),
    )
    (f.loss * 2.5).backward()  # the stored gradients are scaled by the incoming one
    tol = {"rtol": 1e-11, "atol": 1e-12}
    torch.testing.assert_close(f.loss, loss_a, **tol)
    torch.testing.assert_close(h.grad, dh_a, **tol)
    torch.testing.assert_close(w.grad, dw_a, **tol)
    assert f.logprobs.shape == (41,) and float(f.logprobs[3]) == 0.0
    assert not f.logprobs.requires_grad and bool((f.entropy >= 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_no_worse_than_autograd_in_low_precision(dtype: torch.dtype) -> None:
    x = _inputs(dtype, seed=1)
    x64 = dict(x, h=x["h"].double(), w=x["w"].double())
    truth = _autograd(x64, 1.0)
    other = _autograd(x, 1.0)
    h = x["h"].clone().requires_grad_()
    w = x["w"].clone().requires_grad_()
    f = fused_token_loss(
        h,
        w,
        x["y"],
        _loss(x),
        options=LinearOptions(temperature=x["t"].to(dtype), tile_rows=max(1, 600 // w.shape[0])),
    )
    f.loss.backward()
    for got, ref, want in zip((f.loss, h.grad, w.grad), other, truth):
        scale = max(1.0, float(want.abs().max()))
        err = float((got.detach().double() - want).abs().max())
        assert err <= float((ref.double() - want).abs().max()) + 1e-5 * scale


def test_only_needed_gradients_and_no_grad_mode() -> None:
    x = _inputs(torch.float32, seed=2)
    w = x["w"].clone().requires_grad_()
    f = fused_token_loss(x["h"], w, x["y"], _loss(x))
    f.loss.backward()
    assert w.grad is not None and x["h"].grad is None
    h = x["h"].clone().requires_grad_()
    with torch.no_grad():
        f = fused_token_loss(h, x["w"], x["y"], _loss(x))
    assert not f.loss.requires_grad


def test_second_backward_raises() -> None:
    """One behaviour for every gradient formed in the forward pass (distillation's:
    ``tests/processors/test_distill.py``): the first backward hands the gradients over."""
    x = _inputs(torch.float32, seed=3)
    h = x["h"].clone().requires_grad_()
    f = fused_token_loss(h, x["w"], x["y"], _loss(x))
    f.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the same call twice"):
        f.loss.backward()


def _learned(x: dict[str, Any], coef: torch.Tensor, raw: torch.Tensor, entropy: bool) -> Any:
    """A token loss of a learned coefficient (a leaf) and a value head's output (not a leaf)."""
    head = torch.tanh(raw) * 2.0  # [n], requires grad through raw

    def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        lp, ent = lp.double(), ent.double()
        loss = coef * (x["a"][rows] * lp).sum() + (head[rows] * lp.exp()).sum()
        return loss + coef**2 * (x["b"][rows] * ent).sum() if entropy else loss

    return token_loss


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_the_gradient_to_other_tensors_of_the_loss_is_carried(
    backend: str, entropy_grad: bool
) -> None:
    """``coef.grad`` and the value head's gradient equal float64 autograd through
    ``linear_logprobs`` (the loss's gradient through its arguments is the fused one)."""
    if backend == "triton":
        pytest.importorskip("triton")
    dtype = torch.float64 if backend == "torch" else torch.float32
    x = _inputs(dtype, seed=4)
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-5}
    grads = []
    for fused in (True, False):
        coef = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
        raw = torch.linspace(-1, 1, 41, dtype=torch.float64).requires_grad_()
        h = x["h"].clone().requires_grad_()
        w = x["w"].double() if not fused else x["w"]
        loss_fn = _learned(x, coef, raw, entropy_grad)
        if fused:
            opts = LinearOptions(tile_rows=7, backend=backend)  # type: ignore[arg-type]
            loss = fused_token_loss(
                h, w, x["y"], loss_fn, options=opts, entropy_grad=entropy_grad
            ).loss
        else:
            r = linear_logprobs(h.double(), w, x["y"], with_entropy=True)
            assert r.entropy is not None
            loss = loss_fn(r.logprobs, r.entropy, slice(None))
        (loss * 0.7).backward()
        assert coef.grad is not None and raw.grad is not None and h.grad is not None
        grads.append((loss.detach().double(), coef.grad, raw.grad, h.grad.double()))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, **tol)


def test_a_token_loss_calling_backward_is_refused_by_name() -> None:
    x = _inputs(torch.float64, seed=5)

    def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
        loss = -lp.sum()
        loss.backward()
        return loss.detach()

    h = x["h"].clone().requires_grad_()
    with pytest.raises(ContractError, match=r"token_loss.*backward"):
        fused_token_loss(h, x["w"], x["y"], token_loss, entropy_grad=False)


def test_only_fused_token_loss_differentiates_a_user_callable() -> None:
    """The class of the sweep: every ``torch.autograd.grad`` in the library and what it
    differentiates. A user callable differentiated by the library must carry the
    gradient to its other tensors (the test above); the others are the library's own
    maths of detached inputs (distillation's divergence, chosen by enum; the doctor's
    checks). MTP's wrappers and the policy loss differentiate through autograd's graph."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "torch_impl"
    sites = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "grad"
                and ast.unparse(node) == "torch.autograd.grad"
            ):
                sites.add(str(path.relative_to(root)))
    assert sites == {"processors/_fused.py", "processors/_distill.py", "doctor.py"}

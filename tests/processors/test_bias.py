"""The output layer's bias ``b`` ``[V_local]`` in the tensor functions: ``u = h @ W.T +
b``, then ``z = u * logit_scale / T``. Values and gradients (``dh``, ``dW``, ``db``)
against float64 autograd through materialised logits, on both backends (Triton under
the interpreter), with a scalar and a per-token temperature, a logit scale and ignored
labels; at tp=2 (gloo) each rank's ``db`` is its shard's; bf16 compute against float64
beside the naive bf16 path; bad biases refused by name. Distillation is checked
against its bias-free form on augmented operands (``[h, 1]``, ``[W, b]``: the same
logits), whose float64 truth is ``tests/processors/test_distill.py``'s."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from hookspec import ContractError, VocabShard
from tests.support.backend_support import close_to_float64
from tests.support.distributed import run_distributed
from torch_impl.processors import (
    DistillConfig,
    LinearOptions,
    SparseTeacher,
    fused_token_loss,
    linear_distillation_loss,
    linear_logprobs,
    linear_topk_logprobs,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

IGNORE = -100
N, H, V, K = 11, 6, 23, 3
SCALE = 0.8


def _problem(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (N,), generator=g)
    y[[2, 7]] = IGNORE
    return {
        "h": torch.randn(N, H, generator=g, dtype=torch.float64),
        "w": torch.randn(V, H, generator=g, dtype=torch.float64),
        "b": torch.randn(V, generator=g, dtype=torch.float64) * 2,
        "y": y,
        "t": (torch.rand(N, generator=g, dtype=torch.float64) + 0.5).float().double(),
        "c_lp": torch.randn(N, generator=g, dtype=torch.float64),
        "c_ent": torch.randn(N, generator=g, dtype=torch.float64),
        "c_lse": torch.randn(N, generator=g, dtype=torch.float64),
    }


def _leaves(p: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(p[k].to(dtype).clone().requires_grad_() for k in ("h", "w", "b"))


def _truth(p: dict[str, torch.Tensor], t: Any) -> dict[str, torch.Tensor]:
    """``sum(c_lp * logprobs + c_ent * entropy + c_lse * lse)`` and the top-k's
    ``sum(logprobs) + sum(label logprobs)``, from float64 logits, with their gradients."""
    h, w, b = _leaves(p, torch.float64)
    tt = t[:, None] if isinstance(t, torch.Tensor) else t
    z = (h @ w.T + b) * SCALE / tt
    ls = z.log_softmax(-1)
    y = p["y"]
    lp = torch.where(y == IGNORE, 0.0, ls.gather(1, y.clamp(min=0)[:, None]).squeeze(1))
    ent = -(ls.exp() * ls).sum(-1)
    lse = torch.logsumexp(z, -1)
    loss = (p["c_lp"] * lp + p["c_ent"] * ent + p["c_lse"] * lse).sum()
    out = {"lp": lp, "ent": ent, "lse": lse, "loss": loss, "topk": ls.topk(K, dim=1).values}
    grads = torch.autograd.grad(loss, (h, w, b), retain_graph=True)
    out |= dict(zip(("dh", "dw", "db"), grads, strict=True))
    tgrads = torch.autograd.grad(out["topk"].sum() + lp.sum(), (h, w, b))
    out |= dict(zip(("tdh", "tdw", "tdb"), tgrads, strict=True))
    return {k: v.detach() for k, v in out.items()}


def _cases(backend: str) -> list[tuple[torch.dtype, str]]:
    dtypes = [torch.float64, torch.float32] if backend == "torch" else [torch.float32]
    return [(d, t) for d in dtypes for t in ("scalar", "tensor")]


def _temperature(p: dict[str, torch.Tensor], how: str, dtype: torch.dtype) -> Any:
    return 1.3 if how == "scalar" else p["t"].to(dtype)


def test_linear_logprobs_and_topk_with_bias_against_float64(backend: str) -> None:
    """Values and ``dh``, ``dW``, ``db`` at tiles that split rows and columns (the torch
    backend folds ``1 / T`` into the hidden rows at fp32/fp64: the bias enters as
    ``inv_t * b``; top-k does not fold)."""
    p = _problem()
    for dtype, how in _cases(backend):
        t = _temperature(p, how, dtype)
        want = _truth(p, 1.3 if how == "scalar" else p["t"])
        opts = LinearOptions(temperature=t, logit_scale=SCALE, tile_rows=4, tile_cols=8)
        h, w, b = _leaves(p, dtype)
        r = linear_logprobs(h, w, p["y"], options=opts, bias=b, with_entropy=True)
        assert r.entropy is not None
        loss = (p["c_lp"] * r.logprobs + p["c_ent"] * r.entropy + p["c_lse"] * r.lse).sum()
        loss.backward()
        for key, got in [("lp", r.logprobs), ("ent", r.entropy), ("lse", r.lse)]:
            close_to_float64(got, want[key], dtype)
        for key, x in [("dh", h), ("dw", w), ("db", b)]:
            assert x.grad is not None and x.grad.dtype == dtype
            close_to_float64(x.grad, want[key], dtype)
        h, w, b = _leaves(p, dtype)
        top = linear_topk_logprobs(h, w, k=K, labels=p["y"], options=opts, bias=b)
        assert top.label_logprobs is not None
        (top.logprobs.sum() + top.label_logprobs.sum()).backward()
        close_to_float64(top.logprobs, want["topk"], dtype)
        for key, x in [("tdh", h), ("tdw", w), ("tdb", b)]:
            close_to_float64(x.grad, want[key], dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_fused_token_loss_with_bias_against_float64(entropy_grad: bool, backend: str) -> None:
    """The single pass (``entropy_grad=False``: the gradient buffer scaled as it is
    multiplied out, ``db`` from the scaled buffer and the label's column) and the row
    sweep's gradient pass, with an lse loss."""
    p = _problem(1)
    for dtype, how in _cases(backend):
        want = _truth(
            p if entropy_grad else {**p, "c_ent": p["c_ent"] * 0},
            1.3 if how == "scalar" else p["t"],
        )
        opts = LinearOptions(
            temperature=_temperature(p, how, dtype), logit_scale=SCALE, tile_rows=4
        )
        h, w, b = _leaves(p, dtype)

        def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
            loss = (p["c_lp"][rows] * lp).sum()
            return loss + (p["c_ent"][rows] * ent).sum() if entropy_grad else loss

        f = fused_token_loss(
            h,
            w,
            p["y"],
            token_loss,
            options=opts,
            entropy_grad=entropy_grad,
            lse_loss=lambda lse, rows: (p["c_lse"][rows] * lse).sum(),
            bias=b,
        )
        (f.loss * 0.7).backward()
        close_to_float64(f.loss, want["loss"], dtype)
        close_to_float64(f.lse, want["lse"], dtype)
        for key, x in [("dh", h), ("dw", w), ("db", b)]:
            close_to_float64(x.grad, 0.7 * want[key], dtype)  # type: ignore[arg-type]


def _augmented(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[h, 1]`` and ``[W, b]``: ``[h, 1] @ [W, b].T = h @ W.T + b``."""
    return torch.cat([h, torch.ones_like(h[:, :1])], 1), torch.cat([w, b[:, None]], 1)


@pytest.mark.parametrize("tail", ["renormalize", "bucket", "dense"])
def test_distillation_with_bias_equals_the_augmented_operands(tail: str, backend: str) -> None:
    """The sparse teacher (``renormalize``: the gradient at the ids only, ``db`` from
    the sparse terms; ``bucket``: a gradient tile) and the dense one: loss and
    gradients equal the bias-free function on ``[h, 1]``, ``[W, b]``."""
    from hookspec import TeacherTail
    from torch_impl.processors import DenseTeacher

    p = _problem(2)
    dtype = torch.float64 if backend == "torch" else torch.float32
    g = torch.Generator().manual_seed(3)
    if tail == "dense":
        teacher: Any = DenseTeacher(
            hidden_states=torch.randn(N, 4, generator=g, dtype=torch.float64).to(dtype),
            weight=torch.randn(V, 4, generator=g, dtype=torch.float64).to(dtype),
        )
        config = DistillConfig(temperature=1.5)
    else:
        lp = (
            torch.randn(N, V, generator=g, dtype=torch.float64)
            .log_softmax(-1)
            .sort(-1, descending=True)
        )
        teacher = SparseTeacher(
            ids=lp.indices[:, :K].contiguous(), logprobs=lp.values[:, :K].to(dtype)
        )
        config = DistillConfig(temperature=1.5, tail=TeacherTail(tail))
    opts = LinearOptions(logit_scale=SCALE, tile_rows=4)
    h, w, b = _leaves(p, dtype)
    got = linear_distillation_loss(h, w, p["y"], teacher, options=opts, config=config, bias=b)
    got.loss.backward()
    ha, wa = (x.detach().clone().requires_grad_() for x in _augmented(*_leaves(p, dtype)))
    want = linear_distillation_loss(ha, wa, p["y"], teacher, options=opts, config=config)
    want.loss.backward()
    assert ha.grad is not None and wa.grad is not None
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got.loss, want.loss, **tol)
    torch.testing.assert_close(got.kl, want.kl, **tol)
    torch.testing.assert_close(h.grad, ha.grad[:, :H], **tol)
    torch.testing.assert_close(w.grad, wa.grad[:, :H], **tol)
    torch.testing.assert_close(b.grad, wa.grad[:, H], **tol)
    assert float(b.grad.abs().max()) > 1e-3  # type: ignore[union-attr]


def test_a_zero_bias_is_no_bias_bitwise() -> None:
    """``b = 0`` adds exact zeros: the values are those without a bias, bit for bit."""
    p = _problem(3)
    for t in (1.3, p["t"]):
        opts = LinearOptions(temperature=t, logit_scale=SCALE, tile_rows=4, tile_cols=8)
        zero = torch.zeros(V, dtype=torch.float64)
        a = linear_logprobs(p["h"], p["w"], p["y"], options=opts, with_entropy=True)
        c = linear_logprobs(p["h"], p["w"], p["y"], options=opts, with_entropy=True, bias=zero)
        assert torch.equal(a.logprobs, c.logprobs) and torch.equal(a.lse, c.lse)


def test_bias_alone_requiring_grad() -> None:
    """Only the bias requires a gradient: ``db`` is formed (no ``dh``, ``dW``) by the
    recomputing sweep and by the fused loss."""
    p = _problem(4)
    want = _truth(p, p["t"])
    opts = LinearOptions(temperature=p["t"], logit_scale=SCALE, tile_rows=4, tile_cols=8)
    b = p["b"].clone().requires_grad_()
    r = linear_logprobs(p["h"], p["w"], p["y"], options=opts, bias=b, with_entropy=True)
    assert r.entropy is not None
    (p["c_lp"] * r.logprobs + p["c_ent"] * r.entropy + p["c_lse"] * r.lse).sum().backward()
    close_to_float64(b.grad, want["db"], torch.float64)  # type: ignore[arg-type]
    b = p["b"].clone().requires_grad_()
    f = fused_token_loss(
        p["h"],
        p["w"],
        p["y"],
        lambda lp, ent, rows: (p["c_lp"][rows] * lp).sum(),
        options=opts,
        bias=b,
    )
    f.loss.backward()
    want = _truth({**p, "c_ent": p["c_ent"] * 0, "c_lse": p["c_lse"] * 0}, p["t"])
    close_to_float64(b.grad, want["db"], torch.float64)  # type: ignore[arg-type]


def test_recomputed_backward_twice_and_create_graph_refused() -> None:
    """The recomputing functions recompute: a second backward (``retain_graph``) gives
    the same gradients; ``create_graph=True`` raises by name. The fused loss formed its
    gradients once: a second backward raises."""
    p = _problem(5)
    opts = LinearOptions(temperature=p["t"], tile_rows=4, tile_cols=8)
    h, w, b = _leaves(p, torch.float64)
    for name, out in [
        ("linear_logprobs", linear_logprobs(h, w, p["y"], options=opts, bias=b).logprobs),
        ("linear_topk_logprobs", linear_topk_logprobs(h, w, k=K, options=opts, bias=b).logprobs),
    ]:
        first = torch.autograd.grad(out.sum(), (h, w, b), retain_graph=True)
        second = torch.autograd.grad(out.sum(), (h, w, b), retain_graph=True)
        assert all(torch.equal(x, y) for x, y in zip(first, second, strict=True))
        with pytest.raises(RuntimeError, match=f"{name}: double backward"):
            torch.autograd.grad(out.sum(), (h, w, b), create_graph=True)
    f = fused_token_loss(h, w, p["y"], lambda lp, ent, rows: lp.sum(), options=opts, bias=b)
    f.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the same call twice"):
        f.loss.backward()


@pytest.mark.parametrize(
    ("bias", "match"),
    [
        ([0.0] * V, "a torch.Tensor"),
        (torch.zeros(V, dtype=torch.long), "floating dtype"),
        (torch.zeros(V + 1, dtype=torch.float64), r"shape \[V_local\]: \[23\]"),
        (torch.zeros(1, V, dtype=torch.float64), r"shape \[V_local\]: \[23\]"),
        (torch.zeros(V, dtype=torch.float32), "weight's dtype"),
        (torch.full((V,), float("nan"), dtype=torch.float64), "finite"),
        (
            torch.zeros(V, dtype=torch.float64).index_fill(0, torch.tensor([4]), float("inf")),
            "finite",
        ),
        (torch.zeros(V, dtype=torch.float64, device="meta"), "bias"),
    ],
)
def test_bad_bias_refused_by_name(bias: Any, match: str) -> None:
    p = _problem(6)
    teacher = SparseTeacher(ids=torch.zeros(N, 1, dtype=torch.long), logprobs=torch.zeros(N, 1))
    calls = [
        lambda: linear_logprobs(p["h"], p["w"], p["y"], bias=bias),
        lambda: linear_topk_logprobs(p["h"], p["w"], k=2, bias=bias),
        lambda: fused_token_loss(p["h"], p["w"], p["y"], lambda lp, ent, rows: lp.sum(), bias=bias),
        lambda: linear_distillation_loss(p["h"], p["w"], p["y"], teacher, bias=bias),
    ]
    for call in calls:
        with pytest.raises(ContractError, match=match) as err:
            call()
        assert err.value.field == "bias"


# ---------------------------------------------------------------- bf16


def _bf16_run(
    p: dict[str, torch.Tensor], fn: str, how: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``fn`` (``linear_logprobs`` with entropy and lse, or the fused loss's single
    pass) with a bias: ``how`` "ours" at bf16 compute on the bf16 inputs;
    "materialised": the logits ``addmm(b, h, W.T)`` formed in ``dtype`` (bf16: the
    naive path, rounded once; float64: the truth), then the maths on them (hidden =
    the logits, weight = the identity)."""
    h, w, b = (p[k].to(torch.bfloat16).to(dtype).requires_grad_() for k in ("h", "w", "b"))
    t = p["t"].float()
    if how == "ours":
        args, bias, opts = (
            (h, w),
            b,
            LinearOptions(temperature=t, logit_scale=SCALE, compute_dtype=dtype),
        )
    else:
        z = torch.addmm(b, h, w.T)
        zf = z.float() if dtype == torch.bfloat16 else z
        args, bias, opts = (
            (zf, torch.eye(zf.shape[1], dtype=zf.dtype)),
            None,
            LinearOptions(temperature=t, logit_scale=SCALE),
        )
    if fn == "fused":
        f = fused_token_loss(
            *args,
            p["y"],
            lambda lp, ent, rows: (p["c_lp"][rows] * lp).sum(),
            options=opts,
            entropy_grad=False,
            bias=bias,
        )
        out, total = {"lp": f.logprobs, "lse": f.lse}, f.loss
    else:
        r = linear_logprobs(*args, p["y"], options=opts, with_entropy=True, bias=bias)
        assert r.entropy is not None
        out = {"lp": r.logprobs, "ent": r.entropy, "lse": r.lse}
        total = sum((v.double() * p["c_" + k]).sum() for k, v in out.items())
    grads = torch.autograd.grad(total, (h, w, b))
    return {
        **{k: v.detach() for k, v in out.items()},
        **dict(zip(("dh", "dw", "db"), grads, strict=True)),
    }


@pytest.mark.parametrize("fn", ["logprobs", "fused"])
def test_bf16_compute_against_float64_beside_the_naive_path(fn: str, backend: str) -> None:
    """Each value and gradient within a third of the naive bf16 path's error, or twice
    the bf16 rounding of the float64 result (tests/processors/test_precision.py's rule)."""
    g = torch.Generator().manual_seed(7)
    n, v = 96, 1024 if backend == "torch" else 256
    y = torch.randint(0, v, (n,), generator=g)
    y[::7] = IGNORE
    p = {
        "h": torch.randn(n, 64, generator=g, dtype=torch.float64) * 1.5,
        "w": torch.randn(v, 64, generator=g, dtype=torch.float64) * 0.3,
        "b": torch.randn(v, generator=g, dtype=torch.float64),
        "y": y,
        "t": torch.rand(n, generator=g, dtype=torch.float64) + 0.5,
        **{
            f"c_{k}": torch.randn(n, generator=g, dtype=torch.float64) for k in ("lp", "ent", "lse")
        },
    }
    truth = _bf16_run(p, fn, "materialised", torch.float64)
    ours = _bf16_run(p, fn, "ours", torch.bfloat16)
    naive = _bf16_run(p, fn, "materialised", torch.bfloat16)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b).norm() / b.norm())

    for key, want in truth.items():
        err, naive_err, rounding = (
            rel(ours[key], want),
            rel(naive[key], want),
            rel(want.to(torch.bfloat16), want),
        )
        assert err <= max(naive_err / 3, 2 * rounding), (fn, backend, key, err, naive_err, rounding)


# ---------------------------------------------------------------- tp=2


def _tp2(
    rank: int, p: dict[str, torch.Tensor], want: dict[str, torch.Tensor], backends: list[str]
) -> None:
    from megatron.core import parallel_state

    from torch_impl import TorchCollectives

    coll = TorchCollectives(
        parallel_state.get_tensor_model_parallel_group(), sequence_parallel=False
    )
    lo, hi = (0, 11) if rank == 0 else (11, V)  # unequal shards
    for be in backends:
        dtype = torch.float64 if be == "torch" else torch.float32
        base = LinearOptions(
            temperature=p["t"].to(dtype),
            logit_scale=SCALE,
            vocab=VocabShard(lo, hi, V),
            collectives=coll,
            backend=be,  # type: ignore[arg-type]
            tile_rows=4,
            tile_cols=8,
        )

        def shard(dtype: torch.dtype = dtype) -> tuple[torch.Tensor, ...]:
            h, w, b = _leaves(p, dtype)
            return (
                h,
                w.detach()[lo:hi].clone().requires_grad_(),
                b.detach()[lo:hi].clone().requires_grad_(),
            )

        h, w, b = shard()
        r = linear_logprobs(h, w, p["y"], options=base, bias=b, with_entropy=True)
        assert r.entropy is not None
        (p["c_lp"] * r.logprobs + p["c_ent"] * r.entropy + p["c_lse"] * r.lse).sum().backward()
        close_to_float64(r.lse, want["lse"], dtype)
        for key, x, part in [
            ("dh", h, slice(None)),
            ("dw", w, slice(lo, hi)),
            ("db", b, slice(lo, hi)),
        ]:
            close_to_float64(x.grad, want[key][part], dtype)  # type: ignore[arg-type]
        h, w, b = shard()
        f = fused_token_loss(
            h,
            w,
            p["y"],
            lambda lp, ent, rows: (p["c_lp"][rows] * lp).sum() + (p["c_ent"][rows] * ent).sum(),
            options=base,
            lse_loss=lambda lse, rows: (p["c_lse"][rows] * lse).sum(),
            bias=b,
        )
        f.loss.backward()
        close_to_float64(f.loss, want["loss"], dtype)
        for key, x, part in [
            ("dh", h, slice(None)),
            ("dw", w, slice(lo, hi)),
            ("db", b, slice(lo, hi)),
        ]:
            close_to_float64(x.grad, want[key][part], dtype)  # type: ignore[arg-type]
        h, w, b = shard()
        top = linear_topk_logprobs(h, w, k=K, labels=p["y"], options=base, bias=b)
        assert top.label_logprobs is not None
        (top.logprobs.sum() + top.label_logprobs.sum()).backward()
        close_to_float64(top.logprobs, want["topk"], dtype)
        for key, x, part in [
            ("tdh", h, slice(None)),
            ("tdw", w, slice(lo, hi)),
            ("tdb", b, slice(lo, hi)),
        ]:
            close_to_float64(x.grad, want[key][part], dtype)  # type: ignore[arg-type]


@pytest.mark.release_independent
def test_tp2_bias_against_float64() -> None:
    """Two gloo processes, each a vocabulary shard and its part of the bias: the
    logprobs, the fused loss and the top-k, each rank's ``db`` its shard's."""
    p = _problem(8)
    backends = ["torch"] + (["triton"] if importlib.util.find_spec("triton") is not None else [])
    run_distributed(_tp2, p, _truth(p, p["t"]), backends, tp=2)

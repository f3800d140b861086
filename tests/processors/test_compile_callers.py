"""Training steps wrapped in ``torch.compile`` around the tensor functions and the fused
loss: Dynamo breaks the graph at each call (the engine runs eagerly, its backward too)
and compiles the caller's code around it, with the eager and the inductor backends on
the CPU (``fullgraph=False``). Each compiled step's values and gradients equal the
same step run eagerly. A backward trace once failed inside the engine ("Attempting to
broadcast a dimension of length 0": the cotangent of an output left empty)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hookspec import OutputContext, VocabShard
from torch_impl.processors import (
    DistillConfig,
    LinearOptions,
    SparseTeacher,
    cross_entropy_loss,
    fused_token_loss,
    linear_distillation_loss,
    linear_logprobs,
    linear_topk_logprobs,
)

N, H, V = 10, 6, 23
# torch alone: the same outcome on every Megatron release and Python (docs/testing.md)
pytestmark = pytest.mark.release_independent

IGNORE = -100


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, V, (N,), generator=g)
    y[3] = IGNORE
    ids = torch.randint(0, V, (N, 3), generator=g)
    return {
        "h": torch.randn(N, H, generator=g, dtype=torch.float64),
        "w": torch.randn(V, H, generator=g, dtype=torch.float64),
        "b": torch.randn(V, generator=g, dtype=torch.float64),
        "c": torch.rand(V, generator=g, dtype=torch.float64),
        "y": y,
        "ids": ids,
        "lp_t": torch.randn(N, 3, generator=g, dtype=torch.float64)
        .log_softmax(-1)
        .sort(-1, descending=True)
        .values,
    }


OPTS = LinearOptions(tile_rows=4, tile_cols=8)


def _logprobs(h: Any, w: Any, b: Any, p: dict[str, Any]) -> torch.Tensor:
    r = linear_logprobs(h, w, p["y"], with_entropy=True, options=OPTS)
    assert r.entropy is not None
    return r.logprobs.sum() + 0.1 * r.entropy.sum()


def _mean_logit(h: Any, w: Any, b: Any, p: dict[str, Any]) -> torch.Tensor:
    r = linear_logprobs(
        h, w, p["y"], with_mean_logit=True, mean_logit_weights=p["c"], bias=b, options=OPTS
    )
    assert r.mean_logit is not None
    return (r.logprobs * 0.5).sum() + r.mean_logit.square().sum() + r.lse.sum()


def _topk(h: Any, w: Any, b: Any, p: dict[str, Any]) -> torch.Tensor:
    r = linear_topk_logprobs(h, w, k=3, labels=p["y"], with_entropy=True, options=OPTS, bias=b)
    assert r.label_logprobs is not None and r.entropy is not None
    return r.logprobs.sum() + r.label_logprobs.sum() - r.entropy.mean()


def _fused(h: Any, w: Any, b: Any, p: dict[str, Any]) -> torch.Tensor:
    f = fused_token_loss(
        h,
        w,
        p["y"],
        lambda lp, ent, rows: -(lp.sum()) - 0.1 * ent.sum(),
        options=OPTS,
        lse_loss=lambda lse, rows: 1e-2 * lse.square().sum(),
        bias=b,
    )
    return f.loss * 2.0


def _distill(h: Any, w: Any, b: Any, p: dict[str, Any]) -> torch.Tensor:
    teacher = SparseTeacher(ids=p["ids"], logprobs=p["lp_t"])
    r = linear_distillation_loss(
        h, w, p["y"], teacher, options=OPTS, config=DistillConfig(tail="bucket")
    )
    return r.loss


def _context(h: Any, w: Any, p: dict[str, Any]) -> OutputContext:
    return OutputContext(
        hidden_states=h.view(N, 1, H),
        labels=p["y"].view(1, N),
        vocab_weight=w,
        vocab=VocabShard(0, V, V),
    )


DYNAMO_BUILDS_FROZEN_DATACLASSES = torch.__version__ >= (2, 13)  # TorchVersion compares
"""Dynamo before torch 2.13 fails with an internal ``AssertionError`` (``self.source is
not None``, ``variables/user_defined.py``) when it traces the construction of a frozen
dataclass whose field has a ``default_factory`` that is itself a frozen dataclass, as
``OutputContext.parallel`` is (``test_dynamo_of_torch_2_11_cannot_build_the_context``
keeps the minimal case). There the context is built outside the traced code
(``torch.compiler.disable``), as docs/processors.md advises."""


def _processor(h: Any, w: Any, b: Any, p: dict[str, Any]) -> torch.Tensor:
    build = _context if DYNAMO_BUILDS_FROZEN_DATACLASSES else torch.compiler.disable(_context)
    return cross_entropy_loss(reduction="mean", tile_rows=4)(build(h, w, p))["loss"]


CALLERS: dict[str, Callable[..., torch.Tensor]] = {
    "linear_logprobs": _logprobs,
    "linear_logprobs(mean_logit, bias)": _mean_logit,
    "linear_topk_logprobs": _topk,
    "fused_token_loss": _fused,
    "linear_distillation_loss": _distill,
}


def _step(call: Callable[..., torch.Tensor], p: dict[str, Any]) -> Callable[..., torch.Tensor]:
    """A training step: traced work before and after the call."""

    def step(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(h) * 1.5 + 0.25  # compiled code around the call
        return call(x, w, b, p) * 0.5 + (w.square().sum() * 1e-3)

    return step


def _run(step: Callable[..., torch.Tensor], p: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    h, w, b = (p[k].clone().requires_grad_() for k in ("h", "w", "b"))
    loss = step(h, w, b)
    loss.backward()
    grads = tuple(torch.zeros_like(x) if x.grad is None else x.grad for x in (h, w, b))
    return (loss.detach(), *grads)


@pytest.mark.parametrize(
    ("name", "compiler"),
    [(name, c) for name in CALLERS for c in ("eager", "inductor")]
    # a processor: Dynamo traces its checks (many graph breaks, slow to compile): eager only
    + [("cross_entropy_loss(mean)", "eager")],
)
def test_a_compiled_step_equals_the_eager_one(name: str, compiler: str) -> None:
    torch._dynamo.reset()
    p = _inputs()
    step = _step(CALLERS.get(name, _processor), p)
    want = _run(step, p)
    got = _run(torch.compile(step, backend=compiler, fullgraph=False), p)
    for g, w, what in zip(got, want, ("loss", "dh", "dW", "db"), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=what)


@pytest.mark.skipif(DYNAMO_BUILDS_FROZEN_DATACLASSES, reason="torch >= 2.13 builds it")
def test_dynamo_of_torch_2_11_cannot_build_the_context() -> None:
    """The defect the processor's case steps around, in its minimal form: when torch
    is upgraded past it, this test fails and the workaround goes."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Inner:
        a: int = 1

    @dataclasses.dataclass(frozen=True)
    class Outer:
        x: torch.Tensor
        inner: Inner = dataclasses.field(default_factory=Inner)

    def f(t: torch.Tensor) -> torch.Tensor:
        return Outer(x=t * 2).x.sum()

    torch._dynamo.reset()
    with pytest.raises(AssertionError, match="from user code"):
        torch.compile(f, backend="eager")(torch.ones(3))
    torch._dynamo.reset()

"""The processors' ``backend="auto"`` forced to one backend for a test; the
float64 comparison that the option tests share (their ``backend`` fixture, each
backend in turn, is ``tests/conftest.py``'s)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hookspec import OutputContext, VocabShard
from torch_impl.processors import BackendChoice

__all__ = [
    "close_to_float64",
    "force_backend",
    "masked_context",
    "masked_problem",
    "skip_fp64_triton",
    "token_problem",
]


def force_backend(monkeypatch: pytest.MonkeyPatch, name: str) -> str:
    """Make ``"auto"`` answer ``name`` (the table's entry for any device) for the rest
    of the test; skip where ``name`` is ``"triton"`` and Triton is not installed."""
    if name == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip(
            "triton is not installed here (py311's CPU torch wheel has none); "
            "the torch backend runs"
        )
    choice = BackendChoice(name, measured=False, source="test")
    monkeypatch.setattr("torch_impl.processors._options.auto_choice", lambda device: choice)
    return name


def close_to_float64(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` computed in ``dtype`` against float64's ``want``: fp64 to 1e-12, fp32 to
    2e-5 of the largest entry (a logit gradient rounded once)."""
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(
        got.detach().double(), want, rtol=tol, atol=tol * float(want.abs().max())
    )


def skip_fp64_triton(backend: str, dtype: torch.dtype) -> None:
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernels take fp32/bf16/fp16")


def token_problem(
    seed: int, n: int, h: int, v: int, *, scale: float = 1.5, coefficients: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Float64 rows ``h [n, h]`` (times ``scale``), a vocabulary ``w [v, h]``, labels
    ``y [n]`` (rows 2 and 7 ignored, rows 0 and 1 the first and last id), a per-token
    temperature ``t [n]`` exact in fp32, and a ``[n]`` cotangent per name in
    ``coefficients``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, v, (n,), generator=g)
    y[[2, 7]] = -100
    y[0], y[1] = 0, v - 1
    f64 = torch.float64
    out = {
        "h": torch.randn(n, h, generator=g, dtype=f64) * scale,
        "w": torch.randn(v, h, generator=g, dtype=f64),
        "y": y,
        "t": (torch.rand(n, generator=g, dtype=f64) + 0.5).float().double(),
    }
    return out | {name: torch.randn(n, generator=g, dtype=f64) for name in coefficients}


def masked_problem(seed: int, b: int, s: int, h: int, v: int) -> dict[str, torch.Tensor]:
    """A processor's float64 ``[s, b, h]`` hidden states (times 2), a weight ``[v, h]``,
    labels ``[b, s]`` (tokens (0, 2) and (2, 4) ignored) and a loss mask with a 0.5 and a
    1 at an ignored label."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, v, (b, s), generator=g)
    y[0, 2] = y[2, 4] = -100
    mask = (torch.rand(b, s, generator=g) > 0.25).double()
    mask[0, 0] = 0.5
    mask[0, 2] = 1.0  # counted by the mask, but the label is ignored
    return {
        "h": torch.randn(s, b, h, generator=g, dtype=torch.float64) * 2.0,
        "w": torch.randn(v, h, generator=g, dtype=torch.float64),
        "y": y,
        "mask": mask,
    }


def masked_context(
    h: torch.Tensor, w: torch.Tensor, p: dict[str, torch.Tensor], *, scale: float, mask: bool = True
) -> OutputContext:
    """:func:`masked_problem`'s context on one shard, the logits scaled by ``scale``."""
    v = int(w.shape[0])
    return OutputContext(
        hidden_states=h,
        labels=p["y"],
        vocab_weight=w,
        vocab=VocabShard(0, v, v),
        loss_mask=p["mask"].float() if mask else None,
        scale_logits=lambda x: x * scale,
    )

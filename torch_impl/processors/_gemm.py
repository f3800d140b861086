"""The engine's GEMMs and small tensor helpers (:mod:`._engine`): products of bf16/fp16
operands into an fp32 output, written by the first product and accumulated after."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["gemm_into", "no_autocast", "not_traced", "rowdot", "scaled_"]

_F = TypeVar("_F", bound=Callable[..., Any])


def not_traced(fn: _F) -> _F:
    """``fn`` run eagerly inside ``torch.compile``: Dynamo breaks the graph at its call and
    never traces into it. The engine's sweeps (Python loops over tiles, host-side choices,
    autograd Functions whose backward recomputes) are not traceable as a graph; a caller's
    compiled code around them still is (``fullgraph=False``), eager or inductor."""
    return cast(_F, torch.compiler.disable(fn, recursive=True))


def scaled_(x: torch.Tensor, factor: torch.Tensor | float) -> torch.Tensor:
    """``x *= factor`` in place (nothing for a factor of 1)."""
    return x.mul_(factor) if isinstance(factor, torch.Tensor) or factor != 1.0 else x


def no_autocast(x: torch.Tensor) -> torch.autocast:
    """Autocast off on ``x``'s device: the engine chooses every dtype itself (a
    caller's ``torch.autocast`` would run its GEMMs and row dots in bf16)."""
    return torch.autocast(x.device.type, enabled=False)


_GEMM_OUT_DTYPE = (
    "dtype_out" in torch.ops.aten.mm.overloads() and "dtype_out" in torch.ops.aten.addmm.overloads()
)


def gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool) -> torch.Tensor:
    """The first product into ``out`` is ``out = a @ b`` (never zero-filled), later ones
    ``out += a @ b``. bf16/fp16 operands into an fp32 ``out`` go through
    ``torch.mm(a, b, out_dtype=torch.float32, out=out)`` on CUDA, torch >= 2.8 (fp32
    accumulation, no copy of either operand), else are upcast (bf16 products are exact in fp32)."""
    same = a.dtype == out.dtype and b.dtype == out.dtype
    if not same and not (_GEMM_OUT_DTYPE and a.is_cuda and a.dtype == b.dtype):
        a, b, same = a.to(out.dtype), b.to(out.dtype), True
    if same:
        return torch.mm(a, b, out=out) if first else out.addmm_(a, b)
    if first:
        return torch.mm(a, b, out_dtype=out.dtype, out=out)
    try:
        return torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    except (RuntimeError, TypeError):  # no fp32 accumulator in this release's addmm(out_dtype)
        return out.add_(
            torch.mm(a, b, out_dtype=out.dtype)
        )  # (torch 2.11's decomposition: TypeError)


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(1)`` without the ``[rows, cols]`` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)

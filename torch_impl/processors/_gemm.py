"""The engine's GEMMs and small tensor helpers (:mod:`._engine`): products of bf16/fp16
operands into an fp32 output, written by the first product and accumulated after."""

from __future__ import annotations

import torch

__all__ = ["addmm_into", "gemm_into", "mm_into", "no_autocast", "rowdot", "scaled_"]


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


def _out_dtype_gemm(a: torch.Tensor) -> bool:
    """cuBLAS multiplies bf16/fp16 operands into an fp32 output here
    (``torch.mm(..., out_dtype=torch.float32)``, CUDA only, torch >= 2.8)."""
    return _GEMM_OUT_DTYPE and a.is_cuda


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out = a @ b``: operands of ``out``'s dtype multiply straight into it; bf16/fp16
    operands into an fp32 ``out`` go through ``torch.mm(a, b, out_dtype=torch.float32,
    out=out)`` on CUDA (fp32 accumulation, one fp32 result, no copy of either operand),
    else are upcast first (the products of bf16 numbers are exact in fp32, so the
    result is the same)."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        return torch.mm(a, b, out=out)
    if _out_dtype_gemm(a) and a.dtype == b.dtype:
        return torch.mm(a, b, out_dtype=out.dtype, out=out)
    return torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


def addmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out += a @ b`` in place, dtypes as :func:`mm_into`."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        return out.addmm_(a, b)
    if _out_dtype_gemm(a) and a.dtype == b.dtype:
        try:
            return torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        except (RuntimeError, TypeError):  # no fp32 accumulator in this release's addmm(out_dtype)
            return out.add_(torch.mm(a, b, out_dtype=out.dtype))  # (torch 2.11's decomposition: TypeError)
    return out.addmm_(a.to(out.dtype), b.to(out.dtype))


def gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool) -> torch.Tensor:
    """``out = a @ b`` for the first product into ``out``, ``out += a @ b`` after: an
    accumulator is written by its first GEMM, never zero-filled."""
    return mm_into(out, a, b) if first else addmm_into(out, a, b)


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(1)`` without the ``[rows, cols]`` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)

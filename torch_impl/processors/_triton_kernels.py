"""Triton epilogue kernels of the Triton backend: the memory-bound work on one fp32
logits chunk ``z [rows, cols]`` that cuBLAS has just formed (``torch.mm``). No GEMM
runs in here.

- :func:`chunk_stats_`: one read of the chunk. For each of its rows, the running
  online-logsumexp statistics of this vocab shard (max ``m``, rescaled sum of
  exponentials ``s``, entropy term ``t``, selected logit ``zy``), updated in place.
- :func:`logit_grad_`: one read and one write of the chunk. The logits become the
  gradient of the tempered logits, in place, in the compute dtype; ``dh`` and ``dW``
  are then cuBLAS GEMMs on it.

A program owns ``BLOCK_M`` whole rows and walks their columns ``BLOCK_N`` at a time,
so no atomics are needed: the results are the same bit for bit run to run.

Import this module only where Triton is wanted: ``triton.jit`` decides at import
whether the kernels run compiled or under ``TRITON_INTERPRET=1`` (numpy, no GPU).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._setup import KernelConfig

__all__ = ["chunk_stats_", "grad_launch", "logit_grad_", "stats_launch"]


@triton.jit
def _chunk_stats_kernel(
    z_ptr,
    lab_ptr,
    inv_t_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    zy_ptr,
    rows,
    cols,
    row0,
    col0,
    stride_z,
    inv_t_scalar,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < rows
    token = row0 + r  # index into the [n] vectors
    lab = tl.load(lab_ptr + token, mask=row_ok, other=-1) - col0
    if PER_TOKEN_T:
        inv_t = tl.load(inv_t_ptr + token, mask=row_ok, other=1.0)
    else:
        inv_t = tl.full((BLOCK_M,), 1.0, tl.float32) * inv_t_scalar
    m = tl.load(m_ptr + token, mask=row_ok, other=float("-inf"))
    s = tl.load(s_ptr + token, mask=row_ok, other=0.0)
    zy = tl.load(zy_ptr + token, mask=row_ok, other=0.0)
    if WITH_ENTROPY:
        t = tl.load(t_ptr + token, mask=row_ok, other=0.0)
    else:
        t = tl.zeros((BLOCK_M,), tl.float32)
    z_rows = z_ptr + r.to(tl.int64)[:, None] * stride_z
    for c0 in range(0, cols, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)
        col_ok = c < cols
        ok = row_ok[:, None] & col_ok[None, :]
        z = tl.load(z_rows + c[None, :], mask=ok, other=0.0) * inv_t[:, None]
        zy += tl.sum(tl.where((c[None, :] == lab[:, None]) & ok, z, 0.0), axis=1)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        started = m > float("-inf")
        alpha = tl.where(started, tl.exp(m - m_new), 0.0)
        zc = z - m_new[:, None]
        e = tl.where(col_ok[None, :], tl.exp(zc), 0.0)
        if WITH_ENTROPY:
            shift = tl.where(started, (m - m_new) * s, 0.0)
            t = alpha * (t + shift) + tl.sum(tl.where(col_ok[None, :], e * zc, 0.0), axis=1)
        s = s * alpha + tl.sum(e, axis=1)
        m = m_new
    tl.store(m_ptr + token, m, mask=row_ok)
    tl.store(s_ptr + token, s, mask=row_ok)
    tl.store(zy_ptr + token, zy, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(t_ptr + token, t, mask=row_ok)


@triton.jit
def _logit_grad_kernel(
    z_ptr,
    out_ptr,
    lab_ptr,
    inv_t_ptr,
    max_ptr,
    a_ptr,
    b_ptr,
    g_ptr,
    rows,
    cols,
    row0,
    col0,
    stride_z,
    stride_out,
    inv_t_scalar,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    WITH_B: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < rows
    token = row0 + r
    lab = tl.load(lab_ptr + token, mask=row_ok, other=-1) - col0
    if PER_TOKEN_T:
        inv_t = tl.load(inv_t_ptr + token, mask=row_ok, other=1.0)
    else:
        inv_t = tl.full((BLOCK_M,), 1.0, tl.float32) * inv_t_scalar
    big_m = tl.load(max_ptr + token, mask=row_ok, other=0.0)
    a = tl.load(a_ptr + token, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + token, mask=row_ok, other=0.0)
    if WITH_B:
        b = tl.load(b_ptr + token, mask=row_ok, other=0.0)
    z_rows = z_ptr + r.to(tl.int64)[:, None] * stride_z
    out_rows = out_ptr + r.to(tl.int64)[:, None] * stride_out
    for c0 in range(0, cols, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)
        ok = row_ok[:, None] & (c < cols)[None, :]
        zc = tl.load(z_rows + c[None, :], mask=ok, other=0.0) * inv_t[:, None] - big_m[:, None]
        # In place: a 2-byte output overwrites the first half of the row's fp32 bytes,
        # and every byte this step writes was read by this step or an earlier one (an
        # fp32 output overwrites exactly what it read). The barrier holds every warp's
        # stores until all of this step's loads are done.
        tl.debug_barrier()
        e = tl.exp(zc)
        if WITH_B:
            gz = -e * (a[:, None] + b[:, None] * zc)
        else:
            gz = -e * a[:, None]
        gz += tl.where(c[None, :] == lab[:, None], g[:, None], 0.0)
        gz = gz * inv_t[:, None]
        tl.store(out_rows + c[None, :], gz.to(out_ptr.dtype.element_ty), mask=ok)


def stats_launch(
    z: Any,
    labels_local: Any,
    inv_t: Any,
    m: Any,
    s: Any,
    t: Any,
    zy: Any,
    *,
    row0: int,
    col0: int,
    cfg: KernelConfig,
) -> tuple[tuple[int], tuple[Any, ...], dict[str, Any]]:
    """``(grid, args, kwargs)`` of one :func:`chunk_stats_` launch (tensors or Triton
    ``MockTensor``s: the compile test specialises the kernel from these)."""
    rows, cols = int(z.shape[0]), int(z.shape[1])
    per_token = not isinstance(inv_t, float)
    args = (
        z,
        labels_local,
        inv_t if per_token else m,
        m,
        s,
        t if t is not None else m,
        zy,
        rows,
        cols,
        row0,
        col0,
        z.stride(0),
        1.0 if per_token else float(inv_t),
    )
    kwargs = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        PER_TOKEN_T=per_token,
        WITH_ENTROPY=t is not None,
        num_warps=cfg.num_warps,
    )
    return (triton.cdiv(rows, cfg.block_m),), args, kwargs


def chunk_stats_(
    z: torch.Tensor,
    labels_local: torch.Tensor,
    inv_t: torch.Tensor | float,
    m: torch.Tensor,
    s: torch.Tensor,
    t: torch.Tensor | None,
    zy: torch.Tensor,
    *,
    row0: int,
    col0: int,
    cfg: KernelConfig,
) -> None:
    """Update, in place, the running statistics (``[n]`` fp32 each) of the tokens
    ``row0 + arange(rows)`` with the chunk ``z`` ``[rows, cols]`` (fp32, untempered)
    of vocabulary entries ``col0 + arange(cols)`` of the shard::

        zt = z * inv_t[rows, None]
        m_new = maximum(m, zt.max(1))
        s = s * exp(m - m_new) + exp(zt - m_new).sum(1)
        t = exp(m - m_new) * (t + (m - m_new) * s_old) + (exp(zt - m_new) * (zt - m_new)).sum(1)
        zy += zt[i, labels_local[i] - col0]  (where that column is in the chunk)
        m = m_new
    """
    grid, args, kwargs = stats_launch(z, labels_local, inv_t, m, s, t, zy, row0=row0, col0=col0, cfg=cfg)
    _chunk_stats_kernel[grid](*args, **kwargs)


def grad_launch(
    z: Any,
    out: Any,
    labels_local: Any,
    inv_t: Any,
    big_m: Any,
    coef: tuple[Any, Any, Any],
    *,
    row0: int,
    col0: int,
    cfg: KernelConfig,
) -> tuple[tuple[int], tuple[Any, ...], dict[str, Any]]:
    """``(grid, args, kwargs)`` of one :func:`logit_grad_` launch (as :func:`stats_launch`)."""
    rows, cols = int(z.shape[0]), int(z.shape[1])
    a, b, g = coef
    per_token = not isinstance(inv_t, float)
    args = (
        z,
        out,
        labels_local,
        inv_t if per_token else big_m,
        big_m,
        a,
        b if b is not None else a,
        g,
        rows,
        cols,
        row0,
        col0,
        z.stride(0),
        out.stride(0),
        1.0 if per_token else float(inv_t),
    )
    kwargs = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        PER_TOKEN_T=per_token,
        WITH_B=b is not None,
        num_warps=cfg.num_warps,
    )
    return (triton.cdiv(rows, cfg.block_m),), args, kwargs


def logit_grad_(
    z: torch.Tensor,
    dtype: torch.dtype,
    labels_local: torch.Tensor,
    inv_t: torch.Tensor | float,
    big_m: torch.Tensor,
    coef: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
    *,
    row0: int,
    col0: int,
    cfg: KernelConfig,
) -> torch.Tensor:
    """The gradient of the chunk's logits, in place in ``z``'s memory, returned as a
    ``[rows, cols]`` tensor of ``dtype`` (``z`` itself for fp32; for bf16/fp16 a view of
    the first half of each row's bytes, row stride ``2 * cols``, which cuBLAS reads as
    is). With ``coef = (a, b, g)`` of ``logit_grad_coefficients`` (``[n]`` each)::

        zc = z * inv_t[rows, None] - M[rows, None]
        gz = (-exp(zc) * (a + b * zc) + g * [col0 + j == labels_local]) * inv_t
    """
    if dtype == torch.float32:
        out = z
    else:
        rows, cols = z.shape
        out = z.view(dtype).view(rows, 2 * cols)[:, :cols]
    grid, args, kwargs = grad_launch(z, out, labels_local, inv_t, big_m, coef, row0=row0, col0=col0, cfg=cfg)
    _logit_grad_kernel[grid](*args, **kwargs)
    return out

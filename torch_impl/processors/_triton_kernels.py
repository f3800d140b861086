"""The Triton forms of the engine's memory-bound passes over one fp32 logits tile
``z [rows, cols]`` that cuBLAS has just formed; no GEMM runs in here. The statistics
(:func:`chunk_stats_`: one read; a running max, sum and entropy term per lane, reduced
across lanes once per row: one exponential an element, no cross-warp reduction in the
loop), the logit gradient (:func:`logit_grad_`: one read, one write), and the fused
loss's single pass over whole rows (:func:`exp_rows_`). A program owns ``BLOCK_M``
whole rows: no atomics, the same bits run to run. Imported on first use, so that
``TRITON_INTERPRET`` is read when the kernels are made.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._geometry import EXP_RANGE, KernelConfig

__all__ = ["chunk_stats_", "exp_rows_", "logit_grad_"]


@triton.jit
def _row_inv_t(inv_t_ptr, token, row_ok, inv_t_scalar, BLOCK_M: tl.constexpr, PER_TOKEN_T: tl.constexpr):
    if PER_TOKEN_T:
        inv_t = tl.load(inv_t_ptr + token, mask=row_ok, other=1.0)
    else:
        inv_t = tl.full((BLOCK_M,), 1.0, tl.float32) * inv_t_scalar
    return inv_t


@triton.jit
def _store_rounded(ptrs, x, mask):
    """``x`` (fp32) stored in the pointers' dtype, rounded to nearest even. bf16 is
    rounded here, on its bits: the interpreter's conversion truncates, so the kernels
    round the same way compiled and interpreted."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(ptrs, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


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
    token = r  # index into the tile's rows' vectors
    inv_t = _row_inv_t(inv_t_ptr, token, row_ok, inv_t_scalar, BLOCK_M, PER_TOKEN_T)
    z_rows = z_ptr + r.to(tl.int64)[:, None] * stride_z
    # the label's logit: one load per row
    lab = tl.load(lab_ptr + token, mask=row_ok, other=-1) - col0
    here = row_ok & (lab >= 0) & (lab < cols)
    zy_new = tl.load(z_rows + tl.where(here, lab, 0)[:, None], mask=here[:, None], other=0.0)
    zy_new = tl.sum(zy_new, axis=1) * inv_t
    # per-lane running max, sum of exp(z - max) and sum of exp(z - max) * (z - max)
    m_l = tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32)
    s_l = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    t_l = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for c0 in range(0, cols, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)
        ok = row_ok[:, None] & (c < cols)[None, :]
        z = tl.load(z_rows + c[None, :], mask=ok, other=float("-inf")) * inv_t[:, None]
        bigger = z > m_l
        live = z != float("-inf")  # NaN is live: it must reach the sums
        # one exponential: exp(-|z - m|) is the old sum's factor when z is the new
        # max, else the new element's term; a lane with nothing yet takes exp(z - z)
        # (1, or NaN for a NaN or infinite z)
        e = tl.exp(tl.where(m_l > float("-inf"), -tl.abs(z - m_l), z - z))
        if WITH_ENTROPY:
            shift = tl.where(s_l > 0.0, (m_l - z) * s_l, 0.0)
            t_l = tl.where(bigger, e * (t_l + shift), tl.where(live, t_l + e * (z - m_l), t_l))
        s_l = tl.where(bigger, e * s_l + 1.0, tl.where(live, s_l + e, s_l))
        m_l = tl.maximum(m_l, z)
    # reduce the lanes, then fold into the running statistics of earlier chunks
    m_c = tl.max(m_l, axis=1)
    a_l = tl.where(s_l > 0.0, tl.exp(m_l - m_c[:, None]), 0.0)
    s_c = tl.sum(s_l * a_l, axis=1)
    m = tl.load(m_ptr + token, mask=row_ok, other=float("-inf"))
    s = tl.load(s_ptr + token, mask=row_ok, other=0.0)
    m_new = tl.maximum(m, m_c)
    a_old = tl.where(s > 0.0, tl.exp(m - m_new), 0.0)
    a_new = tl.where(s_c > 0.0, tl.exp(m_c - m_new), 0.0)
    if WITH_ENTROPY:
        t_c = tl.sum(a_l * (t_l + tl.where(s_l > 0.0, (m_l - m_c[:, None]) * s_l, 0.0)), axis=1)
        t = tl.load(t_ptr + token, mask=row_ok, other=0.0)
        t = a_old * (t + tl.where(s > 0.0, (m - m_new) * s, 0.0)) + a_new * (
            t_c + tl.where(s_c > 0.0, (m_c - m_new) * s_c, 0.0)
        )
        tl.store(t_ptr + token, t, mask=row_ok)
    tl.store(s_ptr + token, s * a_old + s_c * a_new, mask=row_ok)
    tl.store(m_ptr + token, m_new, mask=row_ok)
    zy = tl.load(zy_ptr + token, mask=row_ok, other=0.0)
    tl.store(zy_ptr + token, zy + zy_new, mask=row_ok)


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
    col0,
    stride_z,
    stride_out,
    inv_t_scalar,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    WITH_B: tl.constexpr,
    IN_PLACE: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < rows
    token = r
    lab = tl.load(lab_ptr + token, mask=row_ok, other=-1) - col0
    inv_t = _row_inv_t(inv_t_ptr, token, row_ok, inv_t_scalar, BLOCK_M, PER_TOKEN_T)
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
        if IN_PLACE:
            # A 2-byte output overwrites the first half of the row's fp32 bytes, and
            # every byte this step writes was read by this step or an earlier one (an
            # fp32 output overwrites exactly what it read). The barrier holds every
            # warp's stores until all of this step's loads are done.
            tl.debug_barrier()
        e = tl.exp(zc)
        if WITH_B:
            gz = -e * (a[:, None] + b[:, None] * zc)
        else:
            gz = -e * a[:, None]
        gz += tl.where(c[None, :] == lab[:, None], g[:, None], 0.0)
        gz = gz * inv_t[:, None]
        _store_rounded(out_rows + c[None, :], gz, ok)


@triton.jit
def _exp_rows_kernel(
    z_ptr,
    out_ptr,
    lab_ptr,
    inv_t_ptr,
    c_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    zy_ptr,
    redo_ptr,
    rows,
    cols,
    stride_z,
    stride_out,
    exp_range,
    inv_t_scalar,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    REDO: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < rows
    token = r
    if REDO:  # only the rows the first launch flagged, with c = their max
        row_ok = row_ok & (tl.load(redo_ptr + token, mask=row_ok, other=0) != 0)
    if tl.max(row_ok.to(tl.int32), axis=0) > 0:
        inv_t = _row_inv_t(inv_t_ptr, token, row_ok, inv_t_scalar, BLOCK_M, PER_TOKEN_T)
        z_rows = z_ptr + r.to(tl.int64)[:, None] * stride_z
        out_rows = out_ptr + r.to(tl.int64)[:, None] * stride_out
        lab = tl.load(lab_ptr + token, mask=row_ok, other=-1)
        here = row_ok & (lab >= 0) & (lab < cols)
        zy = tl.load(z_rows + tl.where(here, lab, 0)[:, None], mask=here[:, None], other=0.0)
        zy = tl.sum(zy, axis=1) * inv_t
        if REDO:
            ref = tl.load(m_ptr + token, mask=row_ok, other=0.0)
        else:
            first = tl.arange(0, BLOCK_N)
            ok0 = row_ok[:, None] & (first < cols)[None, :]
            z0 = tl.load(z_rows + first[None, :], mask=ok0, other=float("-inf")) * inv_t[:, None]
            ref = tl.maximum(tl.max(z0, axis=1), tl.where(here, zy, float("-inf")))
        ref = tl.where(row_ok, ref, 0.0)
        m_l = tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32)
        s_l = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        t_l = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for c0 in range(0, cols, BLOCK_N):
            c = c0 + tl.arange(0, BLOCK_N)
            ok = row_ok[:, None] & (c < cols)[None, :]
            z = tl.load(z_rows + c[None, :], mask=ok, other=float("-inf")) * inv_t[:, None]
            zc = z - ref[:, None]
            e = tl.exp(zc)
            s_l += e
            t_l += tl.where(ok, e * zc, 0.0)
            m_l = tl.maximum(m_l, z)
            e_out = tl.where(c[None, :] == lab[:, None], 0.0, e)
            _store_rounded(out_rows + c[None, :], e_out, ok)
        tl.store(c_ptr + token, ref, mask=row_ok)
        big_m = tl.max(m_l, axis=1)
        tl.store(m_ptr + token, big_m, mask=row_ok)
        tl.store(s_ptr + token, tl.sum(s_l, axis=1), mask=row_ok)
        tl.store(t_ptr + token, tl.sum(t_l, axis=1), mask=row_ok)
        tl.store(zy_ptr + token, zy, mask=row_ok)
        if not REDO:
            tl.store(redo_ptr + token, (big_m - ref > exp_range).to(tl.int8), mask=row_ok)


# fmt: off
@triton.jit
def _exp_rows_both_kernel(
    z_ptr, out_ptr, lab_ptr, inv_t_ptr, c_ptr, m_ptr, s_ptr, t_ptr, zy_ptr, redo_ptr, rows, cols, stride_z,
    stride_out, exp_range, inv_t_scalar,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PER_TOKEN_T: tl.constexpr,
):
    """Both passes of :func:`exp_rows_` in one launch: a program owns its rows, so it
    redoes its own flagged rows after a barrier (its flags and maxima written first)."""
    _exp_rows_kernel(z_ptr, out_ptr, lab_ptr, inv_t_ptr, c_ptr, m_ptr, s_ptr, t_ptr, zy_ptr, redo_ptr,
                     rows, cols, stride_z, stride_out, exp_range, inv_t_scalar, BLOCK_M, BLOCK_N, PER_TOKEN_T,
                     False)
    tl.debug_barrier()
    _exp_rows_kernel(z_ptr, out_ptr, lab_ptr, inv_t_ptr, c_ptr, m_ptr, s_ptr, t_ptr, zy_ptr, redo_ptr,
                     rows, cols, stride_z, stride_out, exp_range, inv_t_scalar, BLOCK_M, BLOCK_N, PER_TOKEN_T,
                     True)
# fmt: on


def _launch(
    kernel: Any, cfg: KernelConfig, rows: int, args: tuple[Any, ...], inv_t: Any, **flags: Any
) -> None:
    """One launch over ``rows`` rows: ``inv_t`` a per-row fp32 tensor or a number."""
    per_token = isinstance(inv_t, torch.Tensor)
    grid = (triton.cdiv(rows, cfg.block_m),)
    kernel[grid](
        *args,
        1.0 if per_token else float(inv_t),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        PER_TOKEN_T=per_token,
        num_warps=cfg.num_warps,
        **flags,
    )


def chunk_stats_(
    z: torch.Tensor,
    labels_local: torch.Tensor,
    inv_t: torch.Tensor | float,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor],
    *,
    col0: int,
    cfg: KernelConfig,
) -> None:
    """Update, in place, the tile's rows' running ``state = (m, s, t, zy)`` (``[rows]``
    fp32 each; ``t`` None without entropy) with the tile ``z`` ``[rows, cols]`` (fp32,
    untempered) of vocabulary entries ``col0 + arange(cols)``::

        zt = z * inv_t[rows, None]
        m_new = maximum(m, zt.max(1))
        s = s * exp(m - m_new) + exp(zt - m_new).sum(1)
        t = exp(m - m_new) * (t + (m - m_new) * s_old) + (exp(zt - m_new) * (zt - m_new)).sum(1)
        zy += zt[i, labels_local[i] - col0]  (where that column is in the tile)
        m = m_new
    """
    m, s, t, zy = state
    rows, cols = z.shape
    inv_ptr = inv_t if isinstance(inv_t, torch.Tensor) else m
    args = (z, labels_local, inv_ptr, m, s, m if t is None else t, zy, rows, cols, col0, z.stride(0))
    _launch(_chunk_stats_kernel, cfg, rows, args, inv_t, WITH_ENTROPY=t is not None)


def logit_grad_(
    z: torch.Tensor,
    dtype: torch.dtype,
    labels_local: torch.Tensor,
    inv_t: torch.Tensor | float,
    big_m: torch.Tensor,
    coef: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
    *,
    col0: int,
    cfg: KernelConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of the tile's logits (its rows' ``[r]`` vectors), returned as a
    ``[rows, cols]`` tensor of ``dtype``: into ``out`` where given, else in place in
    ``z``'s memory (``z`` itself for fp32; for bf16/fp16 a view of the first half of
    each row's bytes, row stride ``2 * cols``, which cuBLAS reads as is). With ``coef =
    (a, b, g)``::

        zc = z * inv_t[:, None] - M[:, None]
        gz = (-exp(zc) * (a + b * zc) + g * [col0 + j == labels_local]) * inv_t
    """
    rows, cols = z.shape
    if out is None:
        out = z if dtype == torch.float32 else z.view(dtype).view(rows, 2 * cols)[:, :cols]
    a, b, g = coef
    inv_ptr = inv_t if isinstance(inv_t, torch.Tensor) else big_m
    b_ptr = a if b is None else b
    args = (z, out, labels_local, inv_ptr, big_m, a, b_ptr, g, rows, cols, col0, z.stride(0), out.stride(0))
    _launch(
        _logit_grad_kernel,
        cfg,
        rows,
        args,
        inv_t,
        WITH_B=b is not None,
        IN_PLACE=out.data_ptr() == z.data_ptr(),
    )
    return out


def exp_rows_(
    z: torch.Tensor,
    out: torch.Tensor,
    labels_local: torch.Tensor,
    inv_t: torch.Tensor | float,
    vectors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    cfg: KernelConfig,
) -> None:
    """Whole rows ``z [rows, V_local]`` (fp32, untempered): into ``out`` (``[rows,
    V_local]``, the compute dtype) and the rows' fp32 vectors ``c, m, s, t, zy`` (int8
    ``flags``)::

        zt = z * inv_t[:, None]
        c = maximum(zt[:, :BLOCK_N].max(1), zt[i, labels_local[i]])     # <= M
        out = where(col == labels_local, 0, exp(zt - c))
        m = zt.max(1);  s = exp(zt - c).sum(1);  t = (exp(zt - c) * (zt - c)).sum(1)
        zy = zt[i, labels_local[i]]  (0 where the label is in another shard)

    then, for the rows where ``m - c > EXP_RANGE`` (``exp(zt - c)`` could overflow),
    the same with ``c = m``, by the same program (one launch).
    """
    rows, cols = z.shape
    c, m, s, t, zy, flags = vectors
    inv_ptr = inv_t if isinstance(inv_t, torch.Tensor) else m
    args = (z, out, labels_local, inv_ptr, c, m, s, t, zy, flags, rows, cols, z.stride(0), out.stride(0))
    _launch(_exp_rows_both_kernel, cfg, rows, (*args, EXP_RANGE), inv_t)

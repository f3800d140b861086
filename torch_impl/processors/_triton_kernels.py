"""The Triton forms of the engine's memory-bound passes over one fp32 logits tile
``z [rows, cols]`` that cuBLAS has just formed: the statistics (:func:`chunk_stats_`),
the logit gradient (:func:`logit_grad_`) and the fused loss's single pass over whole
rows (:func:`exp_rows_`). A program owns ``BLOCK_M`` whole rows: no atomics, the same
bits run to run. Each kernel's docstring counts its SASS per element (sm_90, Triton
3.6, one row by 2048 columns a step, 4 warps), which ``docs/gpu-design.md`` ("What each
kernel issues per element") turns into predictions. Imported on first use, so that
``TRITON_INTERPRET`` is read when the kernels are made.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from ._geometry import EXP_RANGE, KernelConfig, interpreting

__all__ = ["chunk_stats_", "exp_rows_", "logit_grad_"]


LOG2E = tl.constexpr(1.4426950408889634)
"""``exp(x) == exp2(x * LOG2E)``: one MUFU ``ex2.approx.ftz.f32``; ``tl.exp`` adds a guard
for subnormal results, which no sum here needs (a term below ``2**-126`` of a sum >= 1)."""

_FLT_MAX = tl.constexpr(3.4028234663852886e38)


TANH_FROM_EXP = tl.constexpr(interpreting())
"""The interpreter has no libdevice: there :func:`_tanh` is formed from ``exp``. Read once,
when this module is imported."""

X_TINY = tl.constexpr(2.0**-12)
"""``|x| < X_TINY``: ``tanh(x) == x`` in fp32 (``x**3 / 3`` is below half an ulp of ``x``)."""


@triton.jit
def _tanh(x):
    """``tanh(x)`` to a few ulp relative over the whole range, -1 at -inf, NaN stays NaN:
    libdevice's ``tanhf`` compiled; under the interpreter ``sign(x) (1 - e) / (1 + e)`` of
    ``e = exp(-2 |x|)``, and for ``|x| < 1/8`` (where ``1 - e`` would cancel) the series
    ``x - x**3 / 3 + 2 x**5 / 15 - 17 x**7 / 315`` (relative error below ``62 x**8 / 2835``,
    2e-9)."""
    if TANH_FROM_EXP:
        a = tl.abs(x)
        e = tl.exp(-2.0 * a)
        far = (1.0 - e) / (1.0 + e)
        x2 = x * x
        near = x + x * x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0)))
        return tl.where(a < 0.125, near, tl.where(x < 0.0, -far, far))
    else:
        return libdevice.tanh(x)


@triton.jit
def _capped(u, k):
    """The softcap of raw ``u`` before the temperature, and its tanh: ``(c, th)`` with ``x =
    u k`` (``k = logit_scale / s``), ``th = tanh(x)``, ``c = where(|x| < X_TINY, u, th / k)``
    (``= s tanh(u logit_scale / s) / logit_scale``; ``u`` where ``tanh(x) == x``: no
    ``1 / k`` to overflow, no subnormal ``x`` to lose ``u``'s bits)."""
    x = u * k
    th = _tanh(x)
    return tl.where(tl.abs(x) < X_TINY, u, th / k), th


@triton.jit
def _temper(u, k, inv_t, SOFTCAP: tl.constexpr):
    """The logits of raw ``u``: ``u * inv_t``, or with a softcap ``c * inv_t`` of
    :func:`_capped`'s ``c`` (``k = logit_scale / s``)."""
    if SOFTCAP:
        c, _ = _capped(u, k)
        return c * inv_t
    else:
        return u * inv_t


@triton.jit
def _row_scales(inv_t_ptr, r, row_ok, inv_t_scalar, PER_TOKEN_T: tl.constexpr):
    """The rows' ``inv_t``: per row, or a scalar."""
    if PER_TOKEN_T:
        inv_t = tl.load(inv_t_ptr + r, mask=row_ok, other=1.0)
    else:
        inv_t = tl.full(r.shape, 1.0, tl.float32) * inv_t_scalar
    return inv_t


@triton.jit
def _summand(
    z,
    cap_k,
    cw_ptr,
    cw_cols,
    cw_ok,
    SOFTCAP: tl.constexpr,
    WEIGHTED: tl.constexpr,
    MASKED: tl.constexpr,
):
    """A block's term of the mean logit's sum before its factor ``inv_t``: ``z`` or its
    softcap (:func:`_capped`), times the column weights ``cw_ptr[cw_cols]`` (``WEIGHTED``;
    ``cw_ptr`` is None without them); 0 in a masked column (``MASKED``: ``cw_ok`` False)."""
    zs = z
    if SOFTCAP:
        zs, _ = _capped(z, cap_k)
    if WEIGHTED:
        cw_ptrs = cw_ptr + cw_cols
        zs = zs * (tl.load(cw_ptrs, mask=cw_ok, other=0.0) if MASKED else tl.load(cw_ptrs))[None, :]
    return tl.where(cw_ok[None, :], zs, 0.0) if MASKED else zs


SOFT_BF16 = tl.constexpr(interpreting())
"""The interpreter's fp32 -> bf16 conversion truncates (triton 3.6 and 3.7), so under it
bf16 is rounded on its bits: the same bits as compiled ``cvt.rn.bf16`` (nearest even)
for every finite value and infinity. Read once, when this module is imported."""


@triton.jit
def _store_rounded(ptrs, x, mask):
    """``x`` (fp32) stored in the pointers' dtype, rounded to nearest even."""
    if SOFT_BF16 and ptrs.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(ptrs, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


def _given(name: str) -> Any:
    """A ``triton.heuristics`` rule: the flag is set where the argument ``name`` is given
    (not None). A kernel's optional tensor is None where absent, never another tensor
    standing in for it, and the code that reads it sits under its flag."""
    return lambda arguments: arguments[name] is not None


_TEMPERATURE_RULES = {"PER_TOKEN_T": _given("inv_t_ptr"), "SOFTCAP": _given("cap_k")}
"""Every kernel's rules for the temperature (a per-row tensor, else the scalar) and the
softcap (its factor ``cap_k``, else None)."""


@triton.jit
def _stats_step(
    z,
    m,
    base,
    s_in,
    t_in,
    s_l,
    t_l,
    inv_t,
    WITH_ENTROPY: tl.constexpr,
    cap_k,
    SOFTCAP: tl.constexpr,
    ok,
):
    """One block ``z [BLOCK_M, BLOCK_N]`` (untempered; -inf where masked) folded into a
    row's running max ``m`` (tempered), the exponents' origin ``base``, the earlier
    tiles' ``(s_in, t_in)`` and the per-lane sums ``(s_l, t_l)``.

    Every exponent is taken against the running max (through ``base``, 0 while ``m`` is
    -inf), so the per-lane sums need a rescale only in a step whose block raises ``m``:
    after a row's first blocks a new maximum is rare, and the common step is one
    exponential an element with no rescale; the earlier tiles' ``(s_in, t_in)`` ride
    along in the same rescale."""
    # inv_t > 0 and rounding is monotone: max(fl(z * inv_t)) == fl(max(z) * inv_t)
    m_new = tl.maximum(m, _temper(tl.max(z, axis=1), cap_k, inv_t, SOFTCAP))  # the cap is monotone
    grow = m_new > m  # False for NaN: a NaN reaches the sums through its own term
    if tl.max(grow.to(tl.int32), axis=0) > 0:  # a record max: rare after a row's first steps
        base_new = tl.where(grow, m_new, base)
        had = m > float("-inf")
        a = tl.where(had, tl.exp2((base - base_new) * LOG2E), 0.0)
        d = tl.where(had, base - base_new, 0.0)
        if WITH_ENTROPY:
            t_l = a[:, None] * (t_l + d[:, None] * s_l)
            t_in = a * (t_in + d * s_in)
        s_l = a[:, None] * s_l
        s_in = a * s_in
        m = tl.where(grow, m_new, m)
        base = base_new
    if SOFTCAP:  # a masked lane (ok False) stays -inf, a logit of -inf is capped
        d = tl.where(ok, _temper(z, cap_k, inv_t[:, None], SOFTCAP), float("-inf")) - base[:, None]
    else:
        d = z * inv_t[:, None] - base[:, None]  # one FFMA: the product is not rounded
    e = tl.exp2(d * LOG2E)  # a masked or -inf lane: exp2(-inf) = 0
    s_l += e
    if WITH_ENTROPY:
        t_l += e * tl.maximum(d, -_FLT_MAX)  # 0, not 0 * -inf, for a -inf lane
    return m, base, s_in, t_in, s_l, t_l


@triton.heuristics(
    {
        **_TEMPERATURE_RULES,
        "WITH_ENTROPY": _given("t_ptr"),
        "WITH_SUM": _given("sz_ptr"),
        "WEIGHTED": _given("cw_ptr"),
    }
)
@triton.jit
def _chunk_stats_kernel(
    z_ptr,
    lab_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    zy_ptr,
    sz_ptr,
    cw_ptr,
    rows,
    cols,
    col0,
    stride_z,
    inv_t_ptr,
    inv_t_scalar,
    cap_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    WITH_SUM: tl.constexpr,
    WEIGHTED: tl.constexpr,
):
    """:func:`chunk_stats_`. Per element of a full block, 4 bytes read and 11.2 SASS (9.2
    without entropy): FMNMX (the block max), FFMA (``d``), FMUL + MUFU (``exp2``), FADD
    (``s_l``), FMNMX + FFMA (``t_l``); per block a cross-warp max and a branch.
    ``SOFTCAP``: the cap more (libdevice's ``tanhf``, a divide, a compare and a select);
    ``WITH_SUM``: a FADD."""
    # 1. the program's rows and their temperature
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < rows
    inv_t = _row_scales(inv_t_ptr, r, row_ok, inv_t_scalar, PER_TOKEN_T)
    # a row past the end reads the last row (no row mask on the loads) and stores nothing
    z_rows = z_ptr + tl.minimum(r, rows - 1).to(tl.int64)[:, None] * stride_z
    # 2. the label's logit, where the label's column is in this tile
    lab = tl.load(lab_ptr + r, mask=row_ok, other=-1) - col0
    here = row_ok & (lab >= 0) & (lab < cols)
    zy_new = tl.load(z_rows + tl.where(here, lab, 0)[:, None], mask=here[:, None], other=0.0)
    zy_new = _temper(tl.sum(zy_new, axis=1), cap_k, inv_t, SOFTCAP)
    # 3. the row's running max m and the earlier tiles' (s, t); base: 0 while m is -inf
    m = tl.load(m_ptr + r, mask=row_ok, other=float("-inf"))
    s_in = tl.load(s_ptr + r, mask=row_ok, other=0.0)
    t_in = (
        tl.load(t_ptr + r, mask=row_ok, other=0.0)
        if WITH_ENTROPY
        else tl.zeros((BLOCK_M,), tl.float32)
    )
    base = tl.where(m > float("-inf"), m, 0.0)
    s_l = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    t_l = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    u_l = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # WITH_SUM: the untempered logits' sum
    cc = tl.arange(0, BLOCK_N)
    # 4. the full blocks (loads without masks), each folded in by _stats_step
    full = cols - cols % BLOCK_N
    z_next = tl.load(z_rows + cc[None, :], mask=(cc < full)[None, :])
    for c0 in range(0, full, BLOCK_N):
        z = z_next
        # the next block's load is issued before this block's arithmetic: two in flight
        z_next = tl.load(z_rows + (c0 + BLOCK_N + cc)[None, :], mask=c0 + BLOCK_N < full)
        if WITH_SUM:
            cw_cols = col0 + c0 + cc
            u_l += _summand(z, cap_k, cw_ptr, cw_cols, None, SOFTCAP, WEIGHTED, False)
        m, base, s_in, t_in, s_l, t_l = _stats_step(
            z, m, base, s_in, t_in, s_l, t_l, inv_t, WITH_ENTROPY, cap_k, SOFTCAP, True
        )
    # 5. the last, partial block, masked (-inf past the end)
    if full < cols:
        c = full + cc
        z = tl.load(z_rows + c[None, :], mask=(c < cols)[None, :], other=float("-inf"))
        if WITH_SUM:
            u_l += _summand(z, cap_k, cw_ptr, col0 + c, c < cols, SOFTCAP, WEIGHTED, True)
        m, base, s_in, t_in, s_l, t_l = _stats_step(
            z,
            m,
            base,
            s_in,
            t_in,
            s_l,
            t_l,
            inv_t,
            WITH_ENTROPY,
            cap_k,
            SOFTCAP,
            (c < cols)[None, :],
        )
    # 6. the per-lane sums reduced and added to the rows' running values
    if WITH_SUM:  # the sum of the (capped) tempered logits
        sz = tl.load(sz_ptr + r, mask=row_ok, other=0.0)
        tl.store(sz_ptr + r, sz + tl.sum(u_l, axis=1) * inv_t, mask=row_ok)
    tl.store(m_ptr + r, m, mask=row_ok)
    tl.store(s_ptr + r, s_in + tl.sum(s_l, axis=1), mask=row_ok)
    if WITH_ENTROPY:
        tl.store(t_ptr + r, t_in + tl.sum(t_l, axis=1), mask=row_ok)
    zy = tl.load(zy_ptr + r, mask=row_ok, other=0.0)
    tl.store(zy_ptr + r, zy + zy_new, mask=row_ok)


@triton.heuristics(
    {
        **_TEMPERATURE_RULES,
        "WITH_B": _given("b_ptr"),
        "WITH_U": _given("u_ptr"),
        "WEIGHTED": _given("cw_ptr"),
    }
)
@triton.jit
def _logit_grad_kernel(
    z_ptr,
    out_ptr,
    lab_ptr,
    max_ptr,
    a_ptr,
    b_ptr,
    g_ptr,
    u_ptr,
    cw_ptr,
    rows,
    cols,
    col0,
    stride_z,
    stride_out,
    inv_t_ptr,
    inv_t_scalar,
    cap_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IN_PLACE: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WITH_B: tl.constexpr,
    WITH_U: tl.constexpr,
    WEIGHTED: tl.constexpr,
):
    """:func:`logit_grad_`. Per element, 4 bytes read, 2 (or 4) written and 14.2 SASS:
    FFMA (``zc``), FMUL + MUFU (``exp2``), FFMA + FMUL (``gz``), a compare and select
    (the label), the mask and the conversion. ``SOFTCAP``: ``tanh`` and its slope more."""
    # 1. the program's rows: their label's column, temperature, max and coefficients
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < rows
    lab = tl.load(lab_ptr + r, mask=row_ok, other=-1) - col0
    inv_t = _row_scales(inv_t_ptr, r, row_ok, inv_t_scalar, PER_TOKEN_T)
    big_m = tl.load(max_ptr + r, mask=row_ok, other=0.0)
    a = tl.load(a_ptr + r, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + r, mask=row_ok, other=0.0)
    if WITH_B:
        b = tl.load(b_ptr + r, mask=row_ok, other=0.0)
    if WITH_U:  # a uniform term of the row (d mean_logit / dz_j = 1 / V)
        u = tl.load(u_ptr + r, mask=row_ok, other=0.0)
    z_rows = z_ptr + r.to(tl.int64)[:, None] * stride_z
    out_rows = out_ptr + r.to(tl.int64)[:, None] * stride_out
    # 2. each block: its tempered (capped) logits against the row's max
    for c0 in range(0, cols, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)
        ok = row_ok[:, None] & (c < cols)[None, :]
        zr = tl.load(z_rows + c[None, :], mask=ok, other=0.0)
        if SOFTCAP:
            zr, th = _capped(zr, cap_k)
            zc = zr * inv_t[:, None] - big_m[:, None]
        else:
            zc = zr * inv_t[:, None] - big_m[:, None]
        if IN_PLACE:
            # every byte this step writes (a 2-byte output: the first half of the row's
            # fp32 bytes) was read by this step or an earlier one; the barrier holds
            # every warp's stores until all of this step's loads are done
            tl.debug_barrier()
        # 3. Coefficients' dz, in the GEMMs' form (times inv_t and the cap's slope), stored
        e = tl.exp2(zc * LOG2E)
        gz = -e * (a[:, None] + b[:, None] * zc) if WITH_B else -e * a[:, None]
        gz += tl.where(c[None, :] == lab[:, None], g[:, None], 0.0)
        if WITH_U:
            cw = tl.load(cw_ptr + col0 + c, mask=c < cols, other=0.0)[None, :] if WEIGHTED else 1.0
            gz += u[:, None] * cw
        gz = gz * inv_t[:, None]
        _store_rounded(out_rows + c[None, :], gz * (1.0 - th * th) if SOFTCAP else gz, ok)


@triton.jit
def _exp_step(z, ref, inv_t, m_l, s_l, t_l, out_ptrs, mask, cap_k, SOFTCAP: tl.constexpr):
    """One block ``z [BLOCK_M, BLOCK_N]`` (untempered; -inf where masked): ``exp(zt -
    ref)`` stored (times the softcap's slope ``1 - tanh**2``), the per-lane max
    (untempered) and sums updated."""
    if SOFTCAP:
        c, th = _capped(z, cap_k)
        zc = tl.where(mask, c, float("-inf")) * inv_t[:, None] - ref[:, None]  # masked: -inf
    else:
        zc = z * inv_t[:, None] - ref[:, None]  # one FFMA
    e = tl.exp2(zc * LOG2E)
    s_l += e
    t_l += e * tl.maximum(zc, -_FLT_MAX)  # 0, not 0 * -inf, for a -inf lane
    m_l = tl.maximum(m_l, z)
    _store_rounded(out_ptrs, e * (1.0 - th * th) if SOFTCAP else e, mask)
    return m_l, s_l, t_l


@triton.heuristics(_TEMPERATURE_RULES)
@triton.jit
def _exp_rows_kernel(
    z_ptr,
    out_ptr,
    lab_ptr,
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
    inv_t_ptr,
    inv_t_scalar,
    cap_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """:func:`exp_rows_`: a program redoes its own flagged rows after a barrier, their flags
    and maxima written first. Per element of a full block, 4 bytes read, 2 written and
    10.5 SASS: FFMA (``zc``), FMUL + MUFU (``exp2``), FADD (``s_l``), FMNMX + FFMA
    (``t_l``), FMNMX (``m_l``), half a packed bf16 conversion."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < rows
    for REDO in tl.static_range(2):  # constexpr 0, then 1
        if REDO:  # only the rows the first pass flagged, with c = their max
            tl.debug_barrier()
            row_ok = row_ok & (tl.load(redo_ptr + r, mask=row_ok, other=0) != 0)
        if tl.max(row_ok.to(tl.int32), axis=0) > 0:
            # 1. the rows' temperature and the label's logit
            inv_t = _row_scales(inv_t_ptr, r, row_ok, inv_t_scalar, PER_TOKEN_T)
            z_rows = z_ptr + tl.minimum(r, rows - 1).to(tl.int64)[:, None] * stride_z
            out_rows = out_ptr + r.to(tl.int64)[:, None] * stride_out
            lab = tl.load(lab_ptr + r, mask=row_ok, other=-1)
            here = row_ok & (lab >= 0) & (lab < cols)
            zy = tl.load(z_rows + tl.where(here, lab, 0)[:, None], mask=here[:, None], other=0.0)
            zy = _temper(tl.sum(zy, axis=1), cap_k, inv_t, SOFTCAP)
            # 2. the reference c: the first block's max and the label's logit (<= M), or M
            cc = tl.arange(0, BLOCK_N)
            if REDO:
                ref = tl.load(m_ptr + r, mask=row_ok, other=0.0)
            else:
                z0 = tl.load(z_rows + cc[None, :], mask=(cc < cols)[None, :], other=float("-inf"))
                ref = tl.maximum(
                    _temper(tl.max(z0, axis=1), cap_k, inv_t, SOFTCAP),
                    tl.where(here, zy, float("-inf")),
                )
            ref = tl.where(row_ok, ref, 0.0)
            m_l = tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32)
            s_l = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            t_l = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            # 3. every block: exp(zt - c) stored, the per-lane max and sums updated
            full = cols - cols % BLOCK_N  # rows and blocks loaded as in _chunk_stats_kernel
            z_next = tl.load(z_rows + cc[None, :], mask=(cc < full)[None, :])
            for c0 in range(0, full, BLOCK_N):
                z = z_next
                z_next = tl.load(z_rows + (c0 + BLOCK_N + cc)[None, :], mask=c0 + BLOCK_N < full)
                out = out_rows + (c0 + cc)[None, :]
                m_l, s_l, t_l = _exp_step(
                    z, ref, inv_t, m_l, s_l, t_l, out, row_ok[:, None], cap_k, SOFTCAP
                )
            if full < cols:
                c = full + cc
                ok = row_ok[:, None] & (c < cols)[None, :]
                z = tl.load(z_rows + c[None, :], mask=ok, other=float("-inf"))
                out = out_rows + c[None, :]
                m_l, s_l, t_l = _exp_step(z, ref, inv_t, m_l, s_l, t_l, out, ok, cap_k, SOFTCAP)
            # 4. the label's column is 0 in E: written above by whichever thread held it,
            # so overwritten once every thread's stores are ordered before this one
            tl.debug_barrier()
            zero = tl.zeros((BLOCK_M, 1), tl.float32)
            _store_rounded(out_rows + tl.where(here, lab, 0)[:, None], zero, here[:, None])
            # 5. the rows' vectors, and the flag of a row whose M - c could overflow exp
            tl.store(c_ptr + r, ref, mask=row_ok)
            # the cap is monotone: the capped max of the lanes' maxima is the row's max
            big_m = _temper(tl.max(m_l, axis=1), cap_k, inv_t, SOFTCAP)
            tl.store(m_ptr + r, big_m, mask=row_ok)
            tl.store(s_ptr + r, tl.sum(s_l, axis=1), mask=row_ok)
            tl.store(t_ptr + r, tl.sum(t_l, axis=1), mask=row_ok)
            tl.store(zy_ptr + r, zy, mask=row_ok)
            if not REDO:
                tl.store(redo_ptr + r, (big_m - ref > exp_range).to(tl.int8), mask=row_ok)


def _launch(kernel: Any, cfg: KernelConfig, /, **arguments: Any) -> None:
    """One launch over the kernel's ``rows``, ``cfg.block_m`` a program, every argument by
    name (the launch shape's constexprs added here; the flags of the optional tensors are
    the kernel's ``triton.heuristics``)."""
    grid = (triton.cdiv(arguments["rows"], cfg.block_m),)
    kernel[grid](**arguments, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)


def _temperature(inv_t: torch.Tensor | float, cap_k: float | None) -> dict[str, Any]:
    """Every kernel's temperature and softcap arguments: ``inv_t_ptr``, the per-row fp32
    tensor (None for a number), ``inv_t_scalar``, the number (None for a tensor), and
    ``cap_k = logit_scale / softcap`` (None: no softcap)."""
    per_row = isinstance(inv_t, torch.Tensor)
    return {
        "inv_t_ptr": inv_t if per_row else None,
        "inv_t_scalar": None if per_row else float(inv_t),
        "cap_k": None if cap_k is None else float(cap_k),
    }


def chunk_stats_(
    z: torch.Tensor,
    labels_local: torch.Tensor,
    inv_t: torch.Tensor | float,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor],
    *,
    col0: int,
    cfg: KernelConfig,
    cap_k: float | None = None,
    sz: torch.Tensor | None = None,
    cw: torch.Tensor | None = None,
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
        sz += zt.sum(1)                          # where sz is given (zt @ cw[col0:] with cw)

    ``inv_t > 0``. Bytes: ``4 rows cols`` read, ``O(rows)`` else. ``cap_k``: a softcap,
    ``zt = c * inv_t`` of ``c = where(|x| < 2**-12, z, tanh(x) / cap_k)``, ``x = z cap_k``
    (:mod:`._tiles`)."""
    m, s, t, zy = state
    rows, cols = z.shape
    _launch(
        _chunk_stats_kernel,
        cfg,
        z_ptr=z,
        lab_ptr=labels_local,
        m_ptr=m,
        s_ptr=s,
        t_ptr=t,
        zy_ptr=zy,
        sz_ptr=sz,
        cw_ptr=cw,
        rows=rows,
        cols=cols,
        col0=col0,
        stride_z=z.stride(0),
        **_temperature(inv_t, cap_k),
    )


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
    cap_k: float | None = None,
    u: torch.Tensor | None = None,
    cw: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of the tile's logits (its rows' ``[r]`` vectors), returned as a
    ``[rows, cols]`` tensor of ``dtype``: into ``out`` where given, else in place in
    ``z``'s memory (``z`` itself for fp32; for bf16/fp16 a view of the first half of
    each row's bytes, row stride ``2 * cols``, which cuBLAS reads as is). With ``coef =
    (a, b, g)``::

        zc = z * inv_t[:, None] - M[:, None]
        gz = (-exp(zc) * (a + b * zc) + g * [col0 + j == labels_local] + u * cw[col0 + j]) * inv_t
        # u: [r] or 0; cw: the shard's column weights, or 1

    Bytes: ``4 rows cols`` read, ``dtype.itemsize * rows * cols`` written. ``cap_k``: a
    softcap (``zc`` of the capped logits, ``gz`` times ``1 - tanh(z cap_k)**2``)."""
    rows, cols = z.shape
    if out is None:
        out = z if dtype == torch.float32 else z.view(dtype).view(rows, 2 * cols)[:, :cols]
    a, b, g = coef
    _launch(
        _logit_grad_kernel,
        cfg,
        z_ptr=z,
        out_ptr=out,
        lab_ptr=labels_local,
        max_ptr=big_m,
        a_ptr=a,
        b_ptr=b,
        g_ptr=g,
        u_ptr=u,
        cw_ptr=cw,
        rows=rows,
        cols=cols,
        col0=col0,
        stride_z=z.stride(0),
        stride_out=out.stride(0),
        IN_PLACE=out.data_ptr() == z.data_ptr(),
        **_temperature(inv_t, cap_k),
    )
    return out


def exp_rows_(
    z: torch.Tensor,
    out: torch.Tensor,
    labels_local: torch.Tensor,
    inv_t: torch.Tensor | float,
    vectors: tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
    ],
    *,
    cfg: KernelConfig,
    cap_k: float | None = None,
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
    Bytes: ``4 rows V_local`` read (and the first block of each row again, from cache, where
    the second pass runs), ``out.itemsize * rows * V_local`` written; ``inv_t > 0``.
    ``cap_k``: a softcap (``zt`` capped, ``out`` times ``1 - tanh(z cap_k)**2``)."""
    c, m, s, t, zy, flags = vectors
    rows, cols = z.shape
    _launch(
        _exp_rows_kernel,
        cfg,
        z_ptr=z,
        out_ptr=out,
        lab_ptr=labels_local,
        c_ptr=c,
        m_ptr=m,
        s_ptr=s,
        t_ptr=t,
        zy_ptr=zy,
        redo_ptr=flags,
        rows=rows,
        cols=cols,
        stride_z=z.stride(0),
        stride_out=out.stride(0),
        exp_range=EXP_RANGE,
        **_temperature(inv_t, cap_k),
    )

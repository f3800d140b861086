"""Triton kernels of :func:`~torch_impl.processors.linear_logprobs` on CUDA.

Two kernels, both over tiles of ``BLOCK_M`` tokens by ``BLOCK_N`` vocabulary entries
whose logits are formed in registers (``tl.dot`` with fp32 accumulation over
``BLOCK_K`` slices of the hidden size) and never stored:

- :func:`shard_stats`: per token, the online-logsumexp statistics of this vocab
  shard (running max ``m``, rescaled sum of exponentials ``s``, the entropy term
  ``t`` and the selected logit ``zy``). A program walks one split of the shard's
  vocabulary; the splits are merged in torch (a few ``[splits, n]`` vectors), then
  the shards through the contract's ``Collectives`` exactly as on the torch path.
- :func:`logit_grads`: the gradient of the tempered logits of one vocabulary chunk,
  ``dz = (-exp(z - M) * (a + b * (z - M)) + g * [j == y]) / T``, written in the
  compute dtype into a ``[rows, chunk]`` workspace; ``dh`` and ``dW`` are then two
  cuBLAS GEMMs on it (fp32 accumulation, no atomics: deterministic run to run).

Import this module only where Triton is wanted: ``triton.jit`` decides at import
whether the kernels run compiled or under ``TRITON_INTERPRET=1`` (numpy, no GPU).
Under the interpreter ``tl.dot`` on bf16/fp16 operands is wrong (triton 3.7), so
the callers pass ``dot_fp32=True`` there and the operands are upcast in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._setup import KernelConfig

__all__ = ["logit_grads", "shard_stats"]


@triton.jit
def _logits_tile(
    h_ptr,
    w_ptr,
    rows,
    cols,
    row_ok,
    col_ok,
    hidden,
    stride_hn,
    stride_hk,
    stride_wv,
    stride_wk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``h[rows] @ w[cols].T`` as a ``[BLOCK_M, BLOCK_N]`` fp32 block (int64 offsets:
    ``V * h`` passes 2**31 for large vocabularies)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_hn
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wv
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(
            h_rows + ks[None, :] * stride_hk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            w_cols + ks[:, None] * stride_wk,
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _shard_stats_kernel(
    h_ptr,
    w_ptr,
    lab_ptr,
    inv_t_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    zy_ptr,
    n,
    vocab,
    hidden,
    cols_per_split,
    inv_t_scalar,
    stride_hn,
    stride_hk,
    stride_wv,
    stride_wk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    lab = tl.load(lab_ptr + rows, mask=row_ok, other=-1)
    if PER_TOKEN_T:
        inv_t = tl.load(inv_t_ptr + rows, mask=row_ok, other=1.0)
    else:
        inv_t = tl.full((BLOCK_M,), 1.0, tl.float32) * inv_t_scalar
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    t = tl.zeros((BLOCK_M,), tl.float32)
    zy = tl.zeros((BLOCK_M,), tl.float32)
    v_begin = split * cols_per_split
    v_end = tl.minimum(v_begin + cols_per_split, vocab)
    for v0 in range(v_begin, v_end, BLOCK_N):
        cols = v0 + tl.arange(0, BLOCK_N)
        col_ok = cols < v_end
        z = _logits_tile(
            h_ptr,
            w_ptr,
            rows,
            cols,
            row_ok,
            col_ok,
            hidden,
            stride_hn,
            stride_hk,
            stride_wv,
            stride_wk,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            DOT_FP32,
            PRECISION,
        )
        z = z * inv_t[:, None]
        zy += tl.sum(tl.where((cols[None, :] == lab[:, None]) & col_ok[None, :], z, 0.0), axis=1)
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
    out = split * n + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(zy_ptr + out, zy, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(t_ptr + out, t, mask=row_ok)


@triton.jit
def _logit_grads_kernel(
    h_ptr,
    w_ptr,
    lab_ptr,
    inv_t_ptr,
    max_ptr,
    a_ptr,
    b_ptr,
    g_ptr,
    gz_ptr,
    n,
    vocab,
    hidden,
    label_offset,
    inv_t_scalar,
    stride_hn,
    stride_hk,
    stride_wv,
    stride_wk,
    stride_gn,
    stride_gv,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    WITH_B: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    col_ok = cols < vocab
    z = _logits_tile(
        h_ptr,
        w_ptr,
        rows,
        cols,
        row_ok,
        col_ok,
        hidden,
        stride_hn,
        stride_hk,
        stride_wv,
        stride_wk,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        DOT_FP32,
        PRECISION,
    )
    if PER_TOKEN_T:
        inv_t = tl.load(inv_t_ptr + rows, mask=row_ok, other=1.0)
    else:
        inv_t = tl.full((BLOCK_M,), 1.0, tl.float32) * inv_t_scalar
    big_m = tl.load(max_ptr + rows, mask=row_ok, other=0.0)
    a = tl.load(a_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
    lab = tl.load(lab_ptr + rows, mask=row_ok, other=-1)
    zc = z * inv_t[:, None] - big_m[:, None]
    e = tl.exp(zc)
    if WITH_B:
        b = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
        gz = -e * (a[:, None] + b[:, None] * zc)
    else:
        gz = -e * a[:, None]
    gz += tl.where(cols[None, :] + label_offset == lab[:, None], g[:, None], 0.0)
    gz = gz * inv_t[:, None]
    tl.store(
        gz_ptr + rows.to(tl.int64)[:, None] * stride_gn + cols[None, :] * stride_gv,
        gz.to(gz_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _precision(cfg: KernelConfig) -> str:
    return "tf32" if cfg.tf32 else "ieee"


def shard_stats(
    h: torch.Tensor,
    w: torch.Tensor,
    labels_local: torch.Tensor,
    inv_t: torch.Tensor | float,
    *,
    splits: int,
    with_entropy: bool,
    cfg: KernelConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """This shard's statistics, each ``[n]`` fp32, as ``local_stats`` of the torch path::

        z = (h @ w.T) * inv_t                  # [n, V_local], never stored
        m = z.max(1);  s = exp(z - m).sum(1);  t = (exp(z - m) * (z - m)).sum(1)
        zy = z[i, labels_local[i]]  (0 where labels_local[i] < 0)

    computed by ``splits`` programs per block of tokens, each over a contiguous run
    of the vocabulary, then merged here.
    """
    n, hidden = h.shape
    vocab = w.shape[0]
    per_split = triton.cdiv(triton.cdiv(vocab, splits), cfg.block_n) * cfg.block_n
    splits = triton.cdiv(vocab, per_split)  # no split is empty
    dev = h.device
    m = torch.empty((splits, n), dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    zy = torch.empty_like(m)
    t = torch.empty_like(m) if with_entropy else m
    per_token = isinstance(inv_t, torch.Tensor)
    inv_t_arg = inv_t if isinstance(inv_t, torch.Tensor) else m
    grid = (triton.cdiv(n, cfg.block_m), splits)
    _shard_stats_kernel[grid](
        h,
        w,
        labels_local,
        inv_t_arg,
        m,
        s,
        t,
        zy,
        n,
        vocab,
        hidden,
        per_split,
        1.0 if per_token else float(inv_t),
        h.stride(0),
        h.stride(1),
        w.stride(0),
        w.stride(1),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PER_TOKEN_T=per_token,
        WITH_ENTROPY=with_entropy,
        DOT_FP32=cfg.dot_fp32,
        PRECISION=_precision(cfg),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if splits == 1:
        return m[0], s[0], (t[0] if with_entropy else None), zy[0]
    big_m = m.amax(0)
    alpha = torch.exp(m - big_m)
    s_all = (s * alpha).sum(0)
    t_all = (alpha * (t + (m - big_m) * s)).sum(0) if with_entropy else None
    return big_m, s_all, t_all, zy.sum(0)


def logit_grads(
    h: torch.Tensor,
    w: torch.Tensor,
    labels_local: torch.Tensor,
    inv_t: torch.Tensor | float,
    big_m: torch.Tensor,
    coef: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
    out: torch.Tensor,
    *,
    label_offset: int,
    cfg: KernelConfig,
) -> torch.Tensor:
    """Into ``out`` ``[n, V_chunk]`` (the compute dtype): the gradient of the
    tempered-then-untempered logits of the chunk ``w`` (rows ``label_offset`` on of
    the shard), with ``coef = (a, b, g)`` of ``logit_grad_coefficients``::

        zc = (h @ w.T) * inv_t - M[:, None]
        out = (-exp(zc) * (a + b * zc) + g * [j + label_offset == y]) * inv_t
    """
    n, hidden = h.shape
    vocab = w.shape[0]
    a, b, g = coef
    per_token = isinstance(inv_t, torch.Tensor)
    inv_t_arg = inv_t if isinstance(inv_t, torch.Tensor) else big_m
    grid = (triton.cdiv(n, cfg.block_m), triton.cdiv(vocab, cfg.block_n))
    _logit_grads_kernel[grid](
        h,
        w,
        labels_local,
        inv_t_arg,
        big_m,
        a,
        b if b is not None else a,
        g,
        out,
        n,
        vocab,
        hidden,
        label_offset,
        1.0 if per_token else float(inv_t),
        h.stride(0),
        h.stride(1),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PER_TOKEN_T=per_token,
        WITH_B=b is not None,
        DOT_FP32=cfg.dot_fp32,
        PRECISION=_precision(cfg),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out

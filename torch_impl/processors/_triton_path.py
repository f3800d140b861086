"""The Triton backend of ``linear_logprobs`` and ``fused_token_loss``: every GEMM is a
``torch.mm`` (cuBLAS on a GPU), and Triton does only the memory-bound work on each
fp32 logits chunk (:mod:`._triton_kernels`, imported on first use, so that
``TRITON_INTERPRET`` is read when the kernels are made).

The logits chunk ``z [rows, cols]`` is fp32. bf16/fp16 operands are multiplied with
``torch.mm(h, w.T, out_dtype=torch.float32, out=z)`` where torch offers it (CUDA,
recent torch: fp32 accumulation, one fp32 result), else upcast first (the same
numbers: bf16 products are exact in fp32). Chunks hold about 1 GiB of logits on a
GPU (``LOGITS_CHUNK_BYTES``), every row at once while that leaves at least 1024
vocabulary entries a chunk.

Forward, per chunk (two memory passes in all: the GEMM's write, the kernel's read)::

    z = h[rows] @ w[cols].T                          # cuBLAS, fp32 out
    chunk_stats_(z, ...)                             # running m, s, t, zy of each row

Backward, per chunk (three GEMMs, no recomputed statistics)::

    z = h[rows] @ w[cols].T                          # cuBLAS, fp32 out
    gz = logit_grad_(z, ...)                         # in place, compute dtype
    dh[rows] (+)= gz @ w[cols]                       # fp32 accumulator, first chunk writes
    dw[cols] (+)= gz.T @ h[rows]                     # one GEMM over all rows where they fit

No atomics: the results are the same bit for bit run to run.
"""

from __future__ import annotations

import torch

from ._setup import KernelConfig, TileSetup
from ._tiles import Stats, combine, gemm_into, mm_into, unfold_dh_

__all__ = ["chunk_grad", "chunk_logits", "local_chunk_stats", "triton_backward", "triton_forward_stats"]


def _config(setup: TileSetup) -> KernelConfig:
    assert setup.kernel is not None, "a Triton setup carries its kernel config"
    return setup.kernel


def _per_token(setup: TileSetup) -> torch.Tensor | float:
    return setup.inv_t if isinstance(setup.inv_t, torch.Tensor) else float(setup.inv_t)


def chunk_logits(buf: torch.Tensor, hs: torch.Tensor, wc: torch.Tensor) -> torch.Tensor:
    """``hs @ wc.T`` into the front of ``buf`` (fp32), as ``[rows, cols]``."""
    z = buf[: hs.shape[0] * wc.shape[0]].view(hs.shape[0], wc.shape[0])
    return mm_into(z, hs, wc.T)


def local_chunk_stats(
    z: torch.Tensor,
    setup: TileSetup,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor],
    *,
    row0: int,
    col0: int,
) -> None:
    """Fold the chunk ``z`` (tokens ``row0 + arange(rows)``, shard columns ``col0 +
    arange(cols)``) into the running ``(m, s, t, zy)``."""
    from ._triton_kernels import chunk_stats_  # on first use: TRITON_INTERPRET is read then

    m, s, t, zy = state
    chunk_stats_(
        z, setup.labels_local, _per_token(setup), m, s, t, zy, row0=row0, col0=col0, cfg=_config(setup)
    )


def chunk_grad(
    z: torch.Tensor,
    setup: TileSetup,
    big_m: torch.Tensor,
    coef: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
    *,
    row0: int,
    col0: int,
) -> torch.Tensor:
    """The logit gradient of the chunk, in place in ``z``, in the compute dtype
    (``coef`` and ``big_m``: fp32, ``[n]``)."""
    from ._triton_kernels import logit_grad_  # on first use, as above

    return logit_grad_(
        z,
        setup.compute_dtype,
        setup.labels_local,
        _per_token(setup),
        big_m,
        coef,
        row0=row0,
        col0=col0,
        cfg=_config(setup),
    )


def _empty_state(n: int, setup: TileSetup, device: torch.device) -> tuple[torch.Tensor, ...]:
    m = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
    s = torch.zeros(n, dtype=torch.float32, device=device)
    zy = torch.zeros(n, dtype=torch.float32, device=device)
    t = torch.zeros(n, dtype=torch.float32, device=device) if setup.with_entropy else None
    return m, s, t, zy  # type: ignore[return-value]


def triton_forward_stats(hs: torch.Tensor, w: torch.Tensor, setup: TileSetup) -> Stats:
    """:func:`._tiles.forward_stats` with cuBLAS chunks and the Triton statistics kernel."""
    n, vocab = hs.shape[0], w.shape[0]
    m, s, t, zy = _empty_state(n, setup, hs.device)
    if n and vocab:
        rows, cols = setup.token_chunk, setup.vocab_chunk
        buf = torch.empty(rows * cols, dtype=torch.float32, device=hs.device)
        wc_all = w.detach().to(setup.compute_dtype)
        for j0 in range(0, vocab, cols):
            wc = wc_all[j0 : j0 + cols]
            for i0 in range(0, n, rows):
                z = chunk_logits(buf, hs[i0 : i0 + rows], wc)
                local_chunk_stats(z, setup, (m, s, t, zy), row0=i0, col0=j0)
    return combine(m, s, t, zy, setup)


def triton_backward(
    hs: torch.Tensor,
    w: torch.Tensor,
    setup: TileSetup,
    stats: Stats,
    coef: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
    *,
    need_dh: bool,
    need_dw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dh, dw)`` as :func:`._tiles.backward_tiles`: ``dh`` in fp32, ``dw`` in ``w``'s
    dtype. Where one chunk holds every row and ``w`` is in the compute dtype, each
    ``dw`` chunk is one GEMM written straight into ``dw`` (cuBLAS accumulates in fp32
    and rounds once); otherwise an fp32 accumulator takes the row chunks' products."""
    n, vocab = hs.shape[0], w.shape[0]
    acc = setup.acc_dtype
    if n == 0 or vocab == 0:
        dh0 = torch.zeros(hs.shape, dtype=acc, device=hs.device) if need_dh else None
        return dh0, (torch.zeros_like(w) if need_dw else None)
    rows, cols = setup.token_chunk, setup.vocab_chunk
    direct = rows >= n and w.dtype == setup.compute_dtype
    dh = torch.empty(hs.shape, dtype=acc, device=hs.device) if need_dh else None
    dw = None
    if need_dw:
        dw = torch.empty(w.shape, dtype=w.dtype if direct else acc, device=w.device)
    a, b, g = (c.to(torch.float32).contiguous() if c is not None else None for c in coef)
    assert a is not None and g is not None
    big_m = stats.max.to(torch.float32).contiguous()
    buf = torch.empty(rows * cols, dtype=torch.float32, device=hs.device)
    wc_all = w.detach().to(setup.compute_dtype)
    for j0 in range(0, vocab, cols):
        wc = wc_all[j0 : j0 + cols]
        for i0 in range(0, n, rows):
            h_rows = hs[i0 : i0 + rows]
            z = chunk_logits(buf, h_rows, wc)
            gz = chunk_grad(z, setup, big_m, (a, b, g), row0=i0, col0=j0)
            if dh is not None:
                gemm_into(dh[i0 : i0 + rows], gz, wc, first=j0 == 0)
            if dw is not None:
                if direct:
                    torch.mm(gz.T, h_rows, out=dw[j0 : j0 + cols])
                else:
                    gemm_into(dw[j0 : j0 + cols], gz.T, h_rows, first=i0 == 0)
    if dw is not None and dw.dtype != w.dtype:
        dw = dw.to(w.dtype)
    return (unfold_dh_(dh, setup) if dh is not None else None), dw

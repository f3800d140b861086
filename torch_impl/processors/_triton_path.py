"""The Triton path of ``linear_logprobs`` and ``fused_token_loss``: the same
statistics and gradients as the torch tiles (:mod:`._tiles`), with the logits
formed in registers by the kernels of :mod:`._triton_kernels` (imported on first
use, so that ``TRITON_INTERPRET`` is read when the kernels are made).

Forward: one kernel launch for the whole shard (token blocks by vocabulary
splits); the splits are merged here, the shards by :func:`._tiles.combine`.
Backward: per vocabulary chunk (and token chunk, past the workspace), a kernel
writes the chunk's logit gradient into a workspace in the compute dtype, then::

    dh[rows] += gz @ w[chunk]            # fp32 accumulator [n, h]
    dw[chunk] (+)= gz.T @ h[rows]        # cuBLAS, fp32 accumulation inside

No atomics: the results are the same bit for bit run to run.
"""

from __future__ import annotations

import math

import torch

from ._setup import TRITON_WORKSPACE_BYTES, KernelConfig, Plan
from ._tiles import Stats, combine, mm_into, unfold_dh_

__all__ = ["triton_backward", "triton_forward_stats"]


def _config(plan: Plan) -> KernelConfig:
    assert plan.kernel is not None, "a Triton plan carries its kernel config"
    return plan.kernel


def _splits(cfg: KernelConfig, n: int, vocab: int, device: torch.device) -> int:
    """Vocabulary splits per token block: about two waves of programs on the device."""
    blocks_n = max(1, math.ceil(vocab / cfg.block_n))
    if cfg.splits:
        return min(cfg.splits, blocks_n)
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    blocks_m = max(1, math.ceil(n / cfg.block_m))
    return max(1, min(blocks_n, math.ceil(programs / blocks_m)))


def triton_forward_stats(hs: torch.Tensor, w: torch.Tensor, plan: Plan) -> Stats:
    """:func:`._tiles.forward_stats` with the shard statistics from the Triton kernel."""
    cfg = _config(plan)
    n, vocab = hs.shape[0], w.shape[0]
    if n == 0:
        empty = torch.zeros(0, dtype=torch.float32, device=hs.device)
        return combine(empty, empty, empty if plan.with_entropy else None, empty, plan)
    from ._triton_kernels import shard_stats  # on first use: TRITON_INTERPRET is read then

    wc = w.detach().to(plan.compute_dtype)
    m, s, t, zy = shard_stats(
        hs,
        wc,
        plan.labels_local,
        plan.inv_t,
        splits=_splits(cfg, n, vocab, hs.device),
        with_entropy=plan.with_entropy,
        cfg=cfg,
    )
    return combine(m, s, t, zy, plan)


def _chunks(n: int, vocab: int, itemsize: int, cfg: KernelConfig) -> tuple[int, int]:
    """``(rows, cols)`` of the workspace: every row if a chunk of at least one block of
    columns fits, the columns a multiple of the block."""
    budget = max(1, TRITON_WORKSPACE_BYTES // itemsize)
    rows = max(1, min(n, budget // cfg.block_n))
    cols = max(cfg.block_n, (budget // rows) // cfg.block_n * cfg.block_n)
    return rows, min(cols, max(vocab, 1))


def triton_backward(
    hs: torch.Tensor,
    w: torch.Tensor,
    plan: Plan,
    stats: Stats,
    coef: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
    *,
    need_dh: bool,
    need_dw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dh, dw)`` as :func:`._tiles.backward_tiles`: ``dh`` in the accumulation
    dtype, ``dw`` in ``w``'s dtype."""
    from ._triton_kernels import logit_grads  # on first use, as above

    cfg = _config(plan)
    n, vocab = hs.shape[0], w.shape[0]
    acc = plan.acc_dtype
    dh = torch.zeros(hs.shape, dtype=acc, device=hs.device) if need_dh else None
    dw = torch.zeros(w.shape, dtype=w.dtype, device=w.device) if need_dw else None
    if n == 0 or vocab == 0:
        return dh, dw
    a, b, g = (c.to(torch.float32).contiguous() if c is not None else None for c in coef)
    assert a is not None and g is not None
    big_m = stats.max.to(torch.float32).contiguous()
    wc_all = w.detach().to(plan.compute_dtype)
    rows, cols = _chunks(n, vocab, wc_all.element_size(), cfg)
    work = torch.empty(rows * cols, dtype=plan.compute_dtype, device=hs.device)
    whole_rows = rows >= n
    for j0 in range(0, vocab, cols):
        j1 = min(j0 + cols, vocab)
        wc = wc_all[j0:j1]
        direct = dw is not None and whole_rows and dw.dtype == plan.compute_dtype
        dwc = None if dw is None or direct else torch.zeros(wc.shape, dtype=acc, device=w.device)
        for i0 in range(0, n, rows):
            i1 = min(i0 + rows, n)
            gz = work[: (i1 - i0) * (j1 - j0)].view(i1 - i0, j1 - j0)
            inv_t = plan.inv_t[i0:i1] if isinstance(plan.inv_t, torch.Tensor) else plan.inv_t
            logit_grads(
                hs[i0:i1],
                wc,
                plan.labels_local[i0:i1],
                inv_t,
                big_m[i0:i1],
                (a[i0:i1], None if b is None else b[i0:i1], g[i0:i1]),
                gz,
                label_offset=j0,
                cfg=cfg,
            )
            if dh is not None:
                mm_into(dh[i0:i1], gz, wc)
            if direct:
                assert dw is not None
                torch.mm(gz.T, hs[i0:i1], out=dw[j0:j1])
            elif dwc is not None:
                mm_into(dwc, gz.T, hs[i0:i1])
        if dw is not None and dwc is not None:
            dw[j0:j1].copy_(dwc)
    return (unfold_dh_(dh, plan) if dh is not None else None), dw

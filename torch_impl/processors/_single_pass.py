"""The fused loss's single pass (:func:`single_pass`): the engine's row sweep reading
each tile once, where the loss has no gradient through the entropy. Each whole-row
tile's ``E = exp(z - c)`` goes unscaled into the gradient buffer and its rows' local
statistics into ``[5, n]`` vectors; once a buffer, the statistics are combined over
the shards, the caller's coefficients taken, and the buffer scaled as it is
multiplied out (:class:`~._sink.RowScale`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._engine import Coefficients, Engine, Stats, combine
from ._sink import GradSink, RowScale

__all__ = ["exp_rows", "row_scale", "single_pass"]


def exp_rows(
    eng: Engine, z: torch.Tensor, rows: slice, out: torch.Tensor, vec: torch.Tensor
) -> None:
    """The pass over a whole-row tile: ``out`` gets ``E = exp(z - c)`` (0 at the label's
    column), and ``vec`` (``[5, r]``, acc dtype: a view of the call's ``[5, n]``) the
    rows' local ``c, m, s, t, zy``, combined later over a whole buffer by
    :func:`single_pass`. One launch on the Triton backend (``c <= M``, see
    ``EXP_RANGE``); the torch form takes ``c = m``::

        m = max_j z_j;  s = sum_j exp(z_j - c);  t = sum_j exp(z_j - c) (z_j - c)
        zy = z_y (local; any value where the label is in another shard)
    """
    setup = eng.setup
    c, m, s, t, zy = vec.unbind(0)
    if eng.triton:
        from ._triton_kernels import exp_rows_  # on first use: TRITON_INTERPRET is read then

        assert setup.kernel is not None
        flags = eng.buffer("flags", 1, rows.stop - rows.start, torch.int8)[0]
        inv_t = setup.row_inv_t(rows, column=False)
        vectors = (c, m, s, t, zy, flags)
        exp_rows_(
            z, out, setup.labels_local[rows], inv_t, vectors, cfg=setup.kernel, cap_k=setup.cap_k
        )
        return
    _, col, keep = eng.label_columns(rows)
    torch.gather(z, 1, col, out=zy[:, None])
    torch.amax(z, 1, out=c)
    m.copy_(c)
    z.sub_(c[:, None])
    e = torch.exp(z, out=out if out.dtype == z.dtype else eng.like("e", z))
    torch.sum(e, 1, out=s)
    torch.bmm(e.unsqueeze(1), z.unsqueeze(2), out=t.view(-1, 1, 1))
    eng.cap_slope_(e)  # E * (1 - tanh**2): the softcap's slope rides in the buffer
    if e is not out:
        out.copy_(e)
    out.scatter_reduce_(1, col, keep, "prod")


def row_scale(
    eng: Engine, vec: torch.Tensor, rows: slice, stats: Stats, coef: Coefficients
) -> RowScale:
    """The :class:`RowScale` of the rows ``rows`` of :func:`exp_rows`' vectors from
    their :class:`Stats` and coefficients (``b`` None), times the temperature factor
    the sink's GEMMs need (1 where it is folded into the hidden rows; ``E`` holds a
    softcap's slope ``1 - tanh**2``, the label's column gets it here)::

        dz = -a exp(z - M) + g [j == y]
           = (-a exp(c - M)) * E  +  (g - a exp(zy - M)) at the label's column
    """
    # a uniform term is no scale of E: the fused loss takes the two-pass sweep
    assert coef.u is None
    c, zy = vec[0, rows], vec[4, rows]
    factor = 1.0 if eng.setup.fold else eng.setup.row_inv_t(rows, column=False)
    scale = -coef.a * torch.exp(c - stats.max) * factor
    label = (coef.g - coef.a * torch.exp(zy - stats.max)) * factor * eng.cap_slope_of(zy, rows)
    return RowScale(scale=scale, label=label)


def single_pass(
    eng: Engine,
    on_stats: Callable[[Stats, slice], Coefficients | None],
    *,
    need_dh: bool,
    need_dw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The row sweep with :func:`exp_rows` a tile: ``on_stats(stats, rows)`` gets the
    exact :class:`Stats` of each gradient buffer's rows (entropy included) and returns
    their coefficients (``b`` None; None: no gradient), by which the buffer is scaled.
    Returns ``(dh, dW)`` as :meth:`~._engine.Engine.row_sweep`."""
    vec = torch.empty((5, eng.n), dtype=eng.setup.acc_dtype, device=eng.hs.device)

    def epilogue(z: torch.Tensor, rows: slice, sink: GradSink) -> None:
        height, width = z.shape
        dtype = eng.setup.compute_dtype
        out = sink.tile(rows) if sink.active else eng.buffer("E", height, width, dtype)
        exp_rows(eng, z, rows, out, vec[:, rows])
        sink.commit(rows)

    def on_flush(rows: slice) -> RowScale | None:  # a buffer's rows of the vectors, combined
        c, m, s, t, zy = vec[:, rows]
        rescale = torch.exp(c - m)  # relative to the local max, as combine() takes them
        stats = combine(m, s * rescale, rescale * (t + (c - m) * s), zy, eng.setup, rows)
        coef = on_stats(stats, rows)
        return None if coef is None else row_scale(eng, vec, rows, stats, coef)

    return eng.row_sweep(epilogue, need_dh=need_dh, need_dw=need_dw, on_flush=on_flush)

"""The row sweep's gradient sink (:class:`GradSink`): logit-gradient tiles of whole
rows into a buffer, multiplied out into ``dh`` and ``dW`` a buffer at a time."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ._gemm import gemm_into
from ._tiles import Tiles

__all__ = ["GradSink", "RowScale"]


@dataclasses.dataclass(frozen=True)
class RowScale:
    """Rows whose gradient was held unscaled (:mod:`._single_pass`), given by the sink's
    ``on_flush`` for the rows it multiplies out: their logit gradient, in the form the
    GEMMs take, is ``scale[:, None] * E`` plus ``label`` at the label's column (where
    it is in this shard)."""

    scale: torch.Tensor  # [r]
    label: torch.Tensor  # [r]


class GradSink:
    """``dh`` and ``dW`` from the row sweep's logit gradients: tiles go into a buffer
    ``G`` of ``setup.grad_capacity`` rows (compute dtype); a full buffer, and the last,
    is multiplied out: ``dh[rows] = G @ W``, ``dW (+)= G.T @ h[rows]`` (in ``W``'s dtype
    where the operands are: cuBLAS's fp32 accumulation, one rounding a buffer; else in
    fp32). ``zeros``: ``dh`` and ``dW`` start at 0 (sparse terms added too).

    An epilogue's two ways in, each the gradient of the tempered logits (with a softcap,
    times its slope: :meth:`~._tiles.Tiles.cap_slope_of`): :meth:`put` (a tile of whole
    rows) and :meth:`add_sparse` (terms at a few columns). The engine's own passes write
    the GEMMs' form into :meth:`tile` or hand it to :meth:`commit`; ``on_flush(rows)``,
    called once per buffer of committed rows before they are multiplied out (also where
    no gradient is formed), gives the :class:`RowScale` that scales them."""

    def __init__(
        self,
        engine: Tiles,
        *,
        need_dh: bool,
        need_dw: bool,
        zeros: bool = False,
        on_flush: Callable[[slice], RowScale | None] | None = None,
    ) -> None:
        self.engine = engine
        setup = engine.setup
        n, local, hid, dev = engine.n, engine.local, engine.hs.shape[1], engine.hs.device
        self.capacity = setup.grad_capacity
        # W's dtype where the GEMM operands are in it (bf16 on a GPU: cuBLAS accumulates
        # in fp32 and rounds once a buffer), else the accumulation dtype, cast at the end
        dw_dtype = engine.w_dtype if engine.w_dtype == setup.compute_dtype else setup.acc_dtype
        self.zeros = zeros or n == 0 or local == 0
        make = torch.zeros if self.zeros else torch.empty
        self.dh = make((n, hid), dtype=setup.acc_dtype, device=dev) if need_dh else None
        self.dw = make((local, hid), dtype=dw_dtype, device=dev) if need_dw else None
        self.dw_written = self.zeros
        self.buf: torch.Tensor | None = None
        self.aliased = False  # buf is the caller's tile itself (one tile a buffer)
        self.start = 0  # first row held in the buffer
        self.held = 0  # rows held
        self.on_flush = on_flush
        self.active = need_dh or need_dw or engine.db is not None  # a gradient is formed

    def put(self, rows: slice, gz: torch.Tensor) -> None:
        """The gradient ``gz`` ``[r, V_local]`` of the tempered logits of the tile ``rows``
        (acc dtype; scaled in place into the GEMMs' form)."""
        self.commit(rows, self.engine.untempered_grad(gz, rows))

    def add_sparse(self, rows: slice, cols: torch.Tensor, g: torch.Tensor) -> None:
        """``dz[i, cols[i, j]] += g[i, j]`` for the tile ``rows`` (``cols``: local
        columns, -1 elsewhere; ``g``: the gradient of the tempered logits, acc dtype),
        without a GEMM: ``O(r k h)``. Needs ``zeros=True``."""
        assert self.zeros, "sparse terms add to a zero-initialised sink"
        self._sparse(rows, cols, self.engine.untempered_grad(g, rows))

    def tile(self, rows: slice) -> torch.Tensor:
        """The buffer rows for the tile ``rows`` (``[r, V_local]``, compute dtype)."""
        eng = self.engine
        cdt = eng.setup.compute_dtype
        if self.aliased or self.buf is None:
            self.buf = torch.empty(
                (min(self.capacity, eng.n), eng.local), dtype=cdt, device=eng.hs.device
            )
            self.aliased = False
        return self.buf[self.held : self.held + rows.stop - rows.start]

    def commit(self, rows: slice, gz: torch.Tensor | None = None) -> None:
        """The tile ``rows`` is in the buffer, or is ``gz`` in the GEMMs' form (taken as the
        buffer itself where one tile fills a buffer in the compute dtype, else copied in);
        multiply out when full."""
        r, cdt = rows.stop - rows.start, self.engine.setup.compute_dtype
        if gz is not None and self.held == 0 and self.capacity <= r and gz.dtype == cdt:
            self.buf, self.aliased = gz, True
        elif gz is not None:
            self.tile(rows).copy_(gz)
        if self.held == 0:
            self.start = rows.start
        self.held += r
        if self.held >= self.capacity or rows.stop >= self.engine.n:
            self._flush()

    def _flush(self) -> None:
        """Multiply the held rows out: ``dh[rows] = G @ W``, ``dW (+)= G.T @ h[rows]`` (each
        scaled by ``on_flush``'s :class:`RowScale` where it gives one), the bias's gradient,
        and the label's column of the scaled rows as a sparse term."""
        if self.held == 0:
            return
        eng, setup = self.engine, self.engine.setup
        start, end = self.start, self.start + self.held
        self.held = 0
        scale = None if self.on_flush is None else self.on_flush(slice(start, end))
        if self.buf is None or not self.active:
            return
        grad, hidden = self.buf[: end - start], eng.hs[start:end]
        if self.dh is not None:
            dh = self.dh[start:end]  # each row once: written, unless sparse terms came first
            gemm_into(dh, grad, eng.weight_all(), first=not self.zeros)
            if scale is not None:
                dh.mul_(scale.scale[:, None])
        if self.dw is not None:
            if scale is not None:
                hidden = (hidden.to(setup.acc_dtype) * scale.scale[:, None]).to(setup.compute_dtype)
            gemm_into(self.dw, grad.T, hidden, first=not self.dw_written)
            self.dw_written = True
        eng.bias_grad_(grad, slice(start, end), scale=None if scale is None else scale.scale)
        if scale is not None:  # the label's column, formed in the accumulation dtype
            self._sparse(
                slice(start, end), setup.labels_local[start:end, None], scale.label[:, None]
            )
        if self.aliased:
            self.buf, self.aliased = None, False

    def _sparse(self, rows: slice, cols: torch.Tensor, g: torch.Tensor) -> None:
        """``dh[rows] += sum_j g[:, j] W[cols[:, j]]`` and ``dW[cols[i, j]] += g[i, j] h[i]``
        (elementwise, no GEMM; -1 columns count nothing)."""
        eng, acc = self.engine, self.engine.setup.acc_dtype
        g, safe = torch.where(cols >= 0, g, 0.0), cols.clamp(min=0)
        eng.bias_grad_(g, rows, cols)
        if self.dh is not None:
            self.dh[rows] += (g.unsqueeze(2) * eng.weight_all()[safe].to(acc)).sum(
                1
            )  # [r, k, h] -> [r, h]
        if self.dw is not None:
            contrib = g.unsqueeze(2) * eng.hs[rows].to(acc).unsqueeze(1)  # [r, k, h]
            self.dw.index_add_(
                0, safe.reshape(-1), contrib.reshape(-1, eng.hs.shape[1]).to(self.dw.dtype)
            )

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(dh, dW)``: ``dh`` in the accumulation dtype (times ``inv_t`` when folded),
        ``dW`` in ``W``'s dtype."""
        self._flush()
        return self.engine.unfold_dh(self.dh), None if self.dw is None else self.dw.to(
            self.engine.w_dtype
        )

"""The one tile engine under every processor (``docs/architecture.md``).

It forms the logits ``z = h @ W.T * logit_scale / T`` of the gathered rows and this
rank's vocabulary shard a tile at a time, each tile one ``torch.mm`` with an fp32
output (:func:`mm_into`), reduces each row over the shards, and turns a tile's logit
gradient into ``dh`` and ``dW`` with two more GEMMs. Two sweeps (tile sizes:
:mod:`._geometry`): the vocabulary sweep (:meth:`Engine.forward_stats`, the online
statistics; :meth:`Engine.backward`, the tiles recomputed: four GEMMs in all) and the
row sweep (:meth:`Engine.row_sweep`: whole rows, exact statistics, the gradient formed
in the forward pass into a :class:`GradSink`: three GEMMs). Each memory-bound pass has
a torch form and a Triton form (:mod:`._triton_kernels`), chosen by ``backend``; no
pass reads a device value back to the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hookspec import Collectives

from ._geometry import KernelConfig

__all__ = [
    "Coefficients",
    "Engine",
    "FormedInForward",
    "GradSink",
    "RowScale",
    "Stats",
    "TileSetup",
    "addmm_into",
    "gemm_into",
    "logit_grad_coefficients",
    "mm_into",
    "no_autocast",
    "refuse_double_backward",
    "rowdot",
    "scaled_",
]


@dataclasses.dataclass(frozen=True)
class TileSetup:
    """What the sweeps need, checked (built by :mod:`._options`)."""

    labels_local: torch.Tensor  # [n] long: the label's row in this shard, or -1
    ignored: torch.Tensor  # [n] bool
    inv_t: torch.Tensor | float  # [n] (acc dtype) or a number: logit_scale / T
    fold: bool  # inv_t is folded into the hidden rows (torch backend, fp32/fp64 compute)
    compute_dtype: torch.dtype
    acc_dtype: torch.dtype
    vocab_start: int
    vocab_size: int
    tile: tuple[int, int]  # (rows, cols) of the vocabulary sweep
    row_tile: int  # rows of the row sweep's whole-row tiles
    grad_capacity: int  # rows of the row sweep's gradient buffer (a multiple of row_tile)
    collectives: Collectives | None
    kernel: KernelConfig | None  # the Triton kernels' launch shape; None: the torch backend

    def reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce_max(x) if self.collectives is not None else x

    def reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce_sum(x) if self.collectives is not None else x

    def row_inv_t(self, rows: slice, *, column: bool = True) -> torch.Tensor | float:
        """``inv_t`` of the rows: ``[r, 1]`` (``[r]`` without ``column``) or a number."""
        if not isinstance(self.inv_t, torch.Tensor):
            return self.inv_t
        return self.inv_t[rows, None] if column else self.inv_t[rows]


def scaled_(x: torch.Tensor, factor: torch.Tensor | float) -> torch.Tensor:
    """``x *= factor`` in place (nothing for a factor of 1)."""
    return x.mul_(factor) if isinstance(factor, torch.Tensor) or factor != 1.0 else x


def no_autocast(x: torch.Tensor) -> torch.autocast:
    """Autocast off on ``x``'s device: the engine chooses every dtype itself (a
    caller's ``torch.autocast`` would run its GEMMs and row dots in bf16)."""
    return torch.autocast(x.device.type, enabled=False)


# ---------------------------------------------------------------- GEMMs


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


# ---------------------------------------------------------------- statistics


@dataclasses.dataclass(frozen=True)
class Stats:
    """The global statistics of each row, ``[r]`` each (replicated on every shard)."""

    max: torch.Tensor  # M = max_j z_j
    sumexp: torch.Tensor  # S = sum_j exp(z_j - M)   (>= 1)
    logprobs: torch.Tensor  # z_y - M - log S, 0 where ignored
    entropy: torch.Tensor | None  # log S - sum_j exp(z_j - M) (z_j - M) / S   (>= 0)

    @property
    def lse(self) -> torch.Tensor:
        """``logsumexp(z) = M + log S``."""
        return self.max + torch.log(self.sumexp)

    def detached(self) -> Stats:
        """The same statistics without their graph (kept on an autograd ctx: no cycle)."""
        entropy = None if self.entropy is None else self.entropy.detach()
        return dataclasses.replace(self, logprobs=self.logprobs.detach(), entropy=entropy)


def combine(
    m: torch.Tensor,
    s: torch.Tensor,
    t: torch.Tensor | None,
    zy: torch.Tensor,
    setup: TileSetup,
    rows: slice = slice(None),
) -> Stats:
    """The shards' statistics of the rows ``rows`` (each relative to its own max ``m``)
    combined: one all-reduce max, one all-reduce sum::

        M = all_reduce_max(m);  a = exp(m - M)
        S, zyM, T = all_reduce_sum([s * a, zy - M (label here), a * (t + (m - M) * s)])
    """
    big_m = setup.reduce_max(m)
    a = torch.exp(m - big_m)
    parts = [s * a, torch.where(setup.labels_local[rows] >= 0, zy - big_m, 0.0)]
    if t is not None:
        parts.append(a * (t + (m - big_m) * s))
    return _stats_of_sums(big_m, setup.reduce_sum(torch.stack(parts)), setup.ignored[rows])


def _stats_of_sums(big_m: torch.Tensor, summed: torch.Tensor, ignored: torch.Tensor) -> Stats:
    """:class:`Stats` from the rows' global max ``M`` and their summed ``[S, z_y - M]``
    (and ``T = sum_j exp(z_j - M) (z_j - M)`` as a third row, where entropy is wanted)."""
    big_s = summed[0]
    log_s = torch.log(big_s)
    logprobs = torch.where(ignored, 0.0, summed[1] - log_s)
    entropy = log_s - summed[2] / big_s if summed.shape[0] > 2 else None
    return Stats(max=big_m, sumexp=big_s, logprobs=logprobs, entropy=entropy)


_State = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]
"""Running ``(m, s, t, zy)`` of rows: max, sum of ``exp(z - m)``, entropy term (or
None), the label's logit."""


def _torch_stats_(
    z: torch.Tensor,
    e_buf: torch.Tensor,
    state: _State,
    labels_local: torch.Tensor,
    col0: int,
    *,
    first: bool,
) -> None:
    """The torch form of the statistics pass: fold the tempered tile ``z [r, c]``
    (columns ``col0 + arange(c)``; shifted in place to ``z - m``) into the rows'
    running ``(m, s, t, zy)`` (views of ``[r]``, updated in place)."""
    m, s, t, zy = state
    hit, col = _target_in_tile(labels_local, col0, z.shape[1])
    zy += torch.where(hit, z.gather(1, col).squeeze(1), 0.0)
    cm = z.amax(1)
    m_new = cm if first else torch.maximum(m, cm)
    z.sub_(m_new[:, None])
    e = torch.exp(z, out=e_buf)
    se = e.sum(1)
    if first:
        s.copy_(se)
        if t is not None:
            t.copy_(rowdot(e, z))
    else:
        a = torch.exp(m - m_new)
        if t is not None:
            t.copy_(a * (t + (m - m_new) * s) + rowdot(e, z))
        s.mul_(a).add_(se)
    m.copy_(m_new)


def _target_in_tile(labels_local: torch.Tensor, col0: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hit [r], col [r, 1])``: which rows have their label in columns ``[col0, col0 + cols)``."""
    col = labels_local - col0
    hit = (col >= 0) & (col < cols)
    return hit, col.clamp(0, cols - 1).unsqueeze(1)


# ---------------------------------------------------------------- the logit gradient


@dataclasses.dataclass(frozen=True)
class Coefficients:
    """Per-row ``(a, b, g)`` ``[r]`` of a logit gradient::

    dz_j = -exp(z_j - M) * (a + b * (z_j - M)) + g * [j == y]       # b None: 0
    """

    a: torch.Tensor
    b: torch.Tensor | None
    g: torch.Tensor


def logit_grad_coefficients(
    stats: Stats,
    g_lp: torch.Tensor | None,
    g_h: torch.Tensor | None,
    ignored: torch.Tensor,
    acc_dtype: torch.dtype,
    *,
    g_lse: torch.Tensor | None = None,
) -> Coefficients:
    """The coefficients of the gradient of ``sum(g_lp * logprobs + g_h * entropy +
    g_lse * lse)``::

    d logprob / dz_j = [j == y] - p_j
    d entropy / dz_j = -p_j (log p_j + H)        # p_j = exp(z_j - M) / S
    d lse / dz_j = p_j                           # a -= g_lse / S (every row, ignored too)
    """
    n = stats.max.shape[0]
    g = torch.zeros(n, dtype=acc_dtype, device=stats.max.device) if g_lp is None else g_lp.to(acc_dtype)
    g = torch.where(ignored, 0.0, g)
    inv_s = 1.0 / stats.sumexp
    lead = g if g_lse is None else g - g_lse.to(acc_dtype)
    if g_h is None or stats.entropy is None:
        return Coefficients(lead * inv_s, None, g)
    gh = g_h.to(acc_dtype)
    a = (lead + gh * (stats.entropy - torch.log(stats.sumexp))) * inv_s
    return Coefficients(a, gh * inv_s, g)


def _torch_grad_(
    z: torch.Tensor,
    e: torch.Tensor,
    coef: Coefficients,
    target: tuple[torch.Tensor, torch.Tensor],
    inv_t: torch.Tensor | float | None,
) -> torch.Tensor:
    """The torch form of the gradient pass, in place in ``e``: ``z`` holds ``z - M``, ``e``
    holds ``exp(z - M)`` (may be ``z`` itself when ``b`` is None); ``inv_t``: the
    temperature factor still to apply (None when folded into the hidden rows)."""
    if coef.b is None:
        gz = e.mul_(-coef.a[:, None])
    else:
        gz = e.mul_(z.mul_(-coef.b[:, None]).sub_(coef.a[:, None]))
    hit, col = target  # as _target_in_tile's
    gz.scatter_add_(1, col, torch.where(hit, coef.g, 0.0).unsqueeze(1))
    return gz if inv_t is None else scaled_(gz, inv_t)


# ---------------------------------------------------------------- gradient sink


@dataclasses.dataclass(frozen=True)
class RowScale:
    """Rows whose gradient was held unscaled (the fused loss's single pass), given by
    the sink's ``on_flush`` for the rows it multiplies out: their logit gradient is
    ``scale[:, None] * E`` plus ``label`` at the label's column (``label_col``, -1
    where the label is in another shard)."""

    scale: torch.Tensor  # [r]
    label: torch.Tensor  # [r]
    label_col: torch.Tensor  # [r] long


class GradSink:
    """``dh`` and ``dW`` from the row sweep's logit gradients: tiles go into a buffer
    ``G`` of ``setup.grad_capacity`` rows (compute dtype); a full buffer, and the last,
    is multiplied out: ``dh[rows] = G @ W``, ``dW (+)= G.T @ h[rows]`` (in ``W``'s dtype
    where the operands are: cuBLAS's fp32 accumulation, one rounding a buffer; else in
    fp32). ``zeros``: ``dh`` and ``dW`` start at 0 (sparse terms added too).
    ``on_flush(rows)``: called once per buffer of committed rows, before they are
    multiplied out (also where no gradient is formed); its :class:`RowScale` scales them."""

    def __init__(
        self,
        engine: Engine,
        *,
        need_dh: bool,
        need_dw: bool,
        zeros: bool = False,
        on_flush: Callable[[slice], RowScale | None] | None = None,
    ) -> None:
        self.engine = engine
        setup = engine.setup
        n, local, hid = engine.n, engine.local, engine.hs.shape[1]
        dev = engine.hs.device
        self.capacity = setup.grad_capacity
        # W's dtype where the GEMM operands are in it (bf16 on a GPU: cuBLAS accumulates
        # in fp32 and rounds once a buffer), else the accumulation dtype, cast at the end
        self.dw_dtype = engine.w_dtype if engine.w_dtype == setup.compute_dtype else setup.acc_dtype
        self.zeros = zeros or n == 0 or local == 0
        make = torch.zeros if self.zeros else torch.empty
        self.dh = make((n, hid), dtype=setup.acc_dtype, device=dev) if need_dh else None
        self.dw = make((local, hid), dtype=self.dw_dtype, device=dev) if need_dw else None
        self.dw_written = self.zeros
        self.buf: torch.Tensor | None = None
        self.aliased = False  # buf is the caller's tile itself (one tile a buffer)
        self.start = 0  # first row held in the buffer
        self.held = 0  # rows held
        self.on_flush = on_flush

    @property
    def active(self) -> bool:
        return self.dh is not None or self.dw is not None

    def tile(self, rows: slice) -> torch.Tensor:
        """The buffer rows for the tile ``rows`` (``[r, V_local]``, compute dtype)."""
        eng = self.engine
        cdt = eng.setup.compute_dtype
        if self.aliased or self.buf is None:
            self.buf = torch.empty((min(self.capacity, eng.n), eng.local), dtype=cdt, device=eng.hs.device)
            self.aliased = False
        return self.buf[self.held : self.held + rows.stop - rows.start]

    def put(self, rows: slice, gz: torch.Tensor) -> None:
        """Commit the tile's gradient ``gz`` ``[r, V_local]``: taken as the buffer itself
        where one tile fills a buffer and ``gz`` is in the compute dtype, else copied."""
        r = rows.stop - rows.start
        if self.held == 0 and self.capacity <= r and gz.dtype == self.engine.setup.compute_dtype:
            self.start, self.buf, self.aliased = rows.start, gz, True
        else:
            self.tile(rows).copy_(gz)
        self.commit(rows)

    def commit(self, rows: slice) -> None:
        """The tile ``rows`` is in the buffer; multiply out when full."""
        if self.held == 0:
            self.start = rows.start
        self.held += rows.stop - rows.start
        if self.held >= self.capacity or rows.stop >= self.engine.n:
            self.flush()

    def flush(self) -> None:
        if self.held == 0:
            return
        eng, setup = self.engine, self.engine.setup
        b0, b1 = self.start, self.start + self.held
        self.held = 0
        scale = None if self.on_flush is None else self.on_flush(slice(b0, b1))
        if self.buf is None or not self.active:
            return
        g, x = self.buf[: b1 - b0], eng.hs[b0:b1]
        w = eng.weight_all()
        if self.dh is not None:
            dh = self.dh[b0:b1]  # each row once: written, unless sparse terms came first
            gemm_into(dh, g, w, first=not self.zeros)
            if scale is not None:
                dh.mul_(scale.scale[:, None])
        if self.dw is not None:
            xs = (
                x if scale is None else (x.to(setup.acc_dtype) * scale.scale[:, None]).to(setup.compute_dtype)
            )
            gemm_into(self.dw, g.T, xs, first=not self.dw_written)
            self.dw_written = True
        if scale is not None:  # the label's column, formed in the accumulation dtype
            self._sparse(slice(b0, b1), scale.label_col[:, None], scale.label[:, None])
        if self.aliased:
            self.buf, self.aliased = None, False

    def add_sparse(self, rows: slice, cols: torch.Tensor, g: torch.Tensor) -> None:
        """``dz[i, cols[i, j]] += g[i, j]`` for the tile ``rows`` (``cols``: local
        columns, -1 elsewhere; ``g``: the gradient of the tempered logits, acc dtype),
        without a GEMM: ``O(r k h)``. Needs ``zeros=True``."""
        assert self.zeros, "sparse terms add to a zero-initialised sink"
        self._sparse(rows, cols, self.engine.untempered_grad(g, rows))

    def _sparse(self, rows: slice, cols: torch.Tensor, g: torch.Tensor) -> None:
        """``dh[rows] += sum_j g[:, j] W[cols[:, j]]`` and ``dW[cols[i, j]] += g[i, j] h[i]``
        (elementwise, no GEMM; -1 columns count nothing)."""
        eng, acc = self.engine, self.engine.setup.acc_dtype
        g, safe = torch.where(cols >= 0, g, 0.0), cols.clamp(min=0)
        if self.dh is not None:
            self.dh[rows] += (g.unsqueeze(2) * eng.weight_all()[safe].to(acc)).sum(1)  # [r, k, h] -> [r, h]
        if self.dw is not None:
            contrib = g.unsqueeze(2) * eng.hs[rows].to(acc).unsqueeze(1)  # [r, k, h]
            self.dw.index_add_(0, safe.reshape(-1), contrib.reshape(-1, eng.hs.shape[1]).to(self.dw.dtype))

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(dh, dW)``: ``dh`` in the accumulation dtype (times ``inv_t`` when folded),
        ``dW`` in ``W``'s dtype."""
        self.flush()
        dw = self.dw
        if dw is not None and dw.dtype != self.engine.w_dtype:
            dw = dw.to(self.engine.w_dtype)
        return self.engine.unfold_dh(self.dh), dw


def refuse_double_backward(name: str) -> None:
    """Called first in a custom backward: under ``create_graph=True`` (grad mode on in
    backward) the gradient would have no graph, and its own gradient (a Hessian-vector
    product) would read as zero. Refuse by name instead."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}: double backward (create_graph=True) is not supported: its gradient is formed "
            "by tiles outside autograd, so a second derivative would silently be zero. For Hessian-"
            "vector products compute the logprobs from materialised logits"
        )


class FormedInForward(torch.autograd.Function):
    """Gradients formed in the forward pass, scaled in the backward (the fused loss,
    distillation): ``apply(h, w, name, run)`` returns the outputs of ``run(need_dh,
    need_dw) -> (outputs, dh, dW)``, differentiable in ``h``, ``w`` through ``outputs[0]``
    only, a scalar of cotangent ``g``: ``(g * dh).to(h.dtype)`` (``dh`` rounded once),
    ``(g * dW).to(W.dtype)``, scaled in place and handed over: a second backward through
    the same call raises, as does ``create_graph=True``."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, name: str, run: Callable[..., Any]) -> Any:
        outputs, dh, dw = run(ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.name, ctx.grads, ctx.dtypes = name, (dh, dw), (h.dtype, w.dtype)
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        refuse_double_backward(ctx.name)
        if ctx.grads is None:
            raise RuntimeError(
                f"{ctx.name}: backward through the same call twice; its gradients were formed once in "
                "the forward pass and handed over (scaled in place) by the first backward. Call it again"
            )
        grads, ctx.grads = ctx.grads, None
        for x in (x for x in grads if x is not None):  # one list a dtype: vectorised, g read on the device
            torch._foreach_mul_([x], g)
        return *(None if x is None else x.to(t) for x, t in zip(grads, ctx.dtypes, strict=True)), None, None


# ---------------------------------------------------------------- the engine


class Engine:
    """The tiles of ``z = h @ W.T * inv_t`` for one call: ``hs`` the hidden rows in the
    compute dtype (times ``inv_t`` when folded), ``w`` the shard."""

    def __init__(self, h: torch.Tensor, w: torch.Tensor, setup: TileSetup) -> None:
        self.setup = setup
        hs = h.detach().to(setup.compute_dtype)
        if setup.fold:  # z / T = (h / T) @ W.T: one multiply of the rows, not of every tile
            hs = hs * (
                setup.inv_t.to(hs.dtype)[:, None] if isinstance(setup.inv_t, torch.Tensor) else setup.inv_t
            )
        self.hs = hs
        self.w = w.detach()
        self.w_dtype = w.dtype
        self.n, self.local = int(hs.shape[0]), int(w.shape[0])
        self._bufs: dict[str, torch.Tensor] = {}
        self._w_all: torch.Tensor | None = None
        self._label: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def triton(self) -> bool:
        return self.setup.kernel is not None

    # -- buffers and GEMMs

    def buffer(self, name: str, r: int, c: int, dtype: torch.dtype) -> torch.Tensor:
        """A reused ``[r, c]`` buffer (one allocation per name), so that the loops do not
        allocate and page-fault a fresh tile each step."""
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < r * c or buf.dtype != dtype:
            buf = torch.empty(r * c, dtype=dtype, device=self.hs.device)
            self._bufs[name] = buf
        return buf[: r * c].view(r, c)

    def like(self, name: str, z: torch.Tensor) -> torch.Tensor:
        """A reused buffer of ``z``'s shape and dtype."""
        return self.buffer(name, z.shape[0], z.shape[1], z.dtype)

    def weight(self, cols: slice) -> torch.Tensor:
        """``W[cols]`` in the compute dtype."""
        if self._w_all is not None:
            return self._w_all[cols]
        return self.w[cols].to(self.setup.compute_dtype)

    def weight_all(self) -> torch.Tensor:
        """The whole shard in the compute dtype (kept for the call)."""
        if self._w_all is None:
            self._w_all = self.w.to(self.setup.compute_dtype)
        return self._w_all

    def logits(self, rows: slice, wc: torch.Tensor) -> torch.Tensor:
        """The tile ``h[rows] @ wc.T`` ``[r, c]`` in the accumulation dtype: tempered on
        the torch backend (unless folded), untempered on the Triton backend (its
        kernels apply ``inv_t``)."""
        x = self.hs[rows]
        z = mm_into(self.buffer("z", x.shape[0], wc.shape[0], self.setup.acc_dtype), x, wc.T)
        return z if self.triton or self.setup.fold else scaled_(z, self.setup.row_inv_t(rows))

    def temper(self, values: torch.Tensor, rows: slice, *, inplace: bool = False) -> torch.Tensor:
        """Values of a tile of :meth:`logits` (``[r, k]``, or ``[r]``) as tempered logits."""
        if not self.triton:
            return values
        factor = self.setup.row_inv_t(rows, column=values.dim() == 2)
        return scaled_(values if inplace else values.clone(), factor)

    def untempered_grad(self, gz: torch.Tensor, rows: slice) -> torch.Tensor:
        """The gradient of tempered logits as the sink takes it: times ``inv_t`` unless
        the temperature is folded into the hidden rows."""
        return gz if self.setup.fold else scaled_(gz, self.setup.row_inv_t(rows))

    def pick(self, z: torch.Tensor, rows: slice, cols: torch.Tensor) -> torch.Tensor:
        """The tempered logits of a fresh tile at the local columns ``cols`` ``[r, k]``
        (0 where -1)."""
        return torch.where(cols >= 0, self.temper(z.gather(1, cols.clamp(min=0)), rows), 0.0)

    def row_argmax(self, z: torch.Tensor, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """``(max, argmax)`` of each row of a fresh tile, the max tempered."""
        local_max, local_arg = z.max(1)  # the first maximal column
        return self.temper(local_max, rows), local_arg

    def unfold_dh(self, dh: torch.Tensor | None) -> torch.Tensor | None:
        """``dh = d(hs) * inv_t`` when the temperature was folded into the hidden rows."""
        if dh is None or not self.setup.fold:
            return dh
        return scaled_(dh, self.setup.row_inv_t(slice(None)))

    def vocab_tiles(self) -> Iterator[tuple[slice, slice]]:
        """The vocabulary sweep's tiles, columns outer (each ``W`` tile converted once)."""
        rows, cols = self.setup.tile
        for j0 in range(0, self.local, cols):
            for i0 in range(0, self.n, rows):
                yield slice(i0, min(i0 + rows, self.n)), slice(j0, min(j0 + cols, self.local))

    def row_tiles(self) -> Iterator[slice]:
        height = self.setup.row_tile
        for i0 in range(0, self.n, height):
            yield slice(i0, min(i0 + height, self.n))

    # -- the statistics pass

    def fresh_state(self, r: int, *, with_entropy: bool) -> _State:
        """Running ``(m, s, t, zy)`` of ``r`` rows (``t`` None without entropy)."""
        m, s, t, zy = torch.zeros(4, r, dtype=self.setup.acc_dtype, device=self.hs.device).unbind(0)
        return m.fill_(float("-inf")), s, (t if with_entropy else None), zy

    def stats_pass(self, z: torch.Tensor, rows: slice, cols: slice, state: _State) -> None:
        """Fold the tile into the rows' running statistics ``state`` (``[r]`` views,
        updated in place). The torch form shifts ``z`` in place."""
        setup = self.setup
        if self.triton:
            from ._triton_kernels import chunk_stats_  # on first use: TRITON_INTERPRET is read then

            assert setup.kernel is not None
            inv_t = setup.row_inv_t(rows, column=False)
            chunk_stats_(z, setup.labels_local[rows], inv_t, state, col0=cols.start, cfg=setup.kernel)
            return
        e_buf = self.like("e", z)
        _torch_stats_(z, e_buf, state, setup.labels_local[rows], cols.start, first=cols.start == 0)

    def forward_stats(
        self,
        *,
        with_entropy: bool,
        on_tile: Callable[[torch.Tensor, slice, slice], None] | None = None,
    ) -> Stats:
        """The vocabulary sweep's forward: every row's global :class:`Stats`. ``on_tile``
        sees each logits tile first (untouched; :meth:`temper` its values)."""
        state = self.fresh_state(self.n, with_entropy=with_entropy)
        if self.n and self.local:
            for rows, cols in self.vocab_tiles():
                if rows.start == 0:
                    wc = self.weight(cols)
                z = self.logits(rows, wc)
                if on_tile is not None:
                    on_tile(z, rows, cols)
                m, s, t, zy = state
                self.stats_pass(z, rows, cols, (m[rows], s[rows], None if t is None else t[rows], zy[rows]))
        return combine(*state, self.setup)

    # -- the gradient pass

    def grad_pass(
        self,
        z: torch.Tensor,
        rows: slice,
        cols: slice,
        big_m: torch.Tensor,
        coef: Coefficients,
        *,
        sparse: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The vocabulary sweep's gradient pass: the logit gradient of the tile ``z``
        (fresh from :meth:`logits`) in the compute dtype, in place. ``big_m``, ``coef``:
        the tile's rows. ``sparse``: ``(cols [r, k], g [r, k])`` more terms at those
        columns of the shard (-1: elsewhere), added in the accumulation dtype before the
        gradient is rounded to the compute dtype."""
        setup = self.setup
        cdt = setup.compute_dtype
        if self.triton:
            wide = sparse is not None and cdt != z.dtype
            gz = self._kernel_grad(z, rows, cols.start, big_m, coef, out=None, dtype=z.dtype if wide else cdt)
        else:
            z.sub_(big_m[:, None])
            e = z.exp_() if coef.b is None else torch.exp(z, out=self.like("e", z))
            inv_t = None if setup.fold else setup.row_inv_t(rows)
            target = _target_in_tile(setup.labels_local[rows], cols.start, z.shape[1])
            gz = _torch_grad_(z, e, coef, target, inv_t)
        if sparse is not None:
            self._scatter_sparse(gz, rows, cols, sparse)
        return gz.to(cdt)

    def _kernel_grad(
        self,
        z: torch.Tensor,
        rows: slice,
        col0: int,
        big_m: torch.Tensor,
        coef: Coefficients,
        *,
        out: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The Triton form of the gradient pass (rows indexed from the tile's first)."""
        from ._triton_kernels import logit_grad_  # on first use: TRITON_INTERPRET is read then

        setup = self.setup
        assert setup.kernel is not None  # fp32 [r] vectors throughout (no fp64 on this backend)
        labels, inv_t = setup.labels_local[rows], setup.row_inv_t(rows, column=False)
        coefs = (coef.a, coef.b, coef.g)
        return logit_grad_(z, dtype, labels, inv_t, big_m, coefs, col0=col0, cfg=setup.kernel, out=out)

    def _scatter_sparse(
        self, gz: torch.Tensor, rows: slice, cols: slice, sparse: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """``gz[i, where[i, j] - cols.start] += g[i, j]`` (times ``inv_t`` unless folded)
        for the columns in this tile."""
        where, g = sparse
        local = where - cols.start
        g = self.untempered_grad(
            torch.where((where >= 0) & (local >= 0) & (local < gz.shape[1]), g, 0.0), rows
        )
        gz.scatter_add_(1, local.clamp(0, gz.shape[1] - 1), g.to(gz.dtype))

    def backward(
        self,
        stats: Stats,
        coef: Coefficients,
        *,
        need_dh: bool,
        need_dw: bool,
        sparse: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The vocabulary sweep's backward, each tile recomputed (columns outer)::

            gz = grad_pass(logits(rows, cols))
            dh[rows] (+)= gz @ W[cols];  dW[cols] (+)= gz.T @ h[rows]

        ``dh`` in the accumulation dtype, ``dW`` in ``W``'s (each ``dW`` tile one GEMM
        straight into it where one tile holds every row and ``W`` is the compute dtype).
        """
        setup = self.setup
        acc = setup.acc_dtype
        n, local, hid = self.n, self.local, self.hs.shape[1]
        dev = self.hs.device
        if n == 0 or local == 0:
            dh0 = torch.zeros((n, hid), dtype=acc, device=dev) if need_dh else None
            return dh0, (torch.zeros((local, hid), dtype=self.w_dtype, device=dev) if need_dw else None)
        if self.triton and self._rows_outer():
            return self.row_sweep(self._regrad(stats, coef, sparse), need_dh=need_dh, need_dw=need_dw)
        direct = setup.tile[0] >= n and self.w_dtype == setup.compute_dtype
        dh = torch.empty((n, hid), dtype=acc, device=dev) if need_dh else None
        dw = torch.empty((local, hid), dtype=self.w_dtype if direct else acc, device=dev) if need_dw else None
        for rows, cols in self.vocab_tiles():
            if rows.start == 0:
                wc = self.weight(cols)
            z = self.logits(rows, wc)
            part = None if sparse is None else (sparse[0][rows], sparse[1][rows])
            tile_coef = Coefficients(coef.a[rows], None if coef.b is None else coef.b[rows], coef.g[rows])
            gz = self.grad_pass(z, rows, cols, stats.max[rows], tile_coef, sparse=part)
            if dh is not None:
                gemm_into(dh[rows], gz, wc, first=cols.start == 0)
            if dw is not None:
                gemm_into(dw[cols], gz.T, self.hs[rows], first=rows.start == 0)
        if dw is not None and dw.dtype != self.w_dtype:
            dw = dw.to(self.w_dtype)
        return self.unfold_dh(dh), dw

    def _rows_outer(self) -> bool:
        """The backward takes the row sweep (whole rows; each ``dh`` row written by one
        GEMM, ``dW`` read and written per gradient buffer) where its accumulators move
        fewer bytes than the vocabulary sweep's (``dh`` fp32 read and written per column
        tile, ``dW`` per row tile), and its tile is no larger::

            vocabulary sweep: ((V / cols - 1) n + (n / rows - 1) V) h * 8
            row sweep:        (n / buffer - 1) V h * 2 * itemsize(dW)
        """
        (rows, cols), n, local, hid = self.setup.tile, self.n, self.local, self.hs.shape[1]
        if self.setup.row_tile * local > rows * cols:
            return False
        by_cols = ((-(-local // cols) - 1) * n + (-(-n // rows) - 1) * local) * hid * 8
        size = self.w_dtype.itemsize if self.w_dtype == self.setup.compute_dtype else 4
        return (-(-n // self.setup.grad_capacity) - 1) * local * hid * 2 * size < by_cols

    def _regrad(
        self, stats: Stats, coef: Coefficients, sparse: tuple[torch.Tensor, torch.Tensor] | None
    ) -> Callable[[torch.Tensor, slice, GradSink], None]:
        """The row sweep's epilogue of :meth:`backward` (the Triton form of :meth:`row_grad`
        reads the statistics' ``max`` only)."""

        def epilogue(z: torch.Tensor, rows: slice, sink: GradSink) -> None:
            part = None if sparse is None else (sparse[0][rows], sparse[1][rows])
            tile_coef = Coefficients(coef.a[rows], None if coef.b is None else coef.b[rows], coef.g[rows])
            self.row_grad(
                z, rows, dataclasses.replace(stats, max=stats.max[rows]), tile_coef, sink, sparse=part
            )

        return epilogue

    # -- the row sweep

    def row_sweep(
        self,
        epilogue: Callable[[torch.Tensor, slice, GradSink], None],
        *,
        need_dh: bool,
        need_dw: bool,
        zeros: bool = False,
        on_flush: Callable[[slice], RowScale | None] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Tiles of whole rows: ``epilogue(z, rows, sink)`` gets each tile's logits
        (:meth:`logits` of the whole shard) and puts its gradient into ``sink``
        (:meth:`GradSink.tile`, :meth:`GradSink.commit`; ``on_flush`` as
        :class:`GradSink`'s). Returns ``(dh, dW)`` as :meth:`GradSink.result`."""
        sink = GradSink(self, need_dh=need_dh, need_dw=need_dw, zeros=zeros, on_flush=on_flush)
        if self.n and self.local:
            wc = self.weight_all()
            for rows in self.row_tiles():
                epilogue(self.logits(rows, wc), rows, sink)
        return sink.result()

    def row_stats(self, z: torch.Tensor, rows: slice, *, with_entropy: bool = True) -> Stats:
        """The exact :class:`Stats` of a whole-row tile, combined over the shards: one
        all-reduce max, one all-reduce sum. The torch form leaves ``z - M`` in ``z`` and
        ``exp(z - M)`` in the ``"e"`` buffer for :meth:`row_grad`; the Triton form
        leaves ``z`` as it was."""
        setup = self.setup
        if self.triton:
            state = self.fresh_state(rows.stop - rows.start, with_entropy=with_entropy)
            self.stats_pass(z, rows, slice(0, self.local), state)
            return combine(*state, setup, rows)
        big_m = setup.reduce_max(z.amax(1))
        hit, col, _ = self.label_columns(rows)
        zy = torch.where(hit, z.gather(1, col).squeeze(1) - big_m, 0.0)
        z.sub_(big_m[:, None])
        e = torch.exp(z, out=self.like("e", z))
        parts = [e.sum(1), zy] + ([rowdot(e, z)] if with_entropy else [])
        return _stats_of_sums(big_m, setup.reduce_sum(torch.stack(parts)), setup.ignored[rows])

    def mass_outside(self, z: torch.Tensor, rows: slice, stats: Stats, cols: torch.Tensor) -> torch.Tensor:
        """The probability ``[r]`` of every column but ``cols`` ``[r, k]`` (local, -1
        elsewhere; distinct), summed over those entries and the shards: no ``1 - sum``
        to cancel. After :meth:`row_stats` on the same tile."""
        if self.triton:
            e = torch.exp(self.temper(z, rows) - stats.max[:, None], out=self.like("e", z))
        else:
            e = self.like("e", z)  # exp(z - M), left by row_stats
        here = (cols >= 0).to(torch.uint8)
        listed = torch.zeros(e.shape, dtype=torch.uint8, device=e.device)
        listed.scatter_reduce_(1, cols.clamp(min=0), here, "amax")  # -1s land on 0 without a 1
        return self.setup.reduce_sum(torch.where(listed.bool(), 0.0, e).sum(1)) / stats.sumexp

    def row_grad(
        self,
        z: torch.Tensor,
        rows: slice,
        stats: Stats,
        coef: Coefficients,
        sink: GradSink,
        *,
        sparse: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """The gradient of a whole-row tile after :meth:`row_stats`, into ``sink``; ``sparse``
        as :meth:`grad_pass`."""
        setup = self.setup
        if not self.triton:
            e = self.like("e", z)
            inv_t = None if setup.fold else setup.row_inv_t(rows)
            gz = _torch_grad_(z, e, coef, self.label_columns(rows)[:2], inv_t)
            if sparse is not None:
                self._scatter_sparse(gz, rows, slice(0, self.local), sparse)
            sink.put(rows, gz)
            return
        if sparse is not None and setup.compute_dtype != z.dtype:  # add them in fp32, then round
            gz = self._kernel_grad(z, rows, 0, stats.max, coef, out=None, dtype=z.dtype)
            self._scatter_sparse(gz, rows, slice(0, self.local), sparse)
            sink.put(rows, gz)
            return
        gz = self._kernel_grad(z, rows, 0, stats.max, coef, out=sink.tile(rows), dtype=setup.compute_dtype)
        if sparse is not None:
            self._scatter_sparse(gz, rows, slice(0, self.local), sparse)
        sink.commit(rows)

    def exp_rows(self, z: torch.Tensor, rows: slice, out: torch.Tensor, vec: torch.Tensor) -> None:
        """The fused loss's single pass over a whole-row tile: ``out`` gets ``E = exp(z - c)``
        (0 at the label's column), and ``vec`` (``[5, r]``, acc dtype: a view of the
        call's ``[5, n]``) the rows' local ``c, m, s, t, zy``, combined later over a
        whole buffer by :meth:`vector_stats`. One launch on the Triton backend (``c <= M``,
        see ``EXP_RANGE``); the torch form takes ``c = m``::

            m = max_j z_j;  s = sum_j exp(z_j - c);  t = sum_j exp(z_j - c) (z_j - c)
            zy = z_y (local; any value where the label is in another shard)
        """
        setup = self.setup
        c, m, s, t, zy = vec.unbind(0)
        if self.triton:
            from ._triton_kernels import exp_rows_

            assert setup.kernel is not None
            flags = self.buffer("flags", 1, rows.stop - rows.start, torch.int8)[0]
            inv_t = setup.row_inv_t(rows, column=False)
            exp_rows_(z, out, setup.labels_local[rows], inv_t, (c, m, s, t, zy, flags), cfg=setup.kernel)
            return
        _, col, keep = self.label_columns(rows)
        torch.gather(z, 1, col, out=zy[:, None])
        torch.amax(z, 1, out=c)
        m.copy_(c)
        z.sub_(c[:, None])
        e = torch.exp(z, out=out if out.dtype == z.dtype else self.like("e", z))
        torch.sum(e, 1, out=s)
        torch.bmm(e.unsqueeze(1), z.unsqueeze(2), out=t.view(-1, 1, 1))
        if e is not out:
            out.copy_(e)
        out.scatter_reduce_(1, col, keep, "prod")

    def label_columns(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(hit [r], col [r, 1], keep [r, 1])`` of whole rows: the label is in this shard,
        its column (clamped), and 0 there (compute dtype), else 1; made once a call."""
        if self._label is None:
            hit = self.setup.labels_local >= 0
            col = self.setup.labels_local.clamp(min=0)[:, None]
            self._label = (hit, col, (~hit).to(self.setup.compute_dtype)[:, None])
        hit, col, keep = self._label
        return hit[rows], col[rows], keep[rows]

    def vector_stats(self, vec: torch.Tensor, rows: slice) -> Stats:
        """The :class:`Stats` of the rows ``rows`` of :meth:`exp_rows`' vectors ``vec``
        (``[5, n]``; a buffer's rows at once), combined over the shards."""
        c, m, s, t, zy = vec[:, rows]
        k = torch.exp(c - m)  # relative to the local max, as combine() takes them
        return combine(m, s * k, k * (t + (c - m) * s), zy, self.setup, rows)

    def row_scale(self, vec: torch.Tensor, rows: slice, stats: Stats, coef: Coefficients) -> RowScale:
        """The :class:`RowScale` of the rows ``rows`` of :meth:`exp_rows`' vectors from
        their :class:`Stats` and coefficients (``b`` None)::

            dz = -a exp(z - M) + g [j == y]
               = (-a exp(c - M)) * E  +  (g - a exp(zy - M)) at the label's column
        """
        c, zy = vec[0, rows], vec[4, rows]
        f = 1.0 if self.setup.fold else self.setup.row_inv_t(rows, column=False)
        scale = -coef.a * torch.exp(c - stats.max) * f
        label = (coef.g - coef.a * torch.exp(zy - stats.max)) * f
        return RowScale(scale=scale, label=label, label_col=self.setup.labels_local[rows])

"""The one tile engine under every processor (``docs/architecture.md``).

It forms the logits ``z = h @ W.T * logit_scale / T`` of the gathered rows and this
rank's vocabulary shard a tile at a time (:class:`~._tiles.Tiles`), reduces each row
over the shards, and turns a tile's logit gradient into ``dh`` and ``dW`` with two more
GEMMs: in the vocabulary sweep (:meth:`Engine.forward_stats`, then :meth:`Engine.backward`
recomputing the tiles: four GEMMs) or the row sweep (:meth:`Engine.row_sweep`: whole
rows, exact statistics, the gradient formed in the forward pass into a
:class:`~._sink.GradSink`: three GEMMs). Each memory-bound pass has a torch and a Triton
form (:mod:`._triton_kernels`); none reads a device value back to the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ._gemm import gemm_into, no_autocast, rowdot
from ._sink import GradSink, RowScale
from ._tiles import Tiles, TileSetup

__all__ = [
    "Coefficients",
    "Engine",
    "FormedInForward",
    "Recomputed",
    "Stats",
    "TileSetup",
    "combine",
    "logit_grad_coefficients",
    "refuse_double_backward",
]


# ---------------------------------------------------------------- statistics


@dataclasses.dataclass(frozen=True)
class Stats:
    """The global statistics of each row, ``[r]`` each (replicated on every shard)."""

    max: torch.Tensor  # M = max_j z_j
    sumexp: torch.Tensor  # S = sum_j exp(z_j - M)   (>= 1)
    logprobs: torch.Tensor  # z_y - M - log S, 0 where ignored
    entropy: torch.Tensor | None  # log S - sum_j exp(z_j - M) (z_j - M) / S   (>= 0)
    mean_logit: torch.Tensor | None = None  # sum_j c_j z_j / V (every shard; c: 1 or mean_weights)

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
    sz: torch.Tensor | None = None,
) -> Stats:
    """The shards' statistics of the rows ``rows`` (each relative to its own max ``m``)
    combined: one all-reduce max, one all-reduce sum::

        M = all_reduce_max(m);  a = exp(m - M)
        S, zyM, T, SZ = all_reduce_sum([s * a, zy - M (label here), a * (t + (m - M) * s), sz])
    """
    big_m = setup.reduce_max(m)
    a = torch.exp(m - big_m)
    parts = [s * a, torch.where(setup.labels_local[rows] >= 0, zy - big_m, 0.0)]
    if t is not None:
        parts.append(a * (t + (m - big_m) * s))
    return _summed_stats(big_m, parts, sz, setup, rows)


def _summed_stats(
    big_m: torch.Tensor,
    parts: list[torch.Tensor],
    sz: torch.Tensor | None,
    setup: TileSetup,
    rows: slice,
) -> Stats:
    """:class:`Stats` from the rows' global max ``M`` and the shards' ``parts = [S, z_y -
    M(, T = sum_j exp(z_j - M) (z_j - M), where entropy is wanted)]`` and ``sz = sum_j
    z_j`` (where the mean logit is), summed over the shards in one all-reduce."""
    summed = setup.reduce_sum(torch.stack(parts if sz is None else [*parts, sz]))
    big_s, log_s = summed[0], torch.log(summed[0])
    logprobs = torch.where(setup.ignored[rows], 0.0, summed[1] - log_s)
    entropy = log_s - summed[2] / big_s if len(parts) > 2 else None
    mean = None if sz is None else summed[-1] / setup.vocab_size
    return Stats(max=big_m, sumexp=big_s, logprobs=logprobs, entropy=entropy, mean_logit=mean)


_State = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]
"""Running ``(m, s, t, zy)`` of rows: max, sum of ``exp(z - m)``, entropy term (or
None), the label's logit."""


def _fresh_state(
    tiles: Tiles, r: int, *, with_entropy: bool, with_mean: bool
) -> tuple[_State, torch.Tensor | None]:
    """A fresh :data:`_State` of ``r`` rows and the running sum of their logits (or None)."""
    m, s, t, zy, sz = torch.zeros(5, r, dtype=tiles.setup.acc_dtype, device=tiles.hs.device).unbind(
        0
    )
    return (m.fill_(float("-inf")), s, (t if with_entropy else None), zy), (
        sz if with_mean else None
    )


def _target_in_tile(
    labels_local: torch.Tensor, col0: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hit [r], col [r, 1])``: which rows have their label in columns ``[col0, col0 + cols)``."""
    col = labels_local - col0
    hit = (col >= 0) & (col < cols)
    return hit, col.clamp(0, cols - 1).unsqueeze(1)


# ---------------------------------------------------------------- the logit gradient


@dataclasses.dataclass(frozen=True)
class Coefficients:
    """Per-row ``(a, b, g, u)`` ``[r]`` of a logit gradient::

    dz_j = -exp(z_j - M) * (a + b * (z_j - M)) + g * [j == y] + u * c_j   # b, u None: 0
    """

    a: torch.Tensor
    b: torch.Tensor | None
    g: torch.Tensor
    u: torch.Tensor | None = None

    def of_rows(self, rows: slice) -> Coefficients:
        b, u = (None if vector is None else vector[rows] for vector in (self.b, self.u))
        return Coefficients(self.a[rows], b, self.g[rows], u)


def logit_grad_coefficients(
    stats: Stats,
    g_lp: torch.Tensor | None,
    g_h: torch.Tensor | None,
    ignored: torch.Tensor,
    acc_dtype: torch.dtype,
    *,
    g_lse: torch.Tensor | None = None,
    g_mean: torch.Tensor | None = None,
    vocab: int = 1,
) -> Coefficients:
    """The coefficients of the gradient of ``sum(g_lp * logprobs + g_h * entropy +
    g_lse * lse + g_mean * mean_logit)``::

    d logprob / dz_j = [j == y] - p_j
    d entropy / dz_j = -p_j (log p_j + H)        # p_j = exp(z_j - M) / S
    d lse / dz_j = p_j                           # a -= g_lse / S (every row, ignored too)
    d mean_logit / dz_j = c_j / V                # u = g_mean / vocab (every row;
                                                 #   c: 1 or mean_weights)
    """
    u = None if g_mean is None else g_mean.to(acc_dtype) / vocab
    g = torch.zeros_like(stats.max, dtype=acc_dtype) if g_lp is None else g_lp.to(acc_dtype)
    g = torch.where(ignored, 0.0, g)
    inv_s = 1.0 / stats.sumexp
    lead = g if g_lse is None else g - g_lse.to(acc_dtype)
    if g_h is None or stats.entropy is None:
        return Coefficients(lead * inv_s, None, g, u)
    gh = g_h.to(acc_dtype)
    a = (lead + gh * (stats.entropy - torch.log(stats.sumexp))) * inv_s
    return Coefficients(a, gh * inv_s, g, u)


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
    distillation): ``apply(h, w, b, name, run, grad)`` returns the outputs of ``run(need_dh,
    need_dw, need_db) -> (outputs, dh, dW, db)``, a gradient needed where ``grad`` (the
    caller's grad mode, read before ``apply``: ``needs_input_grad`` is set under
    ``no_grad`` and inference mode too) and the input (``b`` the bias or None) requires
    one; differentiable through ``outputs[0]`` only, a scalar of cotangent ``g``: ``(g *
    dh).to(h.dtype)`` (``dh`` rounded once), likewise ``dW``, ``db``, scaled in place and
    handed over: a second backward through the same call raises, as does
    ``create_graph=True``."""

    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, w: torch.Tensor, b: Any, name: str, run: Any, grad: bool
    ) -> Any:
        outputs, *grads = run(*(grad and need for need in ctx.needs_input_grad[:3]))
        ctx.name, ctx.grads, ctx.dtypes = (
            name,
            grads,
            [None if tensor is None else tensor.dtype for tensor in (h, w, b)],
        )
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        refuse_double_backward(ctx.name)
        if ctx.grads is None:
            raise RuntimeError(
                f"{ctx.name}: backward through the same call twice; its gradients were formed "
                "once in the forward pass and handed over (scaled in place) by the first "
                "backward. Call it again"
            )
        grads, ctx.grads = ctx.grads, None
        for grad in (grad for grad in grads if grad is not None):
            torch._foreach_mul_([grad], g)  # one list a dtype: vectorised, g read on the device
        scaled = (
            None if grad is None else grad.to(dtype)
            for grad, dtype in zip(grads, ctx.dtypes, strict=True)
        )
        return *scaled, None, None, None


class Recomputed(torch.autograd.Function):
    """Gradients recomputed by the vocabulary sweep (the logprobs, top-k): ``apply(h, w, b,
    name, setup, run)`` returns the outputs of ``run(engine) -> (outputs, frozen,
    grad_of)`` (``frozen``: those without a gradient), differentiable in ``h``, ``w``
    and the bias ``b`` (or None): ``grad_of(*cotangents) -> (stats, coef, sparse)``
    (None: no gradient; detached values only, no cycle through ctx) feeds
    :meth:`Engine.backward`. A second backward recomputes; ``create_graph=True`` raises."""

    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, w: torch.Tensor, b: Any, name: str, setup: Any, run: Any
    ) -> Any:
        with no_autocast(h):
            outputs, frozen, ctx.grad_of = run(Engine(h, w, setup))
        ctx.set_materialize_grads(False)
        ctx.name, ctx.setup = name, setup
        ctx.save_for_backward(h, w, b)
        ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    def checked_cotangents(ctx: Any, cotangents: tuple[Any, ...]) -> tuple[Any, ...]:
        """A backward's first step: refuse a double backward and an input changed in place
        since the call, then the cotangents, ``None`` for an output left empty (the mean
        logit or entropy not asked for): traced, autograd materialises one where eager
        passes None (with no rows every output is empty, and each is the gradient asked)."""
        refuse_double_backward(ctx.name)
        ctx.setup.check_versions(ctx.name)
        n = ctx.saved_tensors[0].shape[0]
        return tuple(None if g is None or (n and g.numel() == 0) else g for g in cotangents)

    @staticmethod
    def backward(ctx: Any, *cotangents: Any) -> tuple[Any, ...]:
        cotangents = Recomputed.checked_cotangents(ctx, cotangents)
        h, w, b = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        with no_autocast(h):
            if not (need_dh or need_dw or need_db) or (terms := ctx.grad_of(*cotangents)) is None:
                return None, None, None, None, None, None
            stats, coef, sparse = terms
            eng = Engine(h, w, ctx.setup, need_db=need_db)
            dh, dw = eng.backward(stats, coef, need_dh=need_dh, need_dw=need_dw, sparse=sparse)
        db = None if eng.db is None else eng.db.to(b.dtype)
        return (None if dh is None else dh.to(h.dtype)), dw, db, None, None, None


def _rows_outer(setup: TileSetup, n: int, local: int, hid: int, w_dtype: torch.dtype) -> bool:
    """The backward takes the row sweep (whole rows; each ``dh`` row written by one
    GEMM, ``dW`` read and written per gradient buffer) where its accumulators move
    fewer bytes than the vocabulary sweep's (``dh`` fp32 read and written per column
    tile, ``dW`` per row tile), and its tile is no larger::

        vocabulary sweep: ((V / cols - 1) n + (n / rows - 1) V) h * 8
        row sweep:        (n / buffer - 1) V h * 2 * itemsize(dW)
    """
    rows, cols = setup.tile
    if setup.row_tile * local > rows * cols:
        return False
    by_cols = ((-(-local // cols) - 1) * n + (-(-n // rows) - 1) * local) * hid * 8
    size = w_dtype.itemsize if w_dtype == setup.compute_dtype else 4
    return (-(-n // setup.grad_capacity) - 1) * local * hid * 2 * size < by_cols


# ---------------------------------------------------------------- the engine


class Engine(Tiles):
    """The passes and the two sweeps over one call's :class:`~._tiles.Tiles`."""

    # -- the vocabulary sweep

    def stats_pass(
        self,
        z: torch.Tensor,
        rows: slice,
        cols: slice,
        state: _State,
        sz: torch.Tensor | None = None,
    ) -> None:
        """Fold the tempered tile ``z [r, c]`` into the rows' running ``(m, s, t, zy)``
        (``[r]`` views, updated in place); ``sz += z.sum(1)`` (``z @ cw[cols]`` with the
        column weights ``cw``) where asked for. The torch form shifts ``z`` in place to
        ``z - m``; ``cols.start == 0``: the first tile."""
        setup, labels, cw = self.setup, self.setup.labels_local[rows], self.setup.mean_weights
        if self.triton:
            from ._triton_kernels import chunk_stats_  # on first use: TRITON_INTERPRET is read then

            assert setup.kernel is not None
            inv_t = setup.row_inv_t(rows, column=False)
            chunk_stats_(
                z,
                labels,
                inv_t,
                state,
                col0=cols.start,
                cfg=setup.kernel,
                cap_k=setup.cap_k,
                sz=sz,
                cw=cw,
            )
            return
        (m, s, t, zy), first = state, cols.start == 0
        if sz is not None:
            sz += z.sum(1) if cw is None else z @ cw[cols].to(z.dtype)
        hit, col = _target_in_tile(labels, cols.start, z.shape[1])
        zy += torch.where(hit, z.gather(1, col).squeeze(1), 0.0)
        m_new = z.amax(1) if first else torch.maximum(m, z.amax(1))
        z.sub_(m_new[:, None])
        e = torch.exp(z, out=self.like("e", z))
        if first:
            s.copy_(e.sum(1))
            if t is not None:
                t.copy_(rowdot(e, z))
        else:
            a = torch.exp(m - m_new)
            if t is not None:
                t.copy_(a * (t + (m - m_new) * s) + rowdot(e, z))
            s.mul_(a).add_(e.sum(1))
        m.copy_(m_new)

    def forward_stats(
        self,
        *,
        with_entropy: bool,
        on_tile: Callable[[torch.Tensor, slice, slice], None] | None = None,
        with_mean: bool = False,
    ) -> Stats:
        """The vocabulary sweep's forward: every row's global :class:`Stats` (with
        ``mean_logit`` where ``with_mean``). ``on_tile`` sees each logits tile first
        (untouched; :meth:`logits_of` its values)."""
        state, sz = _fresh_state(self, self.n, with_entropy=with_entropy, with_mean=with_mean)
        m, s, t, zy = state
        for rows, cols, _, z in self.vocab_tiles():
            if on_tile is not None:
                on_tile(z, rows, cols)
            part = (m[rows], s[rows], None if t is None else t[rows], zy[rows])
            self.stats_pass(z, rows, cols, part, None if sz is None else sz[rows])
        return combine(*state, self.setup, sz=sz)

    def grad_pass(
        self,
        z: torch.Tensor,
        rows: slice,
        cols: slice,
        big_m: torch.Tensor,
        coef: Coefficients,
        *,
        shifted: bool,
        sparse: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The logit gradient of the tile ``z`` (``big_m``, ``coef``: the tile's rows) in the
        GEMMs' form and the compute dtype, whatever the backend: in ``out`` (``[r, c]``,
        compute dtype) where given, else in the tile's own memory or a fresh tensor.

        ``z`` comes fresh from :meth:`logits`, or ``shifted``: after the torch form of
        :meth:`row_stats` (``z - M`` in ``z``, ``exp(z - M)`` in the ``"e"`` buffer; the
        Triton form of :meth:`row_stats` leaves ``z`` as it was, so its pass is the same).
        ``sparse``: ``(cols [n, k], g [n, k])`` of every row, more terms at those columns of
        the shard (-1: elsewhere), added in the accumulation dtype before the one rounding
        to the compute dtype."""
        setup = self.setup
        # sparse terms are added before the rounding: the Triton form then writes z's dtype
        wide = sparse is not None and setup.compute_dtype != setup.acc_dtype
        if self.triton:
            dtype = setup.acc_dtype if wide else setup.compute_dtype
            grad = self._triton_grad(z, rows, cols, big_m, coef, dtype, None if wide else out)
        elif shifted:  # whole rows: their label columns made once a call
            hit, col, _ = self.label_columns(rows)
            grad = self._torch_grad(z, self.like("e", z), hit, col, rows, cols, coef)
        else:
            grad = self._torch_grad(
                z, *self._shift_tile(z, rows, cols, big_m, coef), rows, cols, coef
            )
        if sparse is not None:
            self._add_sparse_(grad, rows, cols, sparse)
        if grad is out:
            return out
        return grad.to(setup.compute_dtype) if out is None else out.copy_(grad)

    def _triton_grad(
        self,
        z: torch.Tensor,
        rows: slice,
        cols: slice,
        big_m: torch.Tensor,
        coef: Coefficients,
        dtype: torch.dtype,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """The Triton form of :meth:`grad_pass` (one kernel reads the untempered tile once
        and writes the gradient of ``dtype``, into ``out`` or in place in ``z``'s memory):
        it exists because the torch form makes a pass over the tile's memory per operation."""
        from ._triton_kernels import logit_grad_  # on first use: TRITON_INTERPRET is read then

        setup = self.setup
        assert setup.kernel is not None  # fp32 [r] vectors throughout (no fp64 on this backend)
        return logit_grad_(
            z,
            dtype,
            setup.labels_local[rows],
            setup.row_inv_t(rows, column=False),
            big_m,
            (coef.a, coef.b, coef.g),
            col0=cols.start,
            cfg=setup.kernel,
            out=out,
            cap_k=setup.cap_k,
            u=coef.u,
            cw=setup.mean_weights,
        )

    def _shift_tile(
        self, z: torch.Tensor, rows: slice, cols: slice, big_m: torch.Tensor, coef: Coefficients
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(exps, hit, col)`` of a fresh tile for :meth:`_torch_grad`: ``z`` shifted to ``z -
        M`` in place, its ``exp(z - M)`` (in ``z`` itself where ``coef.b`` is None: ``z - M``
        is not read again) and the rows' label columns in this tile (:func:`_target_in_tile`).
        It exists because a fresh tile, unlike :meth:`row_stats`' whole rows, has none of
        these yet."""
        z.sub_(big_m[:, None])
        exps = z.exp_() if coef.b is None else torch.exp(z, out=self.like("e", z))
        hit, col = _target_in_tile(self.setup.labels_local[rows], cols.start, z.shape[1])
        return exps, hit, col

    def _torch_grad(
        self,
        shifted_z: torch.Tensor,
        exps: torch.Tensor,
        hit: torch.Tensor,
        col: torch.Tensor,
        rows: slice,
        cols: slice,
        coef: Coefficients,
    ) -> torch.Tensor:
        """The torch form of :meth:`grad_pass`, in the accumulation dtype and in place in
        ``exps`` (``shifted_z = z - M`` overwritten where ``coef.b`` is given):
        :class:`Coefficients`' ``dz``, then untempered and times the softcap's slope. It
        exists for the float64 inputs and the devices Triton does not run on, and as the
        reference of the kernel."""
        setup = self.setup
        if coef.b is None:
            factor = -coef.a[:, None]
        else:  # -(a + b (z - M)), in z's memory
            factor = shifted_z.mul_(-coef.b[:, None]).sub_(coef.a[:, None])
        grad = exps.mul_(factor)  # as Coefficients' dz, in place in exps
        grad.scatter_add_(1, col, torch.where(hit, coef.g, 0.0).unsqueeze(1))
        if coef.u is not None:
            if setup.mean_weights is None:
                grad.add_(coef.u[:, None])
            else:
                weights = setup.mean_weights[cols].to(grad.dtype)
                grad.addr_(coef.u.to(grad.dtype), weights)
        return self.cap_slope_(self.untempered_grad(grad, rows))

    def _add_sparse_(
        self,
        grad: torch.Tensor,
        rows: slice,
        cols: slice,
        sparse: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """``grad[i, where[i, j] - col0] += g[i, j]`` (untempered, in ``grad``'s dtype) for the
        sparse terms' columns that fall in this tile: top-k's and distillation's terms at a
        few columns of a row, which neither form of the dense pass knows."""
        where, values = sparse[0][rows], sparse[1][rows]
        local = where - cols.start
        hit = (where >= 0) & (local >= 0) & (local < grad.shape[1])
        values = self.untempered_grad(torch.where(hit, values, 0.0), rows)
        grad.scatter_add_(1, local.clamp(0, grad.shape[1] - 1), values.to(grad.dtype))

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

            gz = grad_pass(logits(rows, cols))     # compute dtype
            dh[rows] (+)= gz @ W[cols];  dW[cols] (+)= gz.T @ h[rows]

        ``dh`` in the accumulation dtype, ``dW`` in ``W``'s (each ``dW`` tile one GEMM
        straight into it where one tile holds every row and ``W`` is the compute dtype).
        """
        setup = self.setup
        n, local, hid = self.n, self.local, self.hs.shape[1]
        if (
            n == 0
            or local == 0
            or (self.triton and _rows_outer(setup, n, local, hid, self.w_dtype))
        ):

            def epilogue(
                z: torch.Tensor, rows: slice, sink: GradSink
            ) -> None:  # zeros, or whole rows
                self.row_grad(z, rows, stats.max[rows], coef.of_rows(rows), sink, sparse=sparse)

            return self.row_sweep(epilogue, need_dh=need_dh, need_dw=need_dw)
        acc, cdt, dev = setup.acc_dtype, setup.compute_dtype, self.hs.device
        direct = setup.tile[0] >= n and self.w_dtype == cdt
        dh = torch.empty((n, hid), dtype=acc, device=dev) if need_dh else None
        dw = (
            torch.empty((local, hid), dtype=self.w_dtype if direct else acc, device=dev)
            if need_dw
            else None
        )
        for rows, cols, wc, z in self.vocab_tiles():
            part = coef.of_rows(rows)
            gz = self.grad_pass(z, rows, cols, stats.max[rows], part, shifted=False, sparse=sparse)
            if dh is not None:
                gemm_into(dh[rows], gz, wc, first=cols.start == 0)
            if dw is not None:
                gemm_into(dw[cols], gz.T, self.hs[rows], first=rows.start == 0)
            self.bias_grad_(gz, rows, cols)
        return self.unfold_dh(dh), None if dw is None else dw.to(self.w_dtype)

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
        (:meth:`logits` of the whole shard: :meth:`row_stats`, :meth:`row_grad`, or
        :meth:`logits_of` its values) and puts its gradient into ``sink`` (``zeros``,
        ``on_flush`` as :class:`GradSink`'s). Returns ``(dh, dW)`` as :meth:`GradSink.result`."""
        sink = GradSink(self, need_dh=need_dh, need_dw=need_dw, zeros=zeros, on_flush=on_flush)
        for rows, z in self.row_tiles():
            epilogue(z, rows, sink)
        return sink.result()

    def row_stats(
        self,
        z: torch.Tensor,
        rows: slice,
        *,
        with_entropy: bool = True,
        exps: bool = False,
        with_mean: bool = False,
    ) -> tuple[Stats, torch.Tensor | None]:
        """The exact :class:`Stats` of a whole-row tile, combined over the shards (one
        all-reduce max, one all-reduce sum), and with ``exps`` the tile's ``exp(z - M)``
        ``[r, V_local]`` (of the tempered logits; valid until :meth:`row_grad`). The
        torch form leaves ``z - M`` in ``z`` and ``exp(z - M)`` in the ``"e"`` buffer for
        :meth:`row_grad`; the Triton form leaves ``z`` as it was. ``with_mean``: with
        ``mean_logit``."""
        setup = self.setup
        if self.triton:
            state, sz = _fresh_state(
                self, z.shape[0], with_entropy=with_entropy, with_mean=with_mean
            )
            self.stats_pass(z, rows, slice(0, self.local), state, sz)
            stats = combine(*state, setup, rows, sz=sz)
            if not exps:
                return stats, None
            return stats, torch.exp(
                self.logits_of(z, rows) - stats.max[:, None], out=self.like("e", z)
            )
        big_m = setup.reduce_max(z.amax(1))
        hit, col, _ = self.label_columns(rows)
        zy = torch.where(hit, z.gather(1, col).squeeze(1) - big_m, 0.0)
        cw = setup.mean_weights
        sz = (z.sum(1) if cw is None else z @ cw.to(z.dtype)) if with_mean else None
        z.sub_(big_m[:, None])
        e = torch.exp(z, out=self.like("e", z))
        stats = _summed_stats(
            big_m, [e.sum(1), zy] + ([rowdot(e, z)] if with_entropy else []), sz, setup, rows
        )
        return stats, (e if exps else None)

    def row_grad(
        self,
        z: torch.Tensor,
        rows: slice,
        big_m: torch.Tensor,
        coef: Coefficients,
        sink: GradSink,
        *,
        sparse: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """The gradient of a whole-row tile after :meth:`row_stats` (``big_m``: its rows'
        ``M``) into ``sink``; ``sparse`` as :meth:`grad_pass`'s."""
        setup = self.setup
        # the gradient goes straight into the sink's buffer, except a torch tile already in the
        # compute dtype: the sink takes that tile itself as its buffer (no copy)
        direct = self.triton or setup.compute_dtype != setup.acc_dtype
        out = sink.tile(rows) if direct else None
        gz = self.grad_pass(
            z, rows, slice(0, self.local), big_m, coef, shifted=True, sparse=sparse, out=out
        )
        sink.commit(rows, None if gz is out else gz)

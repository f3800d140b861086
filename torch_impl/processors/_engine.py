"""The one tile engine under every processor (``docs/architecture.md``).

It forms the logits ``z = h @ W.T * logit_scale / T`` of the gathered rows and this
rank's vocabulary shard a tile at a time (:class:`~._tiles.Tiles`: one ``torch.mm``
with an fp32 output each, :func:`~._gemm.mm_into`), reduces each row over the
shards, and turns a tile's logit gradient into ``dh`` and ``dW`` with two more GEMMs.
Two sweeps (tile sizes: :mod:`._geometry`): the vocabulary sweep
(:meth:`Engine.forward_stats`, the online statistics; :meth:`Engine.backward`, the
tiles recomputed: four GEMMs in all) and the row sweep (:meth:`Engine.row_sweep`:
whole rows, exact statistics, the gradient formed in the forward pass into a
:class:`~._sink.GradSink`: three GEMMs; the fused loss's single pass on it:
:mod:`._single_pass`). Each memory-bound pass has a torch form and a Triton form
(:mod:`._triton_kernels`), chosen by ``backend``; no pass reads a device value back
to the host. The temperature stays inside: an epilogue sees tempered logits
(:meth:`~._tiles.Tiles.logits_of`) and hands over the gradient of the tempered logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ._gemm import gemm_into, no_autocast, rowdot, scaled_
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
    if sz is not None:
        parts.append(sz)
    vocab = None if sz is None else setup.vocab_size
    return _stats_of_sums(big_m, setup.reduce_sum(torch.stack(parts)), setup.ignored[rows], vocab)


def _stats_of_sums(
    big_m: torch.Tensor, summed: torch.Tensor, ignored: torch.Tensor, vocab: int | None = None
) -> Stats:
    """:class:`Stats` from the rows' global max ``M`` and their summed ``[S, z_y - M]``
    (and ``T = sum_j exp(z_j - M) (z_j - M)`` as a third row, where entropy is wanted;
    with ``vocab``, ``sum_j z_j`` as the last row: the mean logit)."""
    mean = None
    if vocab is not None:
        mean, summed = summed[-1] / vocab, summed[:-1]
    big_s = summed[0]
    log_s = torch.log(big_s)
    logprobs = torch.where(ignored, 0.0, summed[1] - log_s)
    entropy = log_s - summed[2] / big_s if summed.shape[0] > 2 else None
    return Stats(max=big_m, sumexp=big_s, logprobs=logprobs, entropy=entropy, mean_logit=mean)


_State = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]
"""Running ``(m, s, t, zy)`` of rows: max, sum of ``exp(z - m)``, entropy term (or
None), the label's logit."""


def _fresh_state(r: int, acc: torch.dtype, device: torch.device, *, with_entropy: bool) -> _State:
    """Running ``(m, s, t, zy)`` of ``r`` rows (``t`` None without entropy)."""
    m, s, t, zy = torch.zeros(4, r, dtype=acc, device=device).unbind(0)
    return m.fill_(float("-inf")), s, (t if with_entropy else None), zy


def _torch_stats_(
    z: torch.Tensor,
    e_buf: torch.Tensor,
    state: _State,
    labels_local: torch.Tensor,
    col0: int,
    *,
    first: bool,
    sz: torch.Tensor | None = None,
    cw: torch.Tensor | None = None,
) -> None:
    """The torch form of the statistics pass: fold the tempered tile ``z [r, c]``
    (columns ``col0 + arange(c)``; shifted in place to ``z - m``) into the rows'
    running ``(m, s, t, zy)`` (views of ``[r]``, updated in place); ``sz += z.sum(1)``
    (``z @ cw`` with the tile's column weights ``cw [c]``)."""
    m, s, t, zy = state
    if sz is not None:
        sz += z.sum(1) if cw is None else z @ cw.to(z.dtype)
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
    """Per-row ``(a, b, g, u)`` ``[r]`` of a logit gradient::

    dz_j = -exp(z_j - M) * (a + b * (z_j - M)) + g * [j == y] + u * c_j   # b, u None: 0
    """

    a: torch.Tensor
    b: torch.Tensor | None
    g: torch.Tensor
    u: torch.Tensor | None = None

    def of_rows(self, rows: slice) -> Coefficients:
        b, u = (None if x is None else x[rows] for x in (self.b, self.u))
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
    d mean_logit / dz_j = c_j / V                # u = g_mean / vocab (every row; c: 1 or mean_weights)
    """
    u = None if g_mean is None else g_mean.to(acc_dtype) / vocab
    n = stats.max.shape[0]
    g = torch.zeros(n, dtype=acc_dtype, device=stats.max.device) if g_lp is None else g_lp.to(acc_dtype)
    g = torch.where(ignored, 0.0, g)
    inv_s = 1.0 / stats.sumexp
    lead = g if g_lse is None else g - g_lse.to(acc_dtype)
    if g_h is None or stats.entropy is None:
        return Coefficients(lead * inv_s, None, g, u)
    gh = g_h.to(acc_dtype)
    a = (lead + gh * (stats.entropy - torch.log(stats.sumexp))) * inv_s
    return Coefficients(a, gh * inv_s, g, u)


def _torch_grad_(
    z: torch.Tensor,
    e: torch.Tensor,
    coef: Coefficients,
    target: tuple[torch.Tensor, torch.Tensor],
    inv_t: torch.Tensor | float | None,
    cw: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch form of the gradient pass, in place in ``e``: ``z`` holds ``z - M``, ``e``
    holds ``exp(z - M)`` (may be ``z`` itself when ``b`` is None); ``inv_t``: the
    temperature factor still to apply (None when folded into the hidden rows); ``cw``:
    the tile's column weights of ``u``."""
    if coef.b is None:
        gz = e.mul_(-coef.a[:, None])
    else:
        gz = e.mul_(z.mul_(-coef.b[:, None]).sub_(coef.a[:, None]))
    hit, col = target  # as _target_in_tile's
    gz.scatter_add_(1, col, torch.where(hit, coef.g, 0.0).unsqueeze(1))
    if coef.u is not None:
        gz.add_(coef.u[:, None]) if cw is None else gz.addr_(coef.u.to(gz.dtype), cw.to(gz.dtype))
    return gz if inv_t is None else scaled_(gz, inv_t)


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
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, b: Any, name: str, run: Any, grad: bool) -> Any:
        outputs, *grads = run(*(grad and need for need in ctx.needs_input_grad[:3]))
        ctx.name, ctx.grads, ctx.dtypes = name, grads, [None if x is None else x.dtype for x in (h, w, b)]
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
        scaled = (None if x is None else x.to(t) for x, t in zip(grads, ctx.dtypes, strict=True))
        return *scaled, None, None, None


class Recomputed(torch.autograd.Function):
    """Gradients recomputed by the vocabulary sweep (the logprobs, top-k): ``apply(h, w, b,
    name, setup, run)`` returns the outputs of ``run(engine) -> (outputs, frozen,
    grad_of)`` (``frozen``: those without a gradient), differentiable in ``h``, ``w``
    and the bias ``b`` (or None): ``grad_of(*cotangents) -> (stats, coef, sparse)``
    (None: no gradient; detached values only, no cycle through ctx) feeds
    :meth:`Engine.backward`. A second backward recomputes; ``create_graph=True`` raises."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, b: Any, name: str, setup: Any, run: Any) -> Any:
        with no_autocast(h):
            outputs, frozen, ctx.grad_of = run(Engine(h, w, setup))
        ctx.set_materialize_grads(False)
        ctx.name, ctx.setup = name, setup
        ctx.save_for_backward(h, w, b)
        ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    def backward(ctx: Any, *cotangents: Any) -> tuple[Any, ...]:
        refuse_double_backward(ctx.name)
        h, w, b = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        with no_autocast(h):
            terms = ctx.grad_of(*cotangents) if need_dh or need_dw or need_db else None
            if terms is None:
                return None, None, None, None, None, None
            stats, coef, sparse = terms
            eng = Engine(h, w, ctx.setup, need_db=need_db)
            dh, dw = eng.backward(stats, coef, need_dh=need_dh, need_dw=need_dw, sparse=sparse)
        db = None if eng.db is None else eng.db.to(b.dtype)
        return (None if dh is None else dh.to(h.dtype)), dw, db, None, None, None


def _triton_stats_(
    setup: TileSetup, z: torch.Tensor, rows: slice, col0: int, state: _State, sz: torch.Tensor | None
) -> None:
    """The Triton form of the statistics pass (:func:`~._triton_kernels.chunk_stats_`)."""
    from ._triton_kernels import chunk_stats_  # on first use: TRITON_INTERPRET is read then

    assert setup.kernel is not None
    inv_t, labels, cw = setup.row_inv_t(rows, column=False), setup.labels_local[rows], setup.mean_weights
    chunk_stats_(z, labels, inv_t, state, col0=col0, cfg=setup.kernel, cap_k=setup.cap_k, sz=sz, cw=cw)


def _triton_grad(
    setup: TileSetup,
    z: torch.Tensor,
    rows: slice,
    col0: int,
    big_m: torch.Tensor,
    coef: Coefficients,
    *,
    out: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The Triton form of the gradient pass (:func:`~._triton_kernels.logit_grad_`; rows
    indexed from the tile's first)."""
    from ._triton_kernels import logit_grad_  # on first use: TRITON_INTERPRET is read then

    assert setup.kernel is not None  # fp32 [r] vectors throughout (no fp64 on this backend)
    labels, inv_t = setup.labels_local[rows], setup.row_inv_t(rows, column=False)
    coefs, cfg, cw = (coef.a, coef.b, coef.g), setup.kernel, setup.mean_weights
    return logit_grad_(
        z, dtype, labels, inv_t, big_m, coefs, col0=col0, cfg=cfg, out=out, cap_k=setup.cap_k, u=coef.u, cw=cw
    )


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
        self, z: torch.Tensor, rows: slice, cols: slice, state: _State, sz: torch.Tensor | None = None
    ) -> None:
        """Fold the tile into the rows' running statistics ``state`` (``[r]`` views,
        updated in place; ``sz``: the running sum of the logits, where asked for). The
        torch form shifts ``z`` in place."""
        setup = self.setup
        if self.triton:
            _triton_stats_(setup, z, rows, cols.start, state, sz)
            return
        e_buf = self.like("e", z)
        cw = None if setup.mean_weights is None else setup.mean_weights[cols]
        _torch_stats_(
            z, e_buf, state, setup.labels_local[rows], cols.start, first=cols.start == 0, sz=sz, cw=cw
        )

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
        state = _fresh_state(self.n, self.setup.acc_dtype, self.hs.device, with_entropy=with_entropy)
        sz = torch.zeros_like(state[0]) if with_mean else None
        if self.n and self.local:
            for rows, cols in self.vocab_tiles():
                if rows.start == 0:
                    wc = self.weight(cols)
                z = self.logits(rows, wc, cols)
                if on_tile is not None:
                    on_tile(z, rows, cols)
                m, s, t, zy = state
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
            gz = _triton_grad(
                setup, z, rows, cols.start, big_m, coef, out=None, dtype=z.dtype if wide else cdt
            )
        else:
            z.sub_(big_m[:, None])
            e = z.exp_() if coef.b is None else torch.exp(z, out=self.like("e", z))
            target = _target_in_tile(setup.labels_local[rows], cols.start, z.shape[1])
            cw = None if setup.mean_weights is None else setup.mean_weights[cols]
            gz = self.cap_slope_(
                _torch_grad_(z, e, coef, target, None if setup.fold else setup.row_inv_t(rows), cw), rows
            )
        if sparse is not None:
            self._scatter_sparse(gz, rows, cols.start, sparse)
        return gz.to(cdt)

    def _scatter_sparse(
        self, gz: torch.Tensor, rows: slice, col0: int, sparse: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """``gz[i, where[i, j] - col0] += g[i, j]`` (in the GEMMs' form) for the columns in
        this tile."""
        where, g = sparse
        local = where - col0
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
        if (
            n == 0 or local == 0 or (self.triton and _rows_outer(setup, n, local, hid, self.w_dtype))
        ):  # zeros, or whole rows

            def epilogue(z: torch.Tensor, rows: slice, sink: GradSink) -> None:
                part = None if sparse is None else (sparse[0][rows], sparse[1][rows])
                self.row_grad(z, rows, stats.max[rows], coef.of_rows(rows), sink, sparse=part)

            return self.row_sweep(epilogue, need_dh=need_dh, need_dw=need_dw)
        direct = setup.tile[0] >= n and self.w_dtype == setup.compute_dtype
        dh = torch.empty((n, hid), dtype=acc, device=dev) if need_dh else None
        dw = torch.empty((local, hid), dtype=self.w_dtype if direct else acc, device=dev) if need_dw else None
        for rows, cols in self.vocab_tiles():
            if rows.start == 0:
                wc = self.weight(cols)
            z = self.logits(rows, wc, cols)
            part = None if sparse is None else (sparse[0][rows], sparse[1][rows])
            gz = self.grad_pass(z, rows, cols, stats.max[rows], coef.of_rows(rows), sparse=part)
            if dh is not None:
                gemm_into(dh[rows], gz, wc, first=cols.start == 0)
            if dw is not None:
                gemm_into(dw[cols], gz.T, self.hs[rows], first=rows.start == 0)
            self.bias_grad_(gz, rows, cols)
        if dw is not None and dw.dtype != self.w_dtype:
            dw = dw.to(self.w_dtype)
        return self.unfold_dh(dh), dw

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
        :meth:`logits_of` its values) and puts its gradient into ``sink``
        (:meth:`GradSink.put`, :meth:`GradSink.add_sparse`; ``zeros``, ``on_flush`` as
        :class:`GradSink`'s). Returns ``(dh, dW)`` as :meth:`GradSink.result`."""
        sink = GradSink(self, need_dh=need_dh, need_dw=need_dw, zeros=zeros, on_flush=on_flush)
        if self.n and self.local:
            wc = self.weight_all()
            for rows in self.row_tiles():
                epilogue(self.logits(rows, wc), rows, sink)
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
            state = _fresh_state(rows.stop - rows.start, setup.acc_dtype, z.device, with_entropy=with_entropy)
            sz = torch.zeros_like(state[0]) if with_mean else None
            self.stats_pass(z, rows, slice(0, self.local), state, sz)
            stats = combine(*state, setup, rows, sz=sz)
            if not exps:
                return stats, None
            return stats, torch.exp(self.logits_of(z, rows) - stats.max[:, None], out=self.like("e", z))
        big_m = setup.reduce_max(z.amax(1))
        hit, col, _ = self.label_columns(rows)
        zy = torch.where(hit, z.gather(1, col).squeeze(1) - big_m, 0.0)
        cw = setup.mean_weights
        zsum = [z.sum(1) if cw is None else z @ cw.to(z.dtype)] if with_mean else []
        z.sub_(big_m[:, None])
        e = torch.exp(z, out=self.like("e", z))
        parts = [e.sum(1), zy] + ([rowdot(e, z)] if with_entropy else []) + zsum
        vocab = setup.vocab_size if with_mean else None
        stats = _stats_of_sums(big_m, setup.reduce_sum(torch.stack(parts)), setup.ignored[rows], vocab)
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
        ``M``) into ``sink``; ``sparse`` as :meth:`grad_pass`."""
        setup = self.setup
        cdt = setup.compute_dtype
        in_tile = self.triton and not (sparse is not None and cdt != z.dtype)  # into the sink's buffer
        if not self.triton:
            inv_t = None if setup.fold else setup.row_inv_t(rows)
            gz = self.cap_slope_(
                _torch_grad_(
                    z, self.like("e", z), coef, self.label_columns(rows)[:2], inv_t, setup.mean_weights
                ),
                rows,
            )
        else:  # sparse terms on a narrower compute dtype: added in fp32, then rounded
            out, dtype = (sink.tile(rows), cdt) if in_tile else (None, z.dtype)
            gz = _triton_grad(setup, z, rows, 0, big_m, coef, out=out, dtype=dtype)
        if sparse is not None:
            self._scatter_sparse(gz, rows, 0, sparse)
        if in_tile:
            sink.commit(rows)
        else:
            sink._hold(rows, gz)

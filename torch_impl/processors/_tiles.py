"""The torch path of ``linear_logprobs``: tiles of ``token_chunk`` rows by
``vocab_chunk`` vocabulary entries whose logits are formed with ``torch.mm`` and
reduced with torch ops (the CPU path, and the in-repo reference of the Triton
kernels).

Forward: an online logsumexp over the tiles (running max, rescaled sum of
exponentials and, for the entropy, the rescaled sum of ``p * (z - max)``),
accumulated in fp32 (fp64 for fp64 inputs), combined across vocab shards with
one all-reduce max and one all-reduce sum (:func:`combine`, shared with the
Triton path). Backward: the tile logits are recomputed and turned into the
gradients of the hidden states and of the weight shard tile by tile.
"""

from __future__ import annotations

import dataclasses

import torch

from ._setup import TileSetup

__all__ = [
    "Stats",
    "TileBuffers",
    "backward_tiles",
    "combine",
    "forward_stats",
    "local_stats",
    "logit_grad_coefficients",
    "addmm_into",
    "gemm_into",
    "mm_into",
    "rowdot",
    "scaled_hidden",
    "target_in_tile",
    "tile_grad_",
    "tile_inv_t",
    "unfold_dh_",
    "weight_chunk",
]


def scaled_hidden(h: torch.Tensor, setup: TileSetup) -> torch.Tensor:
    """``h`` in the compute dtype, rows times ``inv_t`` when folded: ``z / T = (h / T) @ W.T``."""
    hs = h.detach().to(setup.compute_dtype)
    if setup.fold:
        if isinstance(setup.inv_t, torch.Tensor):
            hs = hs * setup.inv_t.to(hs.dtype)[:, None]
        elif setup.inv_t != 1.0:
            hs = hs * setup.inv_t
    return hs


class TileBuffers:
    """Reused tile buffers (one allocation per name), so that the loops do not
    allocate and page-fault a fresh tile each step."""

    def __init__(self, setup: TileSetup, device: torch.device) -> None:
        self.setup = setup
        self.device = device
        self._bufs: dict[str, torch.Tensor] = {}

    def view(self, name: str, r: int, c: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < r * c or buf.dtype != dtype:
            buf = torch.empty(r * c, dtype=dtype, device=self.device)
            self._bufs[name] = buf
        return buf[: r * c].view(r, c)

    def logits(self, hs: torch.Tensor, wc: torch.Tensor, rows: slice) -> torch.Tensor:
        """The tempered logits ``[rows, cols]`` of one tile, in the accumulation dtype."""
        setup = self.setup
        x = hs[rows]
        z = mm_into(self.view("mm", x.shape[0], wc.shape[0], setup.acc_dtype), x, wc.T)
        if not setup.fold:
            if isinstance(setup.inv_t, torch.Tensor):
                z.mul_(setup.inv_t[rows, None])
            elif setup.inv_t != 1.0:
                z.mul_(setup.inv_t)
        return z

    def exp(self, z: torch.Tensor) -> torch.Tensor:
        return torch.exp(z, out=self.view("exp", z.shape[0], z.shape[1], z.dtype))


def weight_chunk(w: torch.Tensor, j0: int, j1: int, setup: TileSetup) -> torch.Tensor:
    return w.detach()[j0:j1].to(setup.compute_dtype)


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(1)`` without the ``[rows, cols]`` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def target_in_tile(labels_local: torch.Tensor, j0: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hit [rows], col [rows, 1])``: which rows have their label in columns ``[j0, j0 + cols)``."""
    col = labels_local - j0
    hit = (col >= 0) & (col < cols)
    return hit, col.clamp(0, cols - 1).unsqueeze(1)


def local_stats(
    hs: torch.Tensor, w: torch.Tensor, setup: TileSetup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """This shard's online-logsumexp statistics, each ``[n]``::

    z = (h @ w.T) / T                       # never materialised: tile by tile
    m = z.max(1)
    s = exp(z - m[:, None]).sum(1)
    t = (exp(z - m[:, None]) * (z - m[:, None])).sum(1)     # with entropy
    zy = z[i, labels_local[i]]  (0 where the label is elsewhere)
    """
    n, local = hs.shape[0], w.shape[0]
    acc = setup.acc_dtype
    m = torch.full((n,), float("-inf"), dtype=acc, device=hs.device)
    s = torch.zeros(n, dtype=acc, device=hs.device)
    t = torch.zeros(n, dtype=acc, device=hs.device) if setup.with_entropy else None
    zy = torch.zeros(n, dtype=acc, device=hs.device)
    tiles = TileBuffers(setup, hs.device)
    for j0 in range(0, local, setup.vocab_chunk):
        j1 = min(j0 + setup.vocab_chunk, local)
        wc = weight_chunk(w, j0, j1, setup)
        for i0 in range(0, n, setup.token_chunk):
            rows = slice(i0, min(i0 + setup.token_chunk, n))
            z = tiles.logits(hs, wc, rows)
            hit, col = target_in_tile(setup.labels_local[rows], j0, j1 - j0)
            zy[rows] += torch.where(hit, z.gather(1, col).squeeze(1), 0.0)
            cm = z.amax(1)
            first = j0 == 0
            m_old = m[rows]
            m_new = cm if first else torch.maximum(m_old, cm)
            z.sub_(m_new[:, None])
            e = tiles.exp(z)
            se = e.sum(1)
            if first:
                s[rows] = se
                if t is not None:
                    t[rows] = rowdot(e, z)
            else:
                a = torch.exp(m_old - m_new)
                if t is not None:
                    t[rows] = a * (t[rows] + (m_old - m_new) * s[rows]) + rowdot(e, z)
                s[rows] = s[rows] * a + se
            m[rows] = m_new
    return m, s, t, zy


@dataclasses.dataclass(frozen=True)
class Stats:
    """The global statistics of every token, ``[n]`` each (replicated on every shard)."""

    max: torch.Tensor  # M = max_j z_j
    sumexp: torch.Tensor  # S = sum_j exp(z_j - M)   (>= 1)
    logprobs: torch.Tensor  # z_y - M - log S, 0 where ignored
    entropy: torch.Tensor | None  # log S - sum_j exp(z_j - M) (z_j - M) / S   (>= 0)


def combine(
    m: torch.Tensor,
    s: torch.Tensor,
    t: torch.Tensor | None,
    zy: torch.Tensor,
    setup: TileSetup,
    rows: slice = slice(None),
) -> Stats:
    """Combine the shards' statistics of the tokens ``rows``: one all-reduce max, one
    all-reduce sum."""
    coll = setup.collectives
    big_m = coll.all_reduce_max(m) if coll is not None else m
    a = torch.exp(m - big_m)
    has_target = setup.labels_local[rows] >= 0
    parts = [s * a, torch.where(has_target, zy - big_m, 0.0)]
    if t is not None:
        parts.append(a * (t + (m - big_m) * s))
    summed = torch.stack(parts)
    if coll is not None:
        summed = coll.all_reduce_sum(summed)
    big_s, zy_shifted = summed[0], summed[1]
    log_s = torch.log(big_s)
    logprobs = torch.where(setup.ignored[rows], 0.0, zy_shifted - log_s)
    entropy = log_s - summed[2] / big_s if t is not None else None
    return Stats(max=big_m, sumexp=big_s, logprobs=logprobs, entropy=entropy)


def forward_stats(hs: torch.Tensor, w: torch.Tensor, setup: TileSetup) -> Stats:
    return combine(*local_stats(hs, w, setup), setup)


_GEMM_OUT_DTYPE = (
    "dtype_out" in torch.ops.aten.mm.overloads() and "dtype_out" in torch.ops.aten.addmm.overloads()
)


def _out_dtype_gemm(a: torch.Tensor) -> bool:
    """cuBLAS multiplies bf16/fp16 operands into an fp32 output here
    (``torch.mm(..., out_dtype=torch.float32)``, CUDA only, recent torch)."""
    return _GEMM_OUT_DTYPE and a.is_cuda


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` with ``out`` in the accumulation dtype (fp32/fp64): operands of
    ``out``'s dtype multiply straight into it; bf16/fp16 operands go through
    ``torch.mm(a, b, out_dtype=torch.float32, out=out)`` on CUDA (fp32 accumulation,
    one fp32 result, no copy of either operand), else are upcast first (the products
    of bf16 numbers are exact in fp32, so the result is the same)."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        return torch.mm(a, b, out=out)
    if _out_dtype_gemm(a):
        return torch.mm(a, b, out_dtype=out.dtype, out=out)
    return torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


def addmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out += a @ b`` in place, dtypes as :func:`mm_into` (``torch.addmm(out, a, b,
    out_dtype=torch.float32, out=out)`` for bf16/fp16 operands on CUDA)."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        return out.addmm_(a, b)
    if _out_dtype_gemm(a):
        try:
            return torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        except RuntimeError:  # a release whose addmm(out_dtype) takes no fp32 accumulator
            return out.add_(torch.mm(a, b, out_dtype=out.dtype))
    return out.addmm_(a.to(out.dtype), b.to(out.dtype))


def gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool) -> torch.Tensor:
    """``out = a @ b`` for the first product into ``out``, ``out += a @ b`` after: an
    accumulator is written by its first GEMM, never zero-filled."""
    return mm_into(out, a, b) if first else addmm_into(out, a, b)


def logit_grad_coefficients(
    stats: Stats,
    g_lp: torch.Tensor | None,
    g_h: torch.Tensor | None,
    ignored: torch.Tensor,
    acc_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-row ``(a, b, g)`` such that the gradient of the tempered logits is::

        dz_j = -exp(z_j - M) * (a + b * (z_j - M)) + g * [j == y]

    From ``d logprob / dz_j = [j == y] - p_j`` and ``d entropy / dz_j = -p_j
    (log p_j + H)`` with ``p_j = exp(z_j - M) / S`` and ``log p_j = z_j - M - log S``.
    """
    n = stats.max.shape[0]
    g = torch.zeros(n, dtype=acc_dtype, device=stats.max.device) if g_lp is None else g_lp.to(acc_dtype)
    g = torch.where(ignored, 0.0, g)
    inv_s = 1.0 / stats.sumexp
    if g_h is None or stats.entropy is None:
        return g * inv_s, None, g
    gh = g_h.to(acc_dtype)
    a = (g + gh * (stats.entropy - torch.log(stats.sumexp))) * inv_s
    return a, gh * inv_s, g


def tile_grad_(
    z: torch.Tensor,
    e: torch.Tensor,
    coef: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
    labels_local: torch.Tensor,
    j0: int,
    inv_t: torch.Tensor | float | None,
) -> torch.Tensor:
    """The logits gradient of one tile, in place in ``e``: ``z`` holds ``z - M``,
    ``e`` holds ``exp(z - M)`` (may be ``z`` itself when ``b`` is None); ``coef``
    is the tile's rows of :func:`logit_grad_coefficients`. ``inv_t``: the
    temperature factor to apply here (None when folded into the hidden rows)."""
    a, b, g = coef
    if b is None:
        gz = e.mul_(-a[:, None])
    else:
        gz = e.mul_(z.mul_(-b[:, None]).sub_(a[:, None]))
    hit, col = target_in_tile(labels_local, j0, z.shape[1])
    gz.scatter_add_(1, col, torch.where(hit, g, 0.0).unsqueeze(1))
    if isinstance(inv_t, torch.Tensor):
        gz.mul_(inv_t[:, None])
    elif inv_t is not None and inv_t != 1.0:
        gz.mul_(inv_t)
    return gz


def tile_inv_t(setup: TileSetup, rows: slice) -> torch.Tensor | float | None:
    """The temperature factor a tile gradient still needs (None when folded)."""
    if setup.fold:
        return None
    return setup.inv_t[rows] if isinstance(setup.inv_t, torch.Tensor) else setup.inv_t


def unfold_dh_(dh: torch.Tensor, setup: TileSetup) -> torch.Tensor:
    """``dh = d(hs) * inv_t`` when the temperature was folded into the hidden rows."""
    if setup.fold:
        if isinstance(setup.inv_t, torch.Tensor):
            dh.mul_(setup.inv_t[:, None])
        elif setup.inv_t != 1.0:
            dh.mul_(setup.inv_t)
    return dh


def backward_tiles(
    hs: torch.Tensor,
    w: torch.Tensor,
    setup: TileSetup,
    stats: Stats,
    coef: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
    *,
    need_dh: bool,
    need_dw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dh, dw)`` by recomputing each tile's logits (vocab chunks outer, so each
    weight-gradient chunk is finished before the next). ``dh`` (the gradient of the
    unscaled hidden rows) is in the accumulation dtype, ``dw`` in ``w``'s dtype; each
    accumulator is written by its first GEMM, then added to (no zero fill)::

        dh[rows] (+)= gz @ w[chunk]          # + from the second vocab chunk on
        dw[chunk] (+)= gz.T @ hs[rows]       # + from the second row tile on
    """
    n, local = hs.shape[0], w.shape[0]
    a, b, g = coef
    acc = setup.acc_dtype
    dh = None
    if need_dh:  # an empty shard contributes nothing: zeros, not an unwritten buffer
        dh = torch.empty(hs.shape, dtype=acc, device=hs.device) if local else torch.zeros_like(hs, dtype=acc)
    dw = torch.empty(w.shape, dtype=w.dtype, device=w.device) if need_dw else None
    tiles = TileBuffers(setup, hs.device)
    for j0 in range(0, local, setup.vocab_chunk):
        j1 = min(j0 + setup.vocab_chunk, local)
        wc = weight_chunk(w, j0, j1, setup)
        dwc = None
        if dw is not None:
            dwc = dw[j0:j1] if dw.dtype == acc else tiles.view("dw", j1 - j0, w.shape[1], acc)
        for i0 in range(0, n, setup.token_chunk):
            rows = slice(i0, min(i0 + setup.token_chunk, n))
            z = tiles.logits(hs, wc, rows)
            z.sub_(stats.max[rows, None])
            e = z.exp_() if b is None else tiles.exp(z)
            rows_coef = (a[rows], None if b is None else b[rows], g[rows])
            gz = tile_grad_(z, e, rows_coef, setup.labels_local[rows], j0, tile_inv_t(setup, rows))
            gzc = gz.to(setup.compute_dtype)
            if dh is not None:
                gemm_into(dh[rows], gzc, wc, first=j0 == 0)
            if dwc is not None:
                gemm_into(dwc, gzc.T, hs[rows], first=i0 == 0)
        if dw is not None and dwc is not None:
            if n == 0:
                dw[j0:j1].zero_()  # no rows: no GEMM wrote the chunk
            elif dwc.data_ptr() != dw[j0:j1].data_ptr():
                dw[j0:j1].copy_(dwc)
    return (unfold_dh_(dh, setup) if dh is not None else None), dw

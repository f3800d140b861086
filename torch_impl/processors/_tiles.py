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

from ._setup import Plan

__all__ = [
    "Stats",
    "TileBuffers",
    "backward_tiles",
    "combine",
    "forward_stats",
    "local_stats",
    "logit_grad_coefficients",
    "mm_acc",
    "mm_into",
    "rowdot",
    "scaled_hidden",
    "target_in_tile",
    "tile_grad_",
    "tile_inv_t",
    "unfold_dh_",
    "weight_chunk",
]


def scaled_hidden(h: torch.Tensor, plan: Plan) -> torch.Tensor:
    """``h`` in the compute dtype, rows times ``inv_t`` when folded: ``z / T = (h / T) @ W.T``."""
    hs = h.detach().to(plan.compute_dtype)
    if plan.fold:
        if isinstance(plan.inv_t, torch.Tensor):
            hs = hs * plan.inv_t.to(hs.dtype)[:, None]
        elif plan.inv_t != 1.0:
            hs = hs * plan.inv_t
    return hs


class TileBuffers:
    """Reused tile buffers (one allocation per name), so that the loops do not
    allocate and page-fault a fresh tile each step."""

    def __init__(self, plan: Plan, device: torch.device) -> None:
        self.plan = plan
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
        plan = self.plan
        x = hs[rows]
        if plan.compute_dtype == plan.acc_dtype:
            z = torch.mm(x, wc.T, out=self.view("mm", x.shape[0], wc.shape[0], plan.compute_dtype))
        else:
            z = mm_acc(x, wc.T, plan.acc_dtype)
        if not plan.fold:
            if isinstance(plan.inv_t, torch.Tensor):
                z.mul_(plan.inv_t[rows, None])
            elif plan.inv_t != 1.0:
                z.mul_(plan.inv_t)
        return z

    def exp(self, z: torch.Tensor) -> torch.Tensor:
        return torch.exp(z, out=self.view("exp", z.shape[0], z.shape[1], z.dtype))


def weight_chunk(w: torch.Tensor, j0: int, j1: int, plan: Plan) -> torch.Tensor:
    return w.detach()[j0:j1].to(plan.compute_dtype)


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(1)`` without the ``[rows, cols]`` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def target_in_tile(labels_local: torch.Tensor, j0: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hit [rows], col [rows, 1])``: which rows have their label in columns ``[j0, j0 + cols)``."""
    col = labels_local - j0
    hit = (col >= 0) & (col < cols)
    return hit, col.clamp(0, cols - 1).unsqueeze(1)


def local_stats(
    hs: torch.Tensor, w: torch.Tensor, plan: Plan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """This shard's online-logsumexp statistics, each ``[n]``::

    z = (h @ w.T) / T                       # never materialised: tile by tile
    m = z.max(1)
    s = exp(z - m[:, None]).sum(1)
    t = (exp(z - m[:, None]) * (z - m[:, None])).sum(1)     # with entropy
    zy = z[i, labels_local[i]]  (0 where the label is elsewhere)
    """
    n, local = hs.shape[0], w.shape[0]
    acc = plan.acc_dtype
    m = torch.full((n,), float("-inf"), dtype=acc, device=hs.device)
    s = torch.zeros(n, dtype=acc, device=hs.device)
    t = torch.zeros(n, dtype=acc, device=hs.device) if plan.with_entropy else None
    zy = torch.zeros(n, dtype=acc, device=hs.device)
    tiles = TileBuffers(plan, hs.device)
    for j0 in range(0, local, plan.vocab_chunk):
        j1 = min(j0 + plan.vocab_chunk, local)
        wc = weight_chunk(w, j0, j1, plan)
        for i0 in range(0, n, plan.token_chunk):
            rows = slice(i0, min(i0 + plan.token_chunk, n))
            z = tiles.logits(hs, wc, rows)
            hit, col = target_in_tile(plan.labels_local[rows], j0, j1 - j0)
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


def combine(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor | None, zy: torch.Tensor, plan: Plan) -> Stats:
    """Combine the shards' statistics: one all-reduce max, one all-reduce sum."""
    coll = plan.collectives
    big_m = coll.all_reduce_max(m) if coll is not None else m
    a = torch.exp(m - big_m)
    has_target = plan.labels_local >= 0
    parts = [s * a, torch.where(has_target, zy - big_m, 0.0)]
    if t is not None:
        parts.append(a * (t + (m - big_m) * s))
    summed = torch.stack(parts)
    if coll is not None:
        summed = coll.all_reduce_sum(summed)
    big_s, zy_shifted = summed[0], summed[1]
    log_s = torch.log(big_s)
    logprobs = torch.where(plan.ignored, 0.0, zy_shifted - log_s)
    entropy = log_s - summed[2] / big_s if t is not None else None
    return Stats(max=big_m, sumexp=big_s, logprobs=logprobs, entropy=entropy)


def forward_stats(hs: torch.Tensor, w: torch.Tensor, plan: Plan) -> Stats:
    return combine(*local_stats(hs, w, plan), plan)


def mm_acc(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``dtype``: bf16/fp16 products come out in fp32 unrounded where
    the backend can (``out_dtype`` on CUDA), else rounded once and cast."""
    if a.dtype == dtype and b.dtype == dtype:
        return torch.mm(a, b)
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=dtype)
        except (TypeError, RuntimeError):
            pass
    return torch.mm(a, b).to(dtype)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with ``out`` in the accumulation dtype."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out.add_(mm_acc(a, b, out.dtype))


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


def tile_inv_t(plan: Plan, rows: slice) -> torch.Tensor | float | None:
    """The temperature factor a tile gradient still needs (None when folded)."""
    if plan.fold:
        return None
    return plan.inv_t[rows] if isinstance(plan.inv_t, torch.Tensor) else plan.inv_t


def unfold_dh_(dh: torch.Tensor, plan: Plan) -> torch.Tensor:
    """``dh = d(hs) * inv_t`` when the temperature was folded into the hidden rows."""
    if plan.fold:
        if isinstance(plan.inv_t, torch.Tensor):
            dh.mul_(plan.inv_t[:, None])
        elif plan.inv_t != 1.0:
            dh.mul_(plan.inv_t)
    return dh


def backward_tiles(
    hs: torch.Tensor,
    w: torch.Tensor,
    plan: Plan,
    stats: Stats,
    coef: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
    *,
    need_dh: bool,
    need_dw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dh, dw)`` by recomputing each tile's logits (vocab chunks outer, so
    each weight-gradient chunk is written once). ``dh`` (the gradient of the
    unscaled hidden rows) is in the accumulation dtype, ``dw`` in ``w``'s dtype."""
    n, local = hs.shape[0], w.shape[0]
    a, b, g = coef
    dh = torch.zeros(hs.shape, dtype=plan.acc_dtype, device=hs.device) if need_dh else None
    dw = torch.empty(w.shape, dtype=w.dtype, device=w.device) if need_dw else None
    tiles = TileBuffers(plan, hs.device)
    for j0 in range(0, local, plan.vocab_chunk):
        j1 = min(j0 + plan.vocab_chunk, local)
        wc = weight_chunk(w, j0, j1, plan)
        dwc = None
        if dw is not None:
            direct = dw.dtype == plan.acc_dtype
            dwc = (
                dw[j0:j1].zero_() if direct else torch.zeros(wc.shape, dtype=plan.acc_dtype, device=w.device)
            )
        for i0 in range(0, n, plan.token_chunk):
            rows = slice(i0, min(i0 + plan.token_chunk, n))
            z = tiles.logits(hs, wc, rows)
            z.sub_(stats.max[rows, None])
            e = z.exp_() if b is None else tiles.exp(z)
            rows_coef = (a[rows], None if b is None else b[rows], g[rows])
            gz = tile_grad_(z, e, rows_coef, plan.labels_local[rows], j0, tile_inv_t(plan, rows))
            gzc = gz.to(plan.compute_dtype)
            if dh is not None:
                mm_into(dh[rows], gzc, wc)
            if dwc is not None:
                mm_into(dwc, gzc.T, hs[rows])
        if dw is not None and dwc is not None and dwc.data_ptr() != dw[j0:j1].data_ptr():
            dw[j0:j1].copy_(dwc)
    return (unfold_dh_(dh, plan) if dh is not None else None), dw

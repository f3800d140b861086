"""Selected-token logprobs and entropy from hidden states and a vocab shard, without
materialising the ``[n, V]`` logits.

Forward: an online logsumexp over tiles of ``token_chunk_size`` rows by
``chunk_size`` vocabulary entries (running max, rescaled sum of exponentials and,
for the entropy, the rescaled sum of ``p * (z - max)``), accumulated in fp32
(fp64 for fp64 inputs), combined across vocab shards with one all-reduce max and
one all-reduce sum. Backward: the tile logits are recomputed and turned into the
gradients of the hidden states and of the weight shard tile by tile.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hookspec import IGNORE_INDEX, Collectives, ContractError
from hookspec.arrays import format_shape

from ._checks import check_floating, check_temperature, check_token_labels, resolve_compute_dtype

__all__ = [
    "DEFAULT_TOKEN_CHUNK",
    "DEFAULT_VOCAB_CHUNK",
    "LogprobResult",
    "linear_logprobs",
]

DEFAULT_VOCAB_CHUNK = 4096
"""Vocabulary entries per tile (columns of a logits tile)."""

DEFAULT_TOKEN_CHUNK = 1024
"""Tokens per tile (rows of a logits tile): a tile is 16 MiB in fp32 by default."""


@dataclasses.dataclass(frozen=True)
class LogprobResult:
    """Per-token results of :func:`linear_logprobs`, fp32 (fp64 for fp64 inputs).

    ``logprobs``: ``[n]``, ``0.0`` where the label is the ignore index.
    ``entropy``: ``[n]`` (every token, whatever its label), or ``None`` when not
    requested.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the tile loops need, validated; built by :func:`make_plan`."""

    labels_local: torch.Tensor  # [n] long: row of the label in this shard, or -1
    ignored: torch.Tensor  # [n] bool
    inv_t: torch.Tensor | float  # [n] or a number: 1 / temperature (times the logit scale)
    fold: bool  # inv_t is folded into the hidden rows (compute dtype fp32/fp64)
    compute_dtype: torch.dtype
    acc_dtype: torch.dtype
    vocab_chunk: int
    token_chunk: int
    collectives: Collectives | None
    with_entropy: bool


def _check_chunk(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ContractError(name, expected="an int >= 1", actual=repr(value))
    return value


def make_plan(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor,
    logit_scale: float,
    ignore_index: int,
    with_entropy: bool,
    vocab_start: int,
    vocab_size: int | None,
    collectives: Collectives | None,
    chunk_size: int,
    token_chunk_size: int,
    compute_dtype: torch.dtype | None,
    check_values: bool,
) -> Plan:
    """Validate the inputs of one call (``h`` already gathered) and build its :class:`Plan`."""
    n, hidden = h.shape
    if weight.dim() != 2 or weight.shape[1] != hidden:
        raise ContractError(
            "weight", expected=f"shape [V_local, h={hidden}]", actual=format_shape(weight.shape)
        )
    if weight.device != h.device:
        raise ContractError("weight", expected=f"on {h.device}", actual=str(weight.device))
    local = int(weight.shape[0])
    if not isinstance(vocab_start, int) or vocab_start < 0:
        raise ContractError("vocab_start", expected="an int >= 0", actual=repr(vocab_start))
    if vocab_size is None:
        vocab_size = vocab_start + local
    if not isinstance(vocab_size, int) or vocab_size < vocab_start + local:
        raise ContractError(
            "vocab_size",
            expected=f"an int >= vocab_start + V_local = {vocab_start + local}",
            actual=repr(vocab_size),
        )
    labels = check_token_labels(labels, n, vocab_size, ignore_index, check_values=check_values)
    labels = labels.to(device=h.device, dtype=torch.long)
    t = check_temperature(temperature, n)
    if not (isinstance(logit_scale, (int, float)) and logit_scale > 0):
        raise ContractError("logit_scale", expected="a number > 0", actual=repr(logit_scale))
    inv_t: torch.Tensor | float = (
        (logit_scale / t).to(h.device) if isinstance(t, torch.Tensor) else float(logit_scale) / t
    )
    cdtype = resolve_compute_dtype(h.device, h.dtype, compute_dtype)
    acc = torch.float64 if cdtype == torch.float64 else torch.float32
    if isinstance(inv_t, torch.Tensor):
        inv_t = inv_t.to(acc)
    ignored = labels == ignore_index
    local_row = labels - vocab_start
    in_shard = (local_row >= 0) & (local_row < local) & ~ignored
    return Plan(
        labels_local=torch.where(in_shard, local_row, -1),
        ignored=ignored,
        inv_t=inv_t,
        fold=cdtype in (torch.float32, torch.float64),
        compute_dtype=cdtype,
        acc_dtype=acc,
        vocab_chunk=_check_chunk("chunk_size", chunk_size),
        token_chunk=_check_chunk("token_chunk_size", token_chunk_size),
        collectives=collectives,
        with_entropy=with_entropy,
    )


# ---------------------------------------------------------------- tile kernels


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


# ---------------------------------------------------------------- autograd


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
        hs = scaled_hidden(h, plan)
        stats = forward_stats(hs, w, plan)
        ctx.set_materialize_grads(False)
        ctx.plan = plan
        ctx.stats = dataclasses.replace(stats, logprobs=stats.logprobs.detach())
        ctx.save_for_backward(h, w)
        entropy = stats.entropy if stats.entropy is not None else stats.logprobs.new_empty(0)
        if stats.entropy is None:
            ctx.mark_non_differentiable(entropy)
        return stats.logprobs, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_h: torch.Tensor | None) -> tuple[Any, ...]:
        h, w = ctx.saved_tensors
        plan: Plan = ctx.plan
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_h is None) or not (need_dh or need_dw):
            return None, None, None
        stats: Stats = ctx.stats
        coef = logit_grad_coefficients(stats, g_lp, g_h, plan.ignored, plan.acc_dtype)
        hs = scaled_hidden(h, plan)
        dh, dw = backward_tiles(hs, w, plan, stats, coef, need_dh=need_dh, need_dw=need_dw)
        return (dh.to(h.dtype) if dh is not None else None), dw, None


def gather_rows(hidden: torch.Tensor, collectives: Collectives | None) -> torch.Tensor:
    """The full rows every vocab shard needs: ``collectives.gather_hidden_states``,
    whose backward sums the shards' hidden-state gradients (all-reduce, or
    reduce-scatter under sequence parallel)."""
    return collectives.gather_hidden_states(hidden) if collectives is not None else hidden


def check_hidden(hidden: Any) -> torch.Tensor:
    check_floating("hidden", hidden)
    if hidden.dim() != 2:
        raise ContractError("hidden", expected="2 dims [n, h]", actual=format_shape(hidden.shape))
    return hidden


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    /,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = IGNORE_INDEX,
    with_entropy: bool = False,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    collectives: Collectives | None = None,
    chunk_size: int = DEFAULT_VOCAB_CHUNK,
    token_chunk_size: int = DEFAULT_TOKEN_CHUNK,
    compute_dtype: torch.dtype | None = None,
    logit_scale: float = 1.0,
    check_values: bool = True,
) -> LogprobResult:
    """Selected-token logprobs (and entropy) of ``hidden @ weight.T``, vocab-parallel,
    never materialising the logits. Equal to::

        z = gather(hidden) @ weight_full.T * logit_scale / T     # [n, V], fp32
        logprobs = where(labels == ignore_index, 0, log_softmax(z)[arange(n), labels])
        entropy = logsumexp(z) - (softmax(z) * z).sum(-1)        # >= 0

    where ``weight_full`` stacks every rank's shard and ``gather`` is
    ``collectives.gather_hidden_states`` (sequence parallel).

    Args:
        hidden: ``[n_local, h]``: this rank's rows (``hidden_states.reshape(-1,
            h)`` of the hook's ``[s, b, h]``; ``n / tp`` rows under sequence
            parallel). Gathered here through ``collectives``, so its gradient
            holds every shard's contribution.
        weight: ``[V_local, h]``, this rank's vocab shard, rows
            ``[vocab_start, vocab_start + V_local)`` of the vocabulary.
        labels: ``[n]`` global token ids of the gathered rows, or ``ignore_index``.
        temperature: ``T > 0``: a number or a tensor ``[n]`` (not differentiated).
        with_entropy: also return the entropy of ``softmax(z)``.
        vocab_size: the global vocabulary (default ``vocab_start + V_local``);
            labels outside ``[0, vocab_size)`` other than ``ignore_index`` raise.
        collectives: the ``hookspec.Collectives`` of the vocab-parallel group;
            ``None`` for one process.
        chunk_size, token_chunk_size: the tile, vocab entries by tokens.
        compute_dtype: the matmul dtype; default float32 on a CPU (fp64 stays
            fp64), the input dtype elsewhere.
        logit_scale: a constant factor on the logits (MuP's output multiplier).
        check_values: read the labels and a tensor temperature to check them.

    Returns:
        :class:`LogprobResult`, fp32 (fp64 for fp64 compute). NaN or inf in
        ``hidden`` or ``weight`` gives NaN at the tokens they touch, never a
        finite number.
    """
    check_hidden(hidden)
    check_floating("weight", weight)
    h = gather_rows(hidden, collectives)
    plan = make_plan(
        h,
        weight,
        labels,
        temperature=temperature,
        logit_scale=logit_scale,
        ignore_index=ignore_index,
        with_entropy=with_entropy,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        collectives=collectives,
        chunk_size=chunk_size,
        token_chunk_size=token_chunk_size,
        compute_dtype=compute_dtype,
        check_values=check_values,
    )
    logprobs, entropy = _LinearLogprobs.apply(h, weight, plan)
    return LogprobResult(logprobs=logprobs, entropy=entropy if with_entropy else None)

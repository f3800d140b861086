"""Top-k logprobs from the hidden states and a vocab shard, never materialising the
``[n, V]`` logits: :func:`linear_topk_logprobs` (the tensor function, vocab
parallel) and :func:`topk_logprobs` (the processor).

The tile loop here is its own (``torch.mm`` over tiles of ``token_chunk`` rows by
``vocab_chunk`` vocabulary entries, a running top-k and an online logsumexp per
row); the candidates of the vocab shards are merged with
``Collectives.all_gather`` (spec 1.2).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import torch

from hookspec import (
    IGNORE_INDEX,
    Collectives,
    ContractError,
    OutputContext,
    Processor,
    processor,
    validate_context,
)
from hookspec.arrays import format_shape

from ..value_checks import check_labels_deferred
from ._checks import (
    check_bool,
    check_finite_number,
    check_floating,
    check_int,
    check_temperature,
    resolve_compute_dtype,
)
from ._inputs import from_tokens, logit_scale, resolve_temperature, tile_options, to_tokens
from ._setup import refuse_double_backward

__all__ = [
    "TOPK_TILES",
    "TopkResult",
    "gather_collective",
    "linear_topk_logprobs",
    "order_candidates",
    "topk_logprobs",
]

TOPK_TILES: dict[str, tuple[int, int]] = {"cpu": (1024, 4096), "cuda": (4096, 8192)}
"""``device.type -> (token_chunk, vocab_chunk)``: the tile when not given."""

_NO_ID = 1 << 62
"""The id of a padding candidate (a shard with fewer than ``k`` entries): after every real id."""


@dataclasses.dataclass(frozen=True)
class TopkResult:
    """What :func:`linear_topk_logprobs` returns, per gathered row (fp32; fp64 for fp64).

    ``logprobs`` ``[n, k]``: the ``k`` largest logprobs, descending (ties: the
    smaller id first). ``ids`` ``[n, k]`` int64: their global token ids.
    ``label_logprobs`` ``[n]``: the logprob of ``labels`` (0 where ignored), or
    ``None`` without labels. ``entropy`` ``[n]`` or ``None``.
    """

    logprobs: torch.Tensor
    ids: torch.Tensor
    label_logprobs: torch.Tensor | None
    entropy: torch.Tensor | None


def order_candidates(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, ids)`` ``[r, m]`` reordered per row by value descending, then id
    ascending (two stable sorts): the contract's order of a top-k."""
    ids_sorted, by_id = torch.sort(ids, dim=1, stable=True)
    vals = values.gather(1, by_id)
    vals, by_value = torch.sort(vals, dim=1, descending=True, stable=True)
    return vals, ids_sorted.gather(1, by_value)


def _tile_topk(z: torch.Tensor, k: int, first_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best ``(values, ids)`` of a tile ``z`` ``[r, c]`` (column ``j`` is id
    ``first_id + j``), in :func:`order_candidates` order, ``[r, min(k, c)]``.

    ``torch.topk`` picks the set; a row with more entries equal to its ``k``-th
    value than fit (a tie at the boundary) is sorted whole instead, so that the
    smaller ids win whatever ``torch.topk`` picked."""
    r, c = z.shape
    cols = torch.arange(first_id, first_id + c, device=z.device)
    if c <= k:
        return order_candidates(z, cols.expand(r, c))
    vals, idx = torch.topk(z, k, dim=1)
    tied = (z >= vals[:, -1:]).sum(1) > k
    vals, ids = order_candidates(vals, idx + first_id)
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        tv, ti = torch.sort(z[rows], dim=1, descending=True, stable=True)
        vals[rows], ids[rows] = tv[:, :k], ti[:, :k] + first_id
    return vals, ids


def gather_collective(collectives: Collectives | None, *, split: bool) -> Any:
    """``collectives.all_gather`` where the vocabulary is ``split`` over shards
    (``tp > 1``), else ``None``; a collectives object without it (spec < 1.2) raises."""
    if not split:
        return None
    if collectives is None:
        raise ContractError(
            "collectives",
            expected="the vocab-parallel group's Collectives (the weight is a shard)",
            actual="None",
        )
    fn = getattr(collectives, "all_gather", None)
    if not callable(fn):
        raise ContractError(
            "collectives.all_gather",
            expected="a Collectives with all_gather (spec 1.2) to merge the top-k of the vocab shards",
            actual=f"{type(collectives).__name__} without all_gather",
        )
    return fn


@dataclasses.dataclass(frozen=True)
class _TopkSetup:
    k: int
    k_local: int
    labels_local: torch.Tensor | None  # [n]: the label's row in this shard, or -1
    ignored: torch.Tensor | None  # [n] bool
    inv_t: torch.Tensor | float  # [n] or a number (temperature and logit scale)
    vocab_start: int
    compute_dtype: torch.dtype
    acc_dtype: torch.dtype
    token_chunk: int
    vocab_chunk: int
    collectives: Collectives | None
    gather: Any  # all_gather, or None at tp = 1
    with_entropy: bool


def _logits(x: torch.Tensor, wc: torch.Tensor, setup: _TopkSetup, rows: slice) -> torch.Tensor:
    """``(x @ wc.T) * inv_t`` in the accumulation dtype: one tile's tempered logits."""
    z = torch.mm(x.to(setup.compute_dtype), wc.T).to(setup.acc_dtype)
    inv_t = setup.inv_t
    if isinstance(inv_t, torch.Tensor):
        z.mul_(inv_t[rows, None])
    elif inv_t != 1.0:
        z.mul_(inv_t)
    return z


def _forward(h: torch.Tensor, w: torch.Tensor, setup: _TopkSetup) -> dict[str, torch.Tensor]:
    """Per row, one pass over this shard's tiles: the top ``k_local`` tempered logits
    and their ids, and the online logsumexp statistics ``m``, ``s`` (and ``t`` for
    the entropy, ``zy`` for the label); then the shards combined."""
    n, local = h.shape[0], w.shape[0]
    acc, k = setup.acc_dtype, setup.k
    dev = h.device
    m = torch.full((n,), float("-inf"), dtype=acc, device=dev)
    s = torch.zeros(n, dtype=acc, device=dev)
    t = torch.zeros(n, dtype=acc, device=dev)
    zy = torch.zeros(n, dtype=acc, device=dev)
    top_v = torch.full((n, k), float("-inf"), dtype=acc, device=dev)
    top_i = torch.full((n, k), _NO_ID, dtype=torch.long, device=dev)
    for i0 in range(0, n, setup.token_chunk):
        rows = slice(i0, min(i0 + setup.token_chunk, n))
        x = h[rows]
        run_v = run_i = None
        for j0 in range(0, local, setup.vocab_chunk):
            j1 = min(j0 + setup.vocab_chunk, local)
            z = _logits(x, w[j0:j1].to(setup.compute_dtype), setup, rows)
            tv, ti = _tile_topk(z, setup.k_local, setup.vocab_start + j0)
            if run_v is None or run_i is None:
                run_v, run_i = tv, ti
            else:
                run_v, run_i = order_candidates(torch.cat([run_v, tv], 1), torch.cat([run_i, ti], 1))
                run_v, run_i = run_v[:, : setup.k_local], run_i[:, : setup.k_local]
            if setup.labels_local is not None:
                col = setup.labels_local[rows] - j0
                hit = (col >= 0) & (col < j1 - j0)
                picked = z.gather(1, col.clamp(0, j1 - j0 - 1)[:, None]).squeeze(1)
                zy[rows] += torch.where(hit, picked, 0.0)
            cm = z.amax(1)
            m_old = m[rows]
            m_new = torch.maximum(m_old, cm)
            a = torch.exp(m_old - m_new)
            z.sub_(m_new[:, None])
            e = torch.exp(z)
            fresh = torch.isneginf(m_old)  # nothing accumulated yet
            if setup.with_entropy:  # t = sum exp(z - m) (z - m), rescaled to the new max
                rescaled = a * (t[rows] + (m_old - m_new) * s[rows])
                t[rows] = torch.where(fresh, 0.0, rescaled) + (e * z).sum(1)
            s[rows] = torch.where(fresh, 0.0, s[rows] * a) + e.sum(1)
            m[rows] = m_new
        assert run_v is not None and run_i is not None
        top_v[rows, : setup.k_local], top_i[rows, : setup.k_local] = run_v, run_i
    return _combine(m, s, t, zy, top_v, top_i, setup)


def _combine(
    m: torch.Tensor,
    s: torch.Tensor,
    t: torch.Tensor,
    zy: torch.Tensor,
    top_v: torch.Tensor,
    top_i: torch.Tensor,
    setup: _TopkSetup,
) -> dict[str, torch.Tensor]:
    """The shards' statistics combined (one all-reduce max, one all-reduce sum) and
    their candidates merged (one all-gather each of values and ids)::

        M = all_reduce_max(m);  S = all_reduce_sum(s * exp(m - M));  lse = M + log S
        top = first k of order_candidates(all shards' candidates)
        logprobs = top_values - lse
    """
    coll = setup.collectives
    big_m = coll.all_reduce_max(m) if coll is not None else m
    a = torch.exp(m - big_m)
    has = setup.labels_local >= 0 if setup.labels_local is not None else None
    parts = [s * a, zy if has is None else torch.where(has, zy, 0.0)]
    if setup.with_entropy:
        parts.append(a * (t + (m - big_m) * s))
    summed = torch.stack(parts)
    if coll is not None:
        summed = coll.all_reduce_sum(summed)
    big_s = summed[0]
    lse = big_m + torch.log(big_s)
    if setup.gather is not None:
        n, k = top_v.shape
        gv, gi = setup.gather(top_v), setup.gather(top_i)  # [tp, n, k]
        top_v, top_i = order_candidates(
            gv.permute(1, 0, 2).reshape(n, -1), gi.permute(1, 0, 2).reshape(n, -1)
        )
        top_v, top_i = top_v[:, :k].contiguous(), top_i[:, :k].contiguous()
    out = {"lse": lse, "values": top_v - lse[:, None], "ids": top_i}
    if setup.labels_local is not None and setup.ignored is not None:
        out["label"] = torch.where(setup.ignored, 0.0, summed[1] - lse)
    if setup.with_entropy:
        out["entropy"] = torch.log(big_s) - summed[2] / big_s
    return out


def _row_factor(setup: _TopkSetup, rows: slice) -> torch.Tensor | float:
    return setup.inv_t[rows, None] if isinstance(setup.inv_t, torch.Tensor) else setup.inv_t


def _sparse_backward(
    h: torch.Tensor,
    w: torch.Tensor,
    cols: torch.Tensor,
    g: torch.Tensor,
    setup: _TopkSetup,
    dh: torch.Tensor | None,
    dw: torch.Tensor | None,
) -> None:
    """``dz[i, cols[i, j]] += g[i, j]`` for the columns in this shard (``cols`` local
    rows of ``w``, ``-1`` elsewhere), without a logits tile: ``O(n k h)``."""
    here = cols >= 0
    g = torch.where(here, g, 0.0)
    safe = cols.clamp(min=0)
    for i0 in range(0, h.shape[0], setup.token_chunk):
        rows = slice(i0, min(i0 + setup.token_chunk, h.shape[0]))
        gr = g[rows] * _row_factor(setup, rows)  # [r, k]
        if dh is not None:
            wsel = w[safe[rows]].to(setup.acc_dtype)  # [r, k, h]
            dh[rows] += torch.bmm(gr.unsqueeze(1), wsel).squeeze(1)
        if dw is not None:
            contrib = gr.unsqueeze(2) * h[rows].to(setup.acc_dtype).unsqueeze(1)  # [r, k, h]
            dw.index_add_(0, safe[rows].reshape(-1), contrib.reshape(-1, h.shape[1]).to(dw.dtype))


def _dense_backward(
    h: torch.Tensor,
    w: torch.Tensor,
    lse: torch.Tensor,
    c: torch.Tensor,
    g_ent: torch.Tensor | None,
    entropy: torch.Tensor | None,
    setup: _TopkSetup,
    dh: torch.Tensor | None,
    dw: torch.Tensor | None,
) -> None:
    """The logsumexp and entropy terms: ``dz = -p * (c + g_ent * (log p + H))`` with
    ``p = softmax(z)``, the tile logits recomputed (3 GEMMs: logits, ``dh``, ``dw``)."""
    n, local = h.shape[0], w.shape[0]
    for j0 in range(0, local, setup.vocab_chunk):
        j1 = min(j0 + setup.vocab_chunk, local)
        wc = w[j0:j1].to(setup.compute_dtype)
        for i0 in range(0, n, setup.token_chunk):
            rows = slice(i0, min(i0 + setup.token_chunk, n))
            logp = _logits(h[rows], wc, setup, rows).sub_(lse[rows, None])
            p = torch.exp(logp)
            coef = c[rows, None]
            if g_ent is not None and entropy is not None:
                coef = coef + g_ent[rows, None] * (logp + entropy[rows, None])
            gz = (-p * coef) * _row_factor(setup, rows)
            gzc = gz.to(setup.compute_dtype)
            if dh is not None:
                dh[rows] += torch.mm(gzc, wc).to(setup.acc_dtype)
            if dw is not None:
                dw[j0:j1] += torch.mm(gzc.T, h[rows].to(setup.compute_dtype)).to(dw.dtype)


class _TopkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, setup: _TopkSetup) -> tuple[torch.Tensor, ...]:
        hd, wd = h.detach(), w.detach()
        out = _forward(hd, wd, setup)
        ctx.set_materialize_grads(False)
        ctx.setup = setup
        ctx.save_for_backward(h, w)
        ctx.stats = (out["lse"], out["ids"], out.get("entropy"))
        empty = out["lse"].new_empty(0)
        label, entropy = out.get("label", empty), out.get("entropy", empty)
        ctx.mark_non_differentiable(out["ids"])
        return out["values"], out["ids"], label, entropy

    @staticmethod
    def backward(
        ctx: Any,
        g_val: torch.Tensor | None,
        _g_ids: Any,
        g_lab: torch.Tensor | None,
        g_ent: torch.Tensor | None,
    ) -> tuple[Any, ...]:
        refuse_double_backward("linear_topk_logprobs")
        h, w = ctx.saved_tensors
        setup: _TopkSetup = ctx.setup
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dh or need_dw):
            return None, None, None
        lse, ids, entropy = ctx.stats
        acc = setup.acc_dtype
        n = h.shape[0]
        dh = torch.zeros(h.shape, dtype=acc, device=h.device) if need_dh else None
        dw = torch.zeros(w.shape, dtype=acc, device=w.device) if need_dw else None
        hd, wd = h.detach(), w.detach()
        c = torch.zeros(n, dtype=acc, device=h.device)
        if g_val is not None:
            local = ids - setup.vocab_start
            cols = torch.where((local >= 0) & (local < w.shape[0]), local, -1)
            _sparse_backward(hd, wd, cols, g_val.to(acc), setup, dh, dw)
            c = c + g_val.to(acc).sum(1)
        if (
            g_lab is not None
            and g_lab.numel()
            and setup.labels_local is not None
            and setup.ignored is not None
        ):
            gl = torch.where(setup.ignored, 0.0, g_lab.to(acc))
            _sparse_backward(hd, wd, setup.labels_local[:, None], gl[:, None], setup, dh, dw)
            c = c + gl
        ge = g_ent.to(acc) if g_ent is not None and g_ent.numel() and setup.with_entropy else None
        # A loss of the top-k values' differences (one renormalised over the k) has
        # c == 0 and no entropy term: its backward needs no logits.
        if ge is not None or bool((c != 0).any()):
            _dense_backward(hd, wd, lse, c, ge, entropy, setup, dh, dw)
        return (
            dh.to(h.dtype) if dh is not None else None,
            dw.to(w.dtype) if dw is not None else None,
            None,
        )


def linear_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    /,
    *,
    k: int,
    labels: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = IGNORE_INDEX,
    with_entropy: bool = False,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    collectives: Collectives | None = None,
    vocab_chunk_size: int | None = None,
    token_chunk_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
    logit_scale: float = 1.0,
    check_values: bool = True,
) -> TopkResult:
    """The ``k`` largest logprobs of ``hidden @ weight.T`` per row and their global
    ids, vocab-parallel, never materialising the logits. Equal to::

        z = gather(hidden) @ weight_full.T * logit_scale / T       # [n, V], never formed
        lp = log_softmax(z)                                        # fp32 (fp64 for fp64)
        order = argsort by (-lp, id)                               # ties: the smaller id first
        ids = order[:, :k];  logprobs = take_along_axis(lp, ids)   # [n, k] each
        label_logprobs = where(labels == ignore_index, 0, lp[arange(n), labels])
        entropy = logsumexp(z) - (softmax(z) * z).sum(-1)

    ``weight_full`` stacks the shards; ``gather`` is
    ``collectives.gather_hidden_states``. Each shard keeps a running top-k per
    row over its tiles and an online logsumexp; the shards' candidates are
    merged with ``collectives.all_gather`` (spec 1.2; required at ``tp > 1``,
    else ``ContractError``) and their statistics with one all-reduce max and
    one all-reduce sum.

    Cost, ``n`` rows, ``V_local`` entries, ``h`` hidden: the forward is one GEMM
    (``2 n V_local h`` flops, the logits tile by tile) plus a ``k``-wide merge
    per tile. The backward of ``logprobs`` through the selected ids is
    ``O(n k h)``: the ``k`` rows of ``weight`` each row selected, gathered (no
    GEMM). Its log-sum-exp term (``-sum_j g_j * softmax(z)``) and the entropy's
    need the logits again: three GEMMs (recomputed logits, ``dh``, ``dw``),
    skipped when every row's cotangents sum to zero and the entropy gets none
    (a loss renormalised over the ``k``, for one).

    Args:
        hidden: ``[n_local, h]`` this rank's rows (gathered here).
        weight: ``[V_local, h]``, rows ``[vocab_start, vocab_start + V_local)``.
        k: ``1 <= k <= vocab_size``; at ``tp > 1`` a shard with fewer than ``k``
            entries contributes all of them.
        labels: ``[n]`` global ids or ``ignore_index``, or ``None``.
        temperature: ``T > 0``, a number or ``[n]``.
        collectives: the vocab-parallel group's ``hookspec.Collectives``;
            ``None`` for one process.
        vocab_chunk_size, token_chunk_size: the tile (default per device,
            :data:`TOPK_TILES`).

    Returns:
        :class:`TopkResult`. NaN or inf in ``hidden`` or ``weight`` gives NaN
        logprobs at the rows they touch (the log-sum-exp is NaN), never a finite
        number.
    """
    check_floating("hidden", hidden)
    check_floating("weight", weight)
    if hidden.dim() != 2:
        raise ContractError("hidden", expected="2 dims [n, h]", actual=format_shape(hidden.shape))
    check_bool("with_entropy", with_entropy)
    check_bool("check_values", check_values)
    check_int("ignore_index", ignore_index, low=-(1 << 62))
    scale = check_finite_number("logit_scale", logit_scale, low=0.0, low_open=True)
    if collectives is not None and not isinstance(collectives, Collectives):
        raise ContractError(
            "collectives", expected="None or a hookspec.Collectives", actual=type(collectives).__name__
        )
    h = collectives.gather_hidden_states(hidden) if collectives is not None else hidden
    n, hid = h.shape
    if weight.dim() != 2 or weight.shape[1] != hid:
        raise ContractError("weight", expected=f"shape [V_local, h={hid}]", actual=format_shape(weight.shape))
    if weight.device != h.device:
        raise ContractError("weight", expected=f"on {h.device}", actual=str(weight.device))
    local = int(weight.shape[0])
    check_int("vocab_start", vocab_start, low=0)
    vocab_size = vocab_start + local if vocab_size is None else vocab_size
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < vocab_start + local:
        raise ContractError(
            "vocab_size",
            expected=f"an int >= vocab_start + V_local = {vocab_start + local}",
            actual=repr(vocab_size),
        )
    k = check_int("k", k, low=1, high=vocab_size)
    gather = gather_collective(collectives, split=local < vocab_size)
    tokens, vocab = TOPK_TILES.get(h.device.type, TOPK_TILES["cuda"])
    vocab_chunk = (
        vocab if vocab_chunk_size is None else check_int("vocab_chunk_size", vocab_chunk_size, low=1)
    )
    token_chunk = (
        tokens if token_chunk_size is None else check_int("token_chunk_size", token_chunk_size, low=1)
    )
    t = check_temperature(temperature, n, check_values=check_values)
    cdtype = resolve_compute_dtype(h.device, h.dtype, compute_dtype)
    acc = torch.float64 if cdtype == torch.float64 else torch.float32
    inv_t: torch.Tensor | float = (
        (scale / t).to(device=h.device, dtype=acc) if isinstance(t, torch.Tensor) else scale / t
    )
    labels_local = ignored = None
    if labels is not None:
        if (
            not isinstance(labels, torch.Tensor)
            or labels.dtype.is_floating_point
            or labels.dtype == torch.bool
        ):
            raise ContractError(
                "labels", expected="an integer tensor [n] or None", actual=type(labels).__name__
            )
        if tuple(labels.shape) != (n,):
            raise ContractError("labels", expected=f"shape [n={n}]", actual=format_shape(labels.shape))
        if check_values:
            check_labels_deferred(labels, vocab_size, ignore_index=ignore_index)
        y = labels.to(device=h.device, dtype=torch.long)
        ignored = y == ignore_index
        row = y - vocab_start
        labels_local = torch.where((row >= 0) & (row < local) & ~ignored, row, -1)
    setup = _TopkSetup(
        k=k,
        k_local=min(k, local),
        labels_local=labels_local,
        ignored=ignored,
        inv_t=inv_t,
        vocab_start=vocab_start,
        compute_dtype=cdtype,
        acc_dtype=acc,
        token_chunk=token_chunk,
        vocab_chunk=vocab_chunk,
        collectives=collectives,
        gather=gather,
        with_entropy=with_entropy,
    )
    values, ids, label, entropy = _TopkFunction.apply(h, weight, setup)
    return TopkResult(
        logprobs=values,
        ids=ids,
        label_logprobs=label if labels is not None else None,
        entropy=entropy if with_entropy else None,
    )


def topk_logprobs(
    k: int,
    /,
    *,
    temperature: float | None = None,
    entropy: bool = False,
    vocab_chunk_size: int | None = None,
    token_chunk_size: int | None = None,
) -> Processor:
    """A processor returning, per token, the ``k`` largest logprobs and their ids::

        {"topk_logprobs": [b, s, k] fp32, "topk_ids": [b, s, k] int64,
         "logprobs": [b, s] (with labels), "entropy": [b, s] (with entropy=True)}

    as :func:`linear_topk_logprobs` computes them (descending; ties: the smaller
    id first; ``logprobs``: the label's, 0 where it is the ignore index). ``T``:
    ``temperature``, else the user context's ``temperature`` (a number or
    ``[b, s]``), else 1. At ``tp > 1`` the context's collectives need
    ``all_gather`` (spec 1.2). Cache a teacher's ``topk_logprobs`` and
    ``topk_ids`` for :func:`distillation_loss`'s sparse form.
    """
    k = check_int("k", k, low=1)
    if temperature is not None:
        check_temperature(temperature, 1)
    check_bool("entropy", entropy)
    tile = tile_options(vocab_chunk_size=vocab_chunk_size, token_chunk_size=token_chunk_size, chunk_size=None)

    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        if not isinstance(ctx, OutputContext):
            raise ContractError(
                "processor 'topk_logprobs'", expected="a hookspec.OutputContext", actual=type(ctx).__name__
            )
        if ctx.vocab_weight is None or ctx.vocab is None:
            raise ContractError(
                "vocab_weight", expected="the output weight shard [V_local, h]", actual="None"
            )
        hs = check_floating("hidden_states", ctx.hidden_states)
        validate_context(ctx, check_values=False)
        if ctx.labels is not None:
            b, s = int(ctx.labels.shape[0]), int(ctx.labels.shape[1])
        else:
            s = int(hs.shape[0]) * (ctx.parallel.tp_size if ctx.parallel.sequence_parallel else 1)
            b = int(hs.shape[1])
        labels = None if ctx.labels is None else to_tokens(typing.cast(torch.Tensor, ctx.labels))
        res = linear_topk_logprobs(
            hs.reshape(-1, hs.shape[-1]),
            ctx.vocab_weight,  # type: ignore[arg-type]
            k=k,
            labels=labels,
            temperature=resolve_temperature(temperature, ctx, b, s),
            ignore_index=ctx.ignore_index,
            with_entropy=entropy,
            vocab_start=ctx.vocab.start,
            vocab_size=ctx.vocab.size,
            collectives=ctx.collectives,
            vocab_chunk_size=tile.vocab_chunk_size,
            token_chunk_size=tile.token_chunk_size,
            logit_scale=logit_scale(ctx),
            check_values=ctx.check_values and not ctx.labels_checked,
        )
        out = {
            "topk_logprobs": _from_token_rows(res.logprobs, b, s),
            "topk_ids": _from_token_rows(res.ids, b, s),
        }
        if res.label_logprobs is not None:
            out["logprobs"] = from_tokens(res.label_logprobs, b, s)
        if res.entropy is not None:
            out["entropy"] = from_tokens(res.entropy, b, s)
        return out

    return processor(fn, name="topk_logprobs")


def _from_token_rows(v: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """``[n, k] -> [b, s, k]`` (rows ``s``-major, as :func:`from_tokens`)."""
    return v.view(s, b, -1).transpose(0, 1).contiguous()

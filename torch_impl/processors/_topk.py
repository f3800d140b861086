"""Top-k logprobs without the ``[n, V]`` logits: :func:`linear_topk_logprobs` and its
processor :func:`topk_logprobs`, an epilogue on the engine's vocabulary sweep
(``torch.topk`` on each tile, on both backends)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Never

import torch

from hookspec import ContractError, OutputContext, Processor, processor

from ..value_checks import checked_call
from ._checks import check_bool, check_int
from ._engine import Coefficients, Engine, Recomputed, logit_grad_coefficients
from ._gemm import not_traced
from ._inputs import factory_tiles, hook_inputs, resolve_temperature
from ._options import LinearOptions, prologue

__all__ = ["TopkResult", "linear_topk_logprobs", "topk_logprobs"]

_NO_ID = 1 << 62
"""The id of a padding candidate (a shard with fewer than ``k`` entries): after every real id."""


@dataclasses.dataclass(frozen=True)
class TopkResult:
    """What :func:`linear_topk_logprobs` returns, per gathered row (fp32; fp64 for fp64):
    ``logprobs`` ``[n, k]`` descending (ties: the smaller id first), ``ids`` ``[n, k]``
    int64 global token ids, ``label_logprobs`` ``[n]`` (0 where ignored; ``None``
    without labels), ``entropy`` ``[n]`` or ``None``."""

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
    ``torch.topk``'s ``k``-th value ``v`` is right, but any entries equal to ``v`` may
    be picked: those are taken again by smallest column (a second ``topk`` on ``-column``
    where ``z == v``), so the smaller ids win, with no host read."""
    r, c = z.shape
    cols = torch.arange(first_id, first_id + c, device=z.device)
    if c <= k:
        return order_candidates(z, cols.expand(r, c))
    vals, idx = torch.topk(z, k, dim=1)
    kth = vals[:, -1:]
    neg_col = -torch.arange(c, device=z.device, dtype=z.dtype)
    tied = torch.topk(torch.where(z == kth, neg_col, float("-inf")), k, dim=1).values
    above = vals > kth
    is_tied = tied > float("-inf")
    cand_v = torch.cat(
        [torch.where(above, vals, float("-inf")), torch.where(is_tied, kth, tied)], 1
    )
    ids_above = torch.where(above, idx + first_id, _NO_ID)
    cand_i = torch.cat([ids_above, torch.where(is_tied, first_id - tied.long(), _NO_ID)], 1)
    cand_v, cand_i = order_candidates(cand_v, cand_i)
    return cand_v[:, :k], cand_i[:, :k]


def _candidates(eng: Engine, k_local: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(values, ids, on_tile)``: the running top-``k_local`` of each row, kept by
    ``on_tile`` over the vocabulary sweep's tiles (tempered values)."""
    setup = eng.setup
    top_v = torch.full((eng.n, k_local), float("-inf"), dtype=setup.acc_dtype, device=eng.hs.device)
    top_i = torch.full((eng.n, k_local), _NO_ID, dtype=torch.long, device=eng.hs.device)

    capped = eng.triton and setup.cap_k is not None  # u's order breaks ties of capped values

    def on_tile(z: torch.Tensor, rows: slice, cols: slice) -> None:
        tv, ti = _tile_topk(
            eng.logits_of(z, rows) if capped else z, k_local, setup.vocab_start + cols.start
        )
        tv = tv if capped else eng.logits_of(tv, rows)
        if cols.start == 0:
            top_v[rows, : tv.shape[1]], top_i[rows, : ti.shape[1]] = tv, ti
            return
        v, i = order_candidates(torch.cat([top_v[rows], tv], 1), torch.cat([top_i[rows], ti], 1))
        top_v[rows], top_i[rows] = v[:, :k_local], i[:, :k_local]

    return top_v, top_i, on_tile


def _run(k: int, gather: Any, with_entropy: bool, eng: Engine) -> tuple[Any, ...]:
    """:class:`~._engine.Recomputed`'s run: the top-k and statistics, and their
    gradient's terms ``dz = sum_j g_val_j ([. == id_j] - p) + g_lab ([. == y] - p) - g_ent p
    (log p + H)`` (a softcap's slope at the ids from their capped values; the engine's on the
    rest)."""
    top_v, top_i, on_tile = _candidates(eng, min(k, eng.local))
    stats = eng.forward_stats(with_entropy=with_entropy, on_tile=on_tile)
    setup, acc = eng.setup, eng.setup.acc_dtype
    if gather is not None:  # the shards' candidates merged: one all-gather each of values and ids
        gv, gi = gather(top_v), gather(top_i)  # [tp, n, k_local]
        top_v, top_i = order_candidates(
            gv.permute(1, 0, 2).reshape(eng.n, -1), gi.permute(1, 0, 2).reshape(eng.n, -1)
        )
    values, ids = top_v[:, :k].contiguous(), top_i[:, :k].contiguous()
    slope = eng.cap_slope_of(values, slice(None))
    values = values - stats.lse[:, None]
    entropy = stats.entropy if stats.entropy is not None else values.new_empty(0)
    kept, local = stats.detached(), ids - setup.vocab_start
    local = torch.where((local >= 0) & (local < eng.local), local, -1)

    def grad_of(g_val: Any, _g_ids: Any, g_lab: Any, g_ent: Any) -> Any:
        if g_ent is not None and (not g_ent.numel() or kept.entropy is None):
            g_ent = None
        if g_val is None and g_lab is None and g_ent is None:
            return None
        g_lab = (
            torch.zeros_like(kept.max)
            if g_lab is None
            else torch.where(setup.ignored, 0.0, g_lab.to(acc))
        )
        total = g_lab if g_val is None else g_lab + g_val.to(acc).sum(1)
        coef = logit_grad_coefficients(kept, total, g_ent, torch.zeros_like(setup.ignored), acc)
        sparse = None if g_val is None else (local, g_val.to(acc) * slope)
        return kept, Coefficients(coef.a, coef.b, g_lab), sparse

    return (values, ids, stats.logprobs, entropy), (ids,), grad_of


@not_traced
@checked_call()
def linear_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    /,
    *,
    k: int,
    labels: torch.Tensor | None = None,
    options: LinearOptions | None = None,
    with_entropy: bool = False,
    bias: torch.Tensor | None = None,
    **unexpected: Never,
) -> TopkResult:
    """The ``k`` largest logprobs of ``hidden @ weight.T`` per row and their global
    ids, vocab-parallel, never materialising the logits. Equal to::

        z = (gather(hidden) @ weight_full.T + bias_full) * logit_scale / T   # [n, V], never formed
        lp = log_softmax(z)                                        # fp32 (fp64 for fp64)
        order = argsort by (-lp, id)                               # ties: the smaller id first
        ids = order[:, :k];  logprobs = take_along_axis(lp, ids)   # [n, k] each
        label_logprobs = where(labels == ignore_index, 0, lp[arange(n), labels])
        entropy = logsumexp(z) - (softmax(z) * z).sum(-1)

    Args:
        hidden, weight: ``[n_local, h]`` and ``[V_local, h]``, as :func:`linear_logprobs`'.
        bias, options: as :func:`linear_logprobs`' (and so is ``gather`` above).
        k: how many, ``1 <= k <= vocab size``.
        labels: ``[n]`` or ``None`` (no ``label_logprobs``), as :func:`linear_logprobs`'.
        with_entropy: also the entropy.

    Returns:
        :class:`TopkResult`: ``logprobs`` and ``ids`` ``[n, k]``, ``label_logprobs``, ``entropy``.

    Each shard keeps a running top-k per row over its tiles (a shard with fewer than ``k``
    entries contributes all of them), merged with ``collectives.all_gather`` (spec 1.2;
    required at ``tp > 1``, else ``ContractError``). Cost: one GEMM ``2 n V_local h``
    forward plus a ``k``-wide selection per tile; the recomputing backward three GEMMs (the
    gradient at the ``k`` ids and the label added to each tile's logit gradient in fp32).
    NaN or inf in ``hidden`` or ``weight`` gives NaN logprobs at the rows they touch.
    """
    check_bool("with_entropy", with_entropy)
    name = "linear_topk_logprobs"  # fold=False: equal logits stay equal (ties)
    options, h, setup = prologue(
        name, hidden, weight, labels, options, unexpected, fold=False, bias=bias
    )
    k = check_int("k", k, low=1, high=setup.vocab_size)
    gather = None
    if int(weight.shape[0]) < setup.vocab_size:  # the vocabulary split over shards
        gather = getattr(options.collectives, "all_gather", None)
        if not callable(gather):
            raise ContractError(
                "collectives.all_gather",
                expected="a Collectives with all_gather (spec 1.2) to merge the top-k of the "
                "vocab shards",
                actual=f"{type(options.collectives).__name__} without all_gather",
            )
    run = functools.partial(_run, k, gather, with_entropy)
    values, ids, label, entropy = Recomputed.apply(h, weight, setup.bias, name, setup, run)
    return TopkResult(
        values, ids, label if labels is not None else None, entropy if with_entropy else None
    )


def topk_logprobs(
    k: int,
    /,
    *,
    temperature: float | None = None,
    entropy: bool = False,
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    **unexpected: Never,
) -> Processor:
    """A processor returning, per token, the ``k`` largest logprobs and their ids::

        {"topk_logprobs": [b, s, k] fp32, "topk_ids": [b, s, k] int64,
         "logprobs": [b, s] (with labels), "entropy": [b, s] (with entropy=True)}

    as :func:`linear_topk_logprobs` computes them (``logprobs``: the label's; ``T`` and
    the tiles as :func:`selected_logprobs`'). At ``tp > 1`` the context's collectives need
    ``all_gather`` (spec 1.2). Cache a teacher's ``topk_logprobs`` and ``topk_ids`` for
    :func:`distillation_loss`'s sparse form.
    """
    tile = factory_tiles("topk_logprobs", unexpected, temperature, tile_rows, tile_cols)
    k = check_int("k", k, low=1)
    check_bool("entropy", entropy)

    @checked_call()
    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        inputs = hook_inputs(ctx, "topk_logprobs", needs_labels=False)
        res = linear_topk_logprobs(
            inputs.hidden,
            inputs.weight,
            k=k,
            labels=inputs.labels,
            options=inputs.tensor_options(
                tile, resolve_temperature(temperature, ctx, inputs.b, inputs.s)
            ),
            with_entropy=entropy,
        )
        return inputs.per_token(
            topk_logprobs=res.logprobs,
            topk_ids=res.ids,
            logprobs=res.label_logprobs,
            entropy=res.entropy,
        )

    return processor(fn, name="topk_logprobs")

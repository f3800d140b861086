"""Sampling replay: the label's logprob under the rollout sampler's distribution,
renormalised over the tokens it kept (:class:`SamplingSupport`, ``linear_logprobs(support=)``).

A rollout engine that samples with top-k, top-p or min-p draws from the softmax renormalised
over the kept tokens ``K``; its logprobs are ``z_y - logsumexp(z[K])``. The trainer's
``z_y - logsumexp(z)`` differs from them by ``log S``, ``S`` the kept mass, in every ratio.
Given the kept ids each shard gathers its own ids' logits tile by tile during the
vocabulary sweep, the shards' ``[n, K]`` values are combined in one all-reduce max, and the
renormalised logprob and entropy come from those values; the backward is the engine's,
with the logit gradient's dense part zero and its terms at the kept columns::

    zk = where(kept != -1, z[kept], -inf)                   # [n, K], gathered per tile
    lse_K = logsumexp(zk);  p = exp(zk - lse_K)
    logprob = z_y - lse_K                                   # -inf where y is not kept
    entropy = -sum(p * log p)
    d logprob / dz_j = [j == y] - p_j,   d entropy / dz_j = -p_j (log p_j + entropy)   (j in K)

Cost: the logprob's four GEMM-equivalents (the logits, recomputed in backward, ``dh``,
``dW``), plus a gather of ``K`` values a row per tile and one ``[n, K]`` all-reduce.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hookspec import ContractError
from hookspec.arrays import format_shape

from ._checks import describe_tensor
from ._engine import Coefficients, Engine, Recomputed, Stats

__all__ = ["SamplingSupport", "supported_logprobs"]


@dataclasses.dataclass(frozen=True)
class SamplingSupport:
    """The tokens the rollout sampler kept, per gathered row: ``kept_ids`` ``[n, K]`` of
    global token ids (int64 or int32), padded with ``-1``, in any order; an id twice in a
    row counts once. The label of a counted row outside its kept ids has probability 0:
    its logprob is ``-inf`` (a ratio against it is 0 or NaN; the rollout engine could not
    have sampled it, so such a row is a data error to mask or reject).

    The parametric form (``top_k``/``top_p``/``min_p``, vLLM's sampler replayed without the
    logits) is not built yet; record the kept ids at rollout (vLLM returns them).
    """

    kept_ids: torch.Tensor

    def __post_init__(self) -> None:
        ids = self.kept_ids
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            expected = "an int64 or int32 tensor [n, K] of global token ids, padded with -1"
            raise ContractError("kept_ids", expected=expected, actual=describe_tensor(ids))
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ContractError(
                "kept_ids", expected="2 dims [n, K], K >= 1", actual=format_shape(ids.shape)
            )


def _checked_ids(support: Any, n: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The kept ids ``[n, K]`` int64 on ``device``, each in ``[-1, vocab_size)``."""
    if not isinstance(support, SamplingSupport):
        expected = "None or a torch_impl.processors.SamplingSupport"
        raise ContractError("support", expected=expected, actual=type(support).__name__)
    ids = support.kept_ids
    if ids.shape[0] != n:
        expected = f"[n={n}, K]: a row of kept ids per gathered row"
        raise ContractError("kept_ids", expected=expected, actual=format_shape(ids.shape))
    bad = (ids < -1) | (ids >= vocab_size)
    if bool(bad.any()):  # a host read: the ids come from the rollout, once a step
        first = int(ids[bad][0])
        expected = f"token ids in [0, {vocab_size}) or -1 (padding)"
        raise ContractError(
            "kept_ids", expected=expected, actual=f"{int(bad.sum())} out, e.g. {first}"
        )
    return ids.to(device=device, dtype=torch.long)


def _local_columns(ids: torch.Tensor, start: int, local: int) -> torch.Tensor:
    """Each kept id's column in this shard, ``-1`` where it is not here (or padding), and
    a repeated id's later copies ``-1`` too (an id counts once)."""
    cols = torch.where((ids >= start) & (ids < start + local), ids - start, -1)
    order = torch.sort(cols, dim=1, stable=True)
    repeated = torch.zeros_like(cols, dtype=torch.bool)
    repeated[:, 1:] = (order.values[:, 1:] == order.values[:, :-1]) & (order.values[:, 1:] >= 0)
    later_copy = torch.zeros_like(repeated).scatter_(1, order.indices, repeated)
    return torch.where(later_copy, -1, cols)


def _gather_kept(eng: Engine, cols: torch.Tensor) -> tuple[Stats, torch.Tensor]:
    """The sweep's forward: the full statistics, and ``zk`` ``[n, K]``, each row's kept
    logits on this shard (``-inf`` elsewhere), gathered from each tile before the
    statistics pass shifts it."""
    zk = torch.full(cols.shape, float("-inf"), dtype=eng.setup.acc_dtype, device=cols.device)

    def on_tile(z: torch.Tensor, rows: slice, tile_cols: slice) -> None:
        local = cols[rows] - tile_cols.start
        hit = (cols[rows] >= 0) & (local >= 0) & (local < z.shape[1])
        picked = eng.logits_of(z.gather(1, local.clamp(0, z.shape[1] - 1)), rows)
        zk[rows] = torch.where(hit, picked.to(zk.dtype), zk[rows])

    stats = eng.forward_stats(with_entropy=False, on_tile=on_tile)
    return stats, zk


def _run(cols: torch.Tensor, eng: Engine) -> tuple[Any, ...]:
    """:class:`Recomputed`'s run: the renormalised statistics and their gradient's terms."""
    stats, zk_local = _gather_kept(eng, cols)
    setup = eng.setup
    zk = setup.reduce_max(zk_local)  # each kept id lives on one shard: the max is its value
    lse = torch.logsumexp(zk, dim=1)
    p = torch.exp(zk - lse[:, None])
    log_p = torch.where(p > 0, zk - lse[:, None], 0.0)
    entropy = -(p * log_p).sum(1)
    ignored = setup.ignored
    label_logit = stats.logprobs + stats.lse  # z_y, the full sweep's
    label_kept = _label_kept(cols, setup, zk_local)
    logprobs = torch.where(ignored, 0.0, torch.where(label_kept, label_logit - lse, -torch.inf))
    p_d, log_p_d, entropy_d = p.detach(), log_p.detach(), entropy.detach()

    def grad_of(g_lp: Any, g_h: Any, g_lse: Any, g_mean: Any) -> Any:
        if g_lp is None and g_h is None and g_lse is None:
            return None
        acc = setup.acc_dtype
        g = torch.zeros_like(lse) if g_lp is None else torch.where(ignored, 0.0, g_lp.to(acc))
        terms = -g[:, None] * p_d
        if g_lse is not None:  # d lse_K / dz_j = p_j
            terms = terms + g_lse.to(acc)[:, None] * p_d
        if g_h is not None:
            terms = terms - g_h.to(acc)[:, None] * p_d * (log_p_d + entropy_d[:, None])
        zero = torch.zeros_like(lse)
        return stats.detached(), Coefficients(zero, None, g), (cols, terms)

    empty = lse.new_empty(0)
    return (logprobs, entropy, lse, empty), (empty,), grad_of


def _label_kept(cols: torch.Tensor, setup: Any, zk_local: torch.Tensor) -> torch.Tensor:
    """``[n]``: the row's label is among its kept ids (on any shard: one all-reduce)."""
    here = ((cols == setup.labels_local[:, None]) & (cols >= 0)).any(1)
    return setup.reduce_max(here.to(zk_local.dtype)) > 0


def supported_logprobs(
    h: torch.Tensor, weight: torch.Tensor, setup: Any, support: SamplingSupport, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy, lse)`` ``[n]`` of the module docstring, differentiable in ``h``,
    ``weight`` and the bias, over the call's checked ``setup`` (``prologue``'s)."""
    if setup.cap_k is not None:
        raise ContractError(
            "support",
            expected="no softcap with a sampling support (not built yet)",
            actual="LinearOptions(softcap=...)",
        )
    ids = _checked_ids(support, int(h.shape[0]), setup.vocab_size, h.device)
    cols = _local_columns(ids, setup.vocab_start, int(weight.shape[0]))
    logprobs, entropy, lse, _ = Recomputed.apply(
        h, weight, setup.bias, name, setup, lambda eng: _run(cols, eng)
    )
    return logprobs, entropy, lse

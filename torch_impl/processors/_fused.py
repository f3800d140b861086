"""A scalar loss of per-token logprobs and entropies whose gradients are formed in
the forward pass, tile by tile, so that no logits are recomputed.

It applies to losses that are sums of per-token terms with weights known in
advance (every aggregation of ``hookspec.conventions`` is one)::

    loss = sum_i token_loss_i(logprob_i, entropy_i)

Each tile holds ``rows`` tokens by the whole local vocabulary: its logits give
the tokens' logprobs and entropies exactly (one all-reduce max and one
all-reduce sum per tile under tensor parallel), hence ``d loss / d logprob_i``
and ``d loss / d entropy_i`` by autograd on those few numbers, hence the tile's
logit gradient, whose products with the weight and the hidden rows are added
to ``dh`` and ``dW``. Three GEMMs per tile (logits, ``dh``, ``dW``) instead of
the four of a forward pass followed by a recomputing backward. ``backward``
scales the stored gradients by the incoming one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from hookspec import IGNORE_INDEX, Collectives, ContractError
from hookspec.arrays import format_shape

from ._checks import check_int
from ._logprobs import plan_backward, plan_stats
from ._setup import Backend, Plan, check_hidden, gather_rows, make_plan
from ._tiles import (
    Stats,
    TileBuffers,
    logit_grad_coefficients,
    mm_into,
    rowdot,
    scaled_hidden,
    target_in_tile,
    tile_grad_,
    tile_inv_t,
    unfold_dh_,
    weight_chunk,
)

__all__ = [
    "FUSED_TILE_ELEMENTS",
    "FusedLossResult",
    "TokenLoss",
    "fused_token_loss",
]

FUSED_TILE_ELEMENTS = 1 << 23
"""Logits per tile of the fused pass (32 MiB in fp32): ``rows = max(1, this // V_local)``."""

TokenLoss = Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor]
"""``(logprobs [r], entropy [r], rows) -> scalar``: the summed, weighted loss of
the tokens ``rows`` (a slice of the ``n`` gathered rows). Differentiable in the
first two arguments; called under ``torch.enable_grad``."""


@dataclasses.dataclass(frozen=True)
class FusedLossResult:
    """``loss``: scalar, differentiable in the hidden states and the weight;
    ``logprobs`` and ``entropy``: ``[n]``, detached."""

    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor


def _row_stats(
    z: torch.Tensor,
    e_out: Callable[[torch.Tensor], torch.Tensor],
    labels_local: torch.Tensor,
    ignored: torch.Tensor,
    coll: Collectives | None,
) -> tuple[Stats, torch.Tensor]:
    """Exact statistics of full-vocabulary rows ``z`` (shifted in place to
    ``z - M``); returns them and ``exp(z - M)``."""
    m = z.amax(1)
    big_m = coll.all_reduce_max(m) if coll is not None else m
    hit, col = target_in_tile(labels_local, 0, z.shape[1])
    zy = torch.where(hit, z.gather(1, col).squeeze(1) - big_m, 0.0)
    z.sub_(big_m[:, None])
    e = e_out(z)
    summed = torch.stack([e.sum(1), zy, rowdot(e, z)])
    if coll is not None:
        summed = coll.all_reduce_sum(summed)
    big_s = summed[0]
    log_s = torch.log(big_s)
    logprobs = torch.where(ignored, 0.0, summed[1] - log_s)
    entropy = log_s - summed[2] / big_s
    return Stats(max=big_m, sumexp=big_s, logprobs=logprobs, entropy=entropy), e


def _token_loss_grads(
    token_loss: TokenLoss, stats: Stats, rows: slice, need: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(loss, d loss / d logprobs, d loss / d entropy)`` of the rows, the loss checked
    against the :data:`TokenLoss` contract; a loss that does not depend on its
    arguments (a constant) has zero gradients (``None``)."""
    assert stats.entropy is not None  # both paths form it for the fused loss
    with torch.enable_grad():
        lp = stats.logprobs.detach().requires_grad_()
        ent = stats.entropy.detach().requires_grad_()
        loss = token_loss(lp, ent, rows)
        if not isinstance(loss, torch.Tensor):
            raise ContractError(
                "token_loss",
                expected="a callable returning a 0-dim floating torch.Tensor (the summed loss of the rows)",
                actual=f"it returned {type(loss).__name__}",
            )
        if loss.dim() != 0 or not loss.dtype.is_floating_point:
            raise ContractError(
                "token_loss",
                expected="a callable returning a 0-dim floating torch.Tensor (the summed loss of the rows)",
                actual=f"it returned a {str(loss.dtype).removeprefix('torch.')} tensor of shape "
                f"{format_shape(loss.shape)}",
            )
        g_lp = g_h = None
        if need and loss.requires_grad:
            g_lp, g_h = torch.autograd.grad(loss, (lp, ent), allow_unused=True)
    return loss.detach(), g_lp, g_h


_Grads = tuple[
    torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor
]  # dh (acc dtype, unfolded later), dw (acc dtype), loss, logprobs, entropy


def _row_tiles(
    hs: torch.Tensor,
    w: torch.Tensor,
    plan: Plan,
    token_loss: TokenLoss,
    rows_per_tile: int,
    need: tuple[bool, bool],
) -> _Grads:
    """The torch path: tiles of whole-vocabulary rows, each tile's gradient formed from
    its logits (three GEMMs a tile)."""
    need_dh, need_dw = need
    n, local = hs.shape[0], w.shape[0]
    acc = plan.acc_dtype
    wc = weight_chunk(w, 0, local, plan)
    dh = torch.zeros(hs.shape, dtype=acc, device=hs.device) if need_dh else None
    dw = torch.zeros(w.shape, dtype=acc, device=w.device) if need_dw else None
    logprobs = torch.empty(n, dtype=acc, device=hs.device)
    entropy = torch.empty(n, dtype=acc, device=hs.device)
    total = torch.zeros((), dtype=acc, device=hs.device)
    tiles = TileBuffers(plan, hs.device)
    for i0 in range(0, n, rows_per_tile):
        rows = slice(i0, min(i0 + rows_per_tile, n))
        z = tiles.logits(hs, wc, rows)
        stats, e = _row_stats(z, tiles.exp, plan.labels_local[rows], plan.ignored[rows], plan.collectives)
        assert stats.entropy is not None  # _row_stats always forms it on this path
        logprobs[rows] = stats.logprobs
        entropy[rows] = stats.entropy
        loss, g_lp, g_h = _token_loss_grads(token_loss, stats, rows, need_dh or need_dw)
        total += loss.to(acc)
        if not (need_dh or need_dw):
            continue
        coef = logit_grad_coefficients(stats, g_lp, g_h, plan.ignored[rows], acc)
        gz = tile_grad_(z, e, coef, plan.labels_local[rows], 0, tile_inv_t(plan, rows)).to(plan.compute_dtype)
        if dh is not None:
            mm_into(dh[rows], gz, wc)
        if dw is not None:
            mm_into(dw, gz.T, hs[rows])
    return dh, dw, total, logprobs, entropy


def _whole_rows(
    hs: torch.Tensor, w: torch.Tensor, plan: Plan, token_loss: TokenLoss, need: tuple[bool, bool]
) -> _Grads:
    """The Triton path: the statistics of every row from the forward kernel, the loss
    of all rows in one call, then the gradient kernels (the logits formed twice, on
    chip, instead of held)."""
    need_dh, need_dw = need
    stats = plan_stats(hs, w, plan)
    assert stats.entropy is not None
    loss, g_lp, g_h = _token_loss_grads(token_loss, stats, slice(0, hs.shape[0]), need_dh or need_dw)
    dh = dw = None
    if need_dh or need_dw:
        coef = logit_grad_coefficients(stats, g_lp, g_h, plan.ignored, plan.acc_dtype)
        dh, dw = plan_backward(hs, w, plan, stats, coef, need_dh=need_dh, need_dw=need_dw)
    return dh, dw, loss.to(plan.acc_dtype), stats.logprobs, stats.entropy


class _FusedTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        w: torch.Tensor,
        plan: Plan,
        token_loss: TokenLoss,
        rows_per_tile: int,
        need: tuple[bool, bool],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hs = scaled_hidden(h, plan)
        if plan.kernel is not None:
            dh, dw, total, logprobs, entropy = _whole_rows(hs, w, plan, token_loss, need)
        else:
            dh, dw, total, logprobs, entropy = _row_tiles(hs, w, plan, token_loss, rows_per_tile, need)
        ctx.grads = (
            unfold_dh_(dh, plan).to(h.dtype) if dh is not None else None,
            dw.to(w.dtype) if dw is not None else None,
        )
        ctx.mark_non_differentiable(logprobs, entropy)
        return total, logprobs, entropy

    @staticmethod
    def backward(ctx: Any, g_loss: torch.Tensor | None, *_: Any) -> tuple[Any, ...]:
        if ctx.grads is None:
            raise RuntimeError(
                "fused_token_loss: backward through the same loss twice; its gradients were formed "
                "once in the forward pass (use the recomputing path, PolicyLossConfig(fused=False))"
            )
        dh, dw = ctx.grads
        ctx.grads = None  # handed over (and scaled in place): the graph keeps no copy
        if g_loss is None:
            return None, None, None, None, None, None
        if not bool(g_loss == 1):
            dh = dh.mul_(g_loss.to(dh.dtype)) if dh is not None else None
            dw = dw.mul_(g_loss.to(dw.dtype)) if dw is not None else None
        return dh, dw, None, None, None, None


def fused_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_loss: TokenLoss,
    /,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = IGNORE_INDEX,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    collectives: Collectives | None = None,
    tile_elements: int = FUSED_TILE_ELEMENTS,
    compute_dtype: torch.dtype | None = None,
    logit_scale: float = 1.0,
    check_values: bool = True,
    backend: Backend = "auto",
) -> FusedLossResult:
    """``loss = sum over row slices of token_loss(logprobs[rows], entropy[rows], rows)``
    with its gradients formed in this call (see the module docstring).

    Arguments as :func:`~torch_impl.processors.linear_logprobs`; ``logprobs`` and
    ``entropy`` are the same quantities. On the torch path they are computed tile
    by tile over ``max(1, tile_elements // V_local)`` rows (``token_loss`` is called
    once a tile); on the Triton path (``backend``, as for ``linear_logprobs``)
    every row's statistics come from the forward kernel, ``token_loss`` is called
    once with ``rows = slice(0, n)``, and the gradient kernels recompute the logits
    on chip. ``token_loss`` must return a 0-dim floating tensor (a
    ``ContractError`` names it otherwise); one that does not depend on its
    arguments gives zero gradients. The gradients are formed only when
    autograd needs them (grad mode on and ``hidden`` or ``weight`` requiring
    grad); they are held until backward: ``dW`` (fp32 for bf16/fp16 weights)
    and ``dh``.
    """
    check_hidden(hidden)
    if not callable(token_loss):
        raise ContractError(
            "token_loss", expected="a callable (logprobs, entropy, rows) -> scalar", actual=repr(token_loss)
        )
    check_int("tile_elements", tile_elements, low=1)
    h = gather_rows(hidden, collectives)
    local = int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 1
    plan = make_plan(
        h,
        weight,
        labels,
        temperature=temperature,
        logit_scale=logit_scale,
        ignore_index=ignore_index,
        with_entropy=True,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        collectives=collectives,
        vocab_chunk_size=max(1, local),
        token_chunk_size=max(1, tile_elements // max(1, local)),
        compute_dtype=compute_dtype,
        check_values=check_values,
        backend=backend,
    )
    grad = torch.is_grad_enabled()
    need = (grad and h.requires_grad, grad and weight.requires_grad)
    loss, logprobs, entropy = _FusedTokenLoss.apply(h, weight, plan, token_loss, plan.token_chunk, need)
    return FusedLossResult(loss=loss, logprobs=logprobs, entropy=entropy)

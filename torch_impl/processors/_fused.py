"""A scalar loss of per-token logprobs and entropies whose gradients are formed in the
forward pass: :func:`fused_token_loss`, the engine's row sweep with a token-loss
epilogue. It fits losses that are sums of per-token terms with weights known in
advance (every aggregation of ``hookspec.conventions``)::

    loss = sum_i token_loss_i(logprob_i, entropy_i)

A tile holds whole rows, so its statistics are exact; ``d loss / d logprob_i`` and
``d loss / d entropy_i`` come from autograd on those few numbers, hence the tile's
logit gradient, which the engine multiplies into ``dh`` and ``dW``: three GEMMs, not
the four of a forward pass and a recomputing backward. Without a gradient through
the entropy (``entropy_grad=False``) the Triton backend reads each tile once
(:meth:`~._engine.Engine.exp_rows`; ``docs/gpu-design.md``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Never

import torch

from hookspec import ContractError
from hookspec.arrays import format_shape

from ._checks import check_bool
from ._engine import Engine, GradSink, RowScale, Stats, TileSetup, logit_grad_coefficients, no_autocast
from ._options import LinearOptions, prologue, refuse_double_backward

__all__ = ["FusedLossResult", "TokenLoss", "fused_token_loss"]

TokenLoss = Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor]
"""``(logprobs [r], entropy [r], rows) -> scalar``: the summed, weighted loss of
the tokens ``rows`` (a slice of the ``n`` gathered rows). Differentiable in the
first two arguments; called under ``torch.enable_grad``."""


@dataclasses.dataclass(frozen=True)
class FusedLossResult:
    """``loss``: scalar, differentiable in ``hidden`` and ``weight``; ``logprobs``, ``entropy``: ``[n]``."""

    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor


_RETURNS = "a callable returning a 0-dim floating torch.Tensor (the summed loss of the rows)"


def _token_loss_grads(
    token_loss: TokenLoss, stats: Stats, rows: slice, need: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(loss, d loss / d logprobs, d loss / d entropy)`` of the rows, the loss checked
    against the :data:`TokenLoss` contract; a loss that does not depend on its
    arguments (a constant) has zero gradients (``None``)."""
    assert stats.entropy is not None  # the row sweep forms it
    with torch.enable_grad():
        lp = stats.logprobs.detach().requires_grad_()
        ent = stats.entropy.detach().requires_grad_()
        loss = token_loss(lp, ent, rows)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.dtype.is_floating_point:
            actual = type(loss).__name__
            if isinstance(loss, torch.Tensor):
                actual = (
                    f"a {str(loss.dtype).removeprefix('torch.')} tensor of shape {format_shape(loss.shape)}"
                )
            raise ContractError("token_loss", expected=_RETURNS, actual=f"it returned {actual}")
        g_lp = g_h = None
        if need and loss.requires_grad:
            g_lp, g_h = torch.autograd.grad(loss, (lp, ent), allow_unused=True)
    if g_h is not None and not entropy_grad:
        raise ContractError(
            "token_loss",
            expected="a loss with no gradient through the entropy (entropy_grad=False)",
            actual="its gradient reaches the entropy",
            hint="pass entropy_grad=True",
        )
    return loss.detach(), g_lp, g_h


class _FusedTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        w: torch.Tensor,
        setup: TileSetup,
        token_loss: TokenLoss,
        need: tuple[bool, bool],
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        eng = Engine(h, w, setup)
        acc = setup.acc_dtype
        logprobs = torch.empty(eng.n, dtype=acc, device=h.device)
        entropy = torch.empty(eng.n, dtype=acc, device=h.device)
        total = torch.zeros((), dtype=acc, device=h.device)

        def epilogue(z: torch.Tensor, rows: slice, sink: GradSink) -> None:
            nonlocal total
            single = eng.triton and not entropy_grad and sink.active  # one pass over the tile
            if single:
                stats, c, zy = eng.exp_rows(z, rows, sink.tile(rows))
            else:
                stats = eng.row_stats(z, rows)
            assert stats.entropy is not None
            logprobs[rows], entropy[rows] = stats.logprobs, stats.entropy
            loss, g_lp, g_h = _token_loss_grads(token_loss, stats, rows, sink.active, entropy_grad)
            total = total + loss.to(acc)
            if not sink.active:
                return
            coef = logit_grad_coefficients(stats, g_lp, g_h, setup.ignored[rows], acc)
            if not single:
                eng.row_grad(z, rows, stats, coef, sink)
                return
            inv_t = setup.row_inv_t(rows, column=False)
            scale = -coef.a * torch.exp(c - stats.max) * inv_t
            label = (coef.g - coef.a * torch.exp(zy - stats.max)) * inv_t
            sink.commit(rows, RowScale(scale=scale, label=label, label_col=setup.labels_local[rows]))

        with no_autocast(h):
            dh, dw = eng.row_sweep(epilogue, need_dh=need[0], need_dw=need[1])
        ctx.grads = (dh.to(h.dtype) if dh is not None else None, dw)
        ctx.mark_non_differentiable(logprobs, entropy)
        return total, logprobs, entropy

    @staticmethod
    def backward(ctx: Any, g_loss: torch.Tensor | None, *_: Any) -> tuple[Any, ...]:
        refuse_double_backward("fused_token_loss")
        if ctx.grads is None:
            raise RuntimeError(
                "fused_token_loss: backward through the same loss twice; its gradients were formed "
                "once in the forward pass (use the recomputing path, PolicyLossConfig(fused=False))"
            )
        dh, dw = ctx.grads
        ctx.grads = None  # handed over (and scaled in place): the graph keeps no copy
        if g_loss is None:
            return None, None, None, None, None, None
        # scaled on the device whatever the factor: reading it back would sync
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
    options: LinearOptions | None = None,
    entropy_grad: bool = True,
    **unexpected: Never,
) -> FusedLossResult:
    """``loss = sum over row tiles of token_loss(logprobs[rows], entropy[rows], rows)``
    with its gradients formed in this call (see the module docstring); ``logprobs``
    and ``entropy`` as :func:`~torch_impl.processors.linear_logprobs` computes them.

    ``options``: :class:`LinearOptions`; tiles of ``options.tile_rows`` whole rows
    (default per device: ``TILE_BYTES`` of fp32 logits). ``token_loss`` is called
    once a tile and must return a 0-dim floating tensor (a ``ContractError`` names
    it otherwise); one that does not depend on its arguments gives zero gradients.
    ``entropy_grad=False`` declares that the loss has no gradient through the
    entropy (a ``ContractError`` if it has): the Triton backend then reads each
    tile once instead of twice. The gradients are formed only when autograd needs
    them (grad mode on and ``hidden`` or ``weight`` requiring grad) and held until
    backward: ``dW`` and ``dh``. Cost: three GEMM-equivalents ``2 n h V_local``.
    Differentiable once (``create_graph=True`` raises).
    """
    if not callable(token_loss):
        raise ContractError(
            "token_loss", expected="a callable (logprobs, entropy, rows) -> scalar", actual=repr(token_loss)
        )
    check_bool("entropy_grad", entropy_grad)
    _, h, setup = prologue("fused_token_loss", hidden, weight, labels, options, unexpected)
    grad = torch.is_grad_enabled()
    need = (grad and h.requires_grad, grad and weight.requires_grad)
    loss, logprobs, entropy = _FusedTokenLoss.apply(h, weight, setup, token_loss, need, entropy_grad)
    return FusedLossResult(loss=loss, logprobs=logprobs, entropy=entropy)

"""A scalar loss of per-token logprobs and entropies whose gradients are formed in the
forward pass: :func:`fused_token_loss`, the engine's row sweep with a token-loss
epilogue, for losses that are sums of per-token terms with weights known in advance
(every aggregation of ``hookspec.conventions``)::

    loss = sum_i token_loss_i(logprob_i, entropy_i)

With ``entropy_grad=False`` each tile is read once (:func:`~._single_pass.single_pass`)
and ``token_loss`` is called once a gradient buffer of rows; with it, or with a
``mean_logit_loss`` (whose uniform term is no scale of the tile's exponentials), once a
tile, before the tile's gradient pass. Either way the loss must be a sum of per-token
terms: its calls on spans of rows are summed (``check_token_sums=True`` checks it).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from typing import Any, Never

import torch

from hookspec import ContractError

from ..value_checks import checked_call
from ._checks import check_bool, describe_tensor
from ._engine import (
    Coefficients,
    Engine,
    FormedInForward,
    Stats,
    TileSetup,
    logit_grad_coefficients,
)
from ._gemm import no_autocast, not_traced
from ._options import LinearOptions, prologue
from ._single_pass import single_pass
from ._sink import GradSink

__all__ = ["FusedLossResult", "LseLoss", "MeanLogitLoss", "TokenLoss", "fused_token_loss"]

TokenLoss = Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor]
"""``(logprobs [r], entropy [r], rows) -> loss``, a 0-dim floating tensor: the summed loss
of the tokens ``rows`` (a slice of the ``n`` gathered rows: a gradient buffer's, several
tiles', or a tile's where the gradient reaches the entropy; every row once), called
under ``torch.enable_grad`` and differentiated in its first two arguments; its gradient
to any other tensor requiring grad (a learned coefficient) reaches that tensor through
the returned loss. One that calls ``backward()`` itself is refused."""

LseLoss = Callable[[torch.Tensor, slice], torch.Tensor]
"""``(lse [r], rows) -> scalar``: a further summed, weighted loss of the same rows'
``logsumexp(z)`` (a z-loss: ``sum(w[rows] * lse ** 2)``), called beside the
:data:`TokenLoss` on the same spans, with the same contract."""

MeanLogitLoss = Callable[[torch.Tensor, slice], torch.Tensor]
"""``(mean_logit [r], rows) -> scalar``: as :data:`LseLoss`, of the rows' ``z.mean(-1)``
(label smoothing's ``-eps * sum(w[rows] * mean_logit)``)."""


@dataclasses.dataclass(frozen=True)
class FusedLossResult:
    """``loss``: scalar, differentiable in ``hidden`` and ``weight``; ``logprobs``, ``entropy``,
    ``lse`` (``logsumexp(z)``, every row), ``mean_logit`` (``z.mean(-1)``; None without a
    ``mean_logit_loss``): ``[n]``, detached."""

    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
    mean_logit: torch.Tensor | None = None


def _reaches_others(loss: torch.Tensor, own: tuple[torch.Tensor, ...]) -> bool:
    """``loss``'s graph reaches a tensor requiring grad other than ``own``."""
    ids, todo, seen = {id(x) for x in own}, [loss.grad_fn], set()
    if loss.grad_fn is None:
        return loss.requires_grad and id(loss) not in ids
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)  # an AccumulateGrad's
        if leaf is not None and id(leaf) not in ids:
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


def _checked_loss(name: str, loss: Any, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``loss`` as the :data:`TokenLoss` contract has it, else a ``ContractError`` naming
    ``name``."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.dtype.is_floating_point:
        expected = (
            "a callable returning a 0-dim floating torch.Tensor (the summed loss of the rows)"
        )
        raise ContractError(name, expected=expected, actual=f"it returned {describe_tensor(loss)}")
    if loss.device != args[0].device:  # a meta loss would pass through, or fail in autograd
        raise ContractError(
            name,
            expected=f"its loss on the device of its arguments, {args[0].device}",
            actual=f"it returned {describe_tensor(loss)} on {loss.device}",
        )
    if any(x.grad is not None for x in args):
        raise ContractError(
            name,
            expected="a callable returning its loss, which the fused loss differentiates itself",
            actual="it called backward() (the gradient is formed from the loss it returns)",
        )
    return loss


_Grad = torch.Tensor | None


@dataclasses.dataclass
class _Calls:
    """``token_loss`` (and ``lse_loss``, ``mean_logit_loss``) on spans of rows: ``(loss,
    d loss / d logprobs, d loss / d entropy, d loss / d lse, d loss / d mean_logit)``, each
    loss checked against the :data:`TokenLoss` contract (a constant one has zero
    gradients: None), and its graph to other tensors kept (``grad``: grad mode was on)."""

    fn: TokenLoss
    entropy_grad: bool
    grad: bool
    lse_fn: LseLoss | None
    mean_fn: MeanLogitLoss | None
    graph: torch.Tensor | None = None
    sums: dict[str, tuple[float, float, int]] | None = None  # checked: (sum, sum |.|, calls)

    def __call__(
        self, stats: Stats, lse: torch.Tensor, rows: slice, need: bool
    ) -> tuple[torch.Tensor, _Grad, _Grad, _Grad, _Grad]:
        assert stats.entropy is not None
        with torch.enable_grad():
            lp, ent = (
                stats.logprobs.detach().requires_grad_(),
                stats.entropy.detach().requires_grad_(),
            )
            loss = self._record(
                "token_loss", _checked_loss("token_loss", self.fn(lp, ent, rows), (lp, ent))
            )
            args = {"token_loss": lp, "entropy": ent}
            for name, fn, v in (
                ("lse_loss", self.lse_fn, lse),
                ("mean_logit_loss", self.mean_fn, stats.mean_logit),
            ):
                if fn is not None and v is not None:
                    args[name] = x = v.detach().requires_grad_()
                    part = self._record(name, _checked_loss(name, fn(x, rows), (x,)))
                    loss = loss + part.to(loss.dtype)
            keep = self.grad and loss.requires_grad and _reaches_others(loss, tuple(args.values()))
            grads: dict[str, _Grad] = {}
            if need and loss.requires_grad:
                g = torch.autograd.grad(
                    loss, list(args.values()), allow_unused=True, retain_graph=keep
                )
                grads = dict(zip(args, g, strict=True))
            if keep:
                self.graph = loss if self.graph is None else self.graph + loss
        g_h = grads.get("entropy")
        if g_h is not None and not self.entropy_grad:
            raise ContractError(
                "token_loss",
                expected="a loss with no gradient through the entropy (entropy_grad=False)",
                actual="its gradient reaches the entropy",
                hint="pass entropy_grad=True",
            )
        get = grads.get
        return loss.detach(), get("token_loss"), g_h, get("lse_loss"), get("mean_logit_loss")

    def _record(self, name: str, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` of one span, its value summed per name where sums are checked."""
        if self.sums is not None:
            total, size, calls = self.sums.get(name, (0.0, 0.0, 0))
            value = float(loss.detach())
            self.sums[name] = (total + value, size + abs(value), calls + 1)
        return loss

    def check_sums(self, vectors: dict[str, tuple[torch.Tensor, ...]]) -> None:
        """Each loss called once on every row (``vectors``: its ``[n]`` arguments by name)
        equals the sum of its calls on spans, to 64 ulp of the spans' magnitudes, else
        ``ContractError`` naming it."""
        assert self.sums is not None
        fns = {"token_loss": self.fn, "lse_loss": self.lse_fn, "mean_logit_loss": self.mean_fn}
        for name, (total, size, calls) in self.sums.items():
            args = tuple(v.detach() for v in vectors[name])
            whole = slice(0, int(args[0].shape[0]))
            loss = typing.cast(Callable[..., Any], fns[name])
            with torch.no_grad():
                one = float(_checked_loss(name, loss(*args, whole), args))
            if abs(one - total) > 64 * torch.finfo(args[0].dtype).eps * max(size, abs(one)):
                raise ContractError(
                    name,
                    expected="a sum of per-token terms (fused_token_loss calls it on spans of "
                    "rows and sums the results): one call on all rows equal to that sum",
                    actual=f"{one:.6g} on all {whole.stop} rows, {total:.6g} summed over "
                    f"{calls} spans",
                    hint="a mean over the rows is a sum with weights known in advance: divide "
                    "by the count (hookspec.conventions)",
                )

    def attach(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (differentiable in the hidden rows and weight) also carrying the
        gradient of the calls' losses to other tensors (``lp``, ``ent`` held fixed)."""
        return (
            loss if self.graph is None else loss + (self.graph - self.graph.detach()).to(loss.dtype)
        )


def _sweep(
    h: torch.Tensor, w: torch.Tensor, setup: TileSetup, calls: _Calls, *need: bool
) -> tuple[tuple[torch.Tensor, ...], Any, Any, Any]:
    """The row sweep of :func:`fused_token_loss`: ``((loss, logprobs, entropy, lse,
    mean_logit), dh, dW, db)`` (``mean_logit`` empty without a ``mean_logit_loss``)."""
    need_dh, need_dw, need_db = need
    eng = Engine(h, w, setup, need_db=need_db)
    acc, ignored = setup.acc_dtype, setup.ignored
    mean = calls.mean_fn is not None
    lp_ent = torch.empty(
        (3 + mean, eng.n), dtype=acc, device=h.device
    )  # logprobs, entropy, lse, mean
    total = torch.zeros((), dtype=acc, device=h.device)
    active = need_dh or need_dw or need_db

    def loss_of(stats: Stats, rows: slice) -> Coefficients | None:
        nonlocal total
        assert stats.entropy is not None
        lse = stats.lse  # a property: formed once
        lp_ent[:3, rows] = torch.stack((stats.logprobs, stats.entropy, lse))
        if stats.mean_logit is not None:
            lp_ent[3, rows] = stats.mean_logit
        loss, g_lp, g_h, g_lse, g_mean = calls(stats, lse, rows, active)
        total = total + loss.to(acc)
        if not active:
            return None
        return logit_grad_coefficients(
            stats, g_lp, g_h, ignored[rows], acc, g_lse=g_lse, g_mean=g_mean, vocab=setup.vocab_size
        )

    def epilogue(z: torch.Tensor, rows: slice, sink: GradSink) -> None:
        stats, _ = eng.row_stats(z, rows, with_mean=mean)
        coef = loss_of(stats, rows)
        if coef is None:
            return sink.commit(rows)
        eng.row_grad(z, rows, stats.max, coef, sink)

    with no_autocast(h):
        # the gradient's uniform term (mean_logit_loss) is no scale of exp(z - c): two passes a tile
        if (active and calls.entropy_grad) or mean:
            dh, dw = eng.row_sweep(epilogue, need_dh=need_dh, need_dw=need_dw)
        else:  # one pass a tile, the loss once a buffer
            dh, dw = single_pass(eng, loss_of, need_dh=need_dh, need_dw=need_dw)
    return (total, *lp_ent[:3], lp_ent[3] if mean else lp_ent.new_empty(0)), dh, dw, eng.db


def _check_losses(token_loss: Any, lse_loss: Any, mean_logit_loss: Any) -> None:
    """``token_loss`` a callable, ``lse_loss`` and ``mean_logit_loss`` callables or None."""
    for field, fn, args in (
        ("token_loss", token_loss, "(logprobs, entropy, rows)"),
        ("lse_loss", lse_loss, "(lse, rows)"),
        ("mean_logit_loss", mean_logit_loss, "(mean_logit, rows)"),
    ):
        if not callable(fn) and (fn is not None or field == "token_loss"):
            optional = "" if field == "token_loss" else "None or "
            raise ContractError(
                field, expected=f"{optional}a callable {args} -> scalar", actual=repr(fn)
            )


def _check_sums(
    calls: _Calls,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    lse: torch.Tensor,
    mean: torch.Tensor | None,
) -> None:
    """``check_token_sums``: each loss called once more on all rows, against the sum of
    its calls on spans (:meth:`_Calls.check_sums`)."""
    vectors = {"token_loss": (logprobs, entropy), "lse_loss": (lse,)}
    if mean is not None:
        vectors["mean_logit_loss"] = (mean,)
    calls.check_sums(vectors)


@not_traced
@checked_call()
def fused_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_loss: TokenLoss,
    /,
    *,
    options: LinearOptions | None = None,
    entropy_grad: bool = True,
    lse_loss: LseLoss | None = None,
    bias: torch.Tensor | None = None,
    mean_logit_loss: MeanLogitLoss | None = None,
    mean_logit_weights: torch.Tensor | None = None,
    check_token_sums: bool = False,
    **unexpected: Never,
) -> FusedLossResult:
    """``loss = sum over spans of rows of token_loss(logprobs[rows], entropy[rows], rows)``
    with its gradients formed in this call (see the module docstring), only when autograd
    needs them, and held until backward (``dh`` in the accumulation dtype, rounded once
    after the upstream gradient's scale). Cost: three GEMM-equivalents ``2 n h V_local``.

    Args:
        hidden, weight, labels, bias, mean_logit_weights: as :func:`linear_logprobs`'.
        token_loss: a :data:`TokenLoss`, a sum of per-token terms (below).
        options: as :func:`linear_logprobs`', its tiles of ``tile_rows`` whole rows.
        entropy_grad: ``False``: ``token_loss`` has no entropy gradient (else ``ContractError``).
        lse_loss: a :data:`LseLoss` of ``lse = logsumexp(z)`` (``d lse / dz_j = softmax(z)_j``,
            in the same pass).
        mean_logit_loss: a :data:`MeanLogitLoss` of ``mean_logit = z.mean(-1)`` (``d
            mean_logit / dz_j = 1 / V``: each tile read twice, no GEMM more).
        check_token_sums: a debugging aid: the losses called once more on all rows,
            ``ContractError`` naming them where that differs from the sum.

    Returns:
        :class:`FusedLossResult` (``logprobs`` and ``entropy`` as :func:`linear_logprobs`').

    The losses must be sums of per-token terms, their calls on spans of rows summed (when
    each is called: the module docstring); ``-lp.mean()`` would give a mean per span.
    Differentiable once: a second backward through the same call, or ``create_graph=True``,
    raises (:class:`~._engine.FormedInForward`).
    """
    _check_losses(token_loss, lse_loss, mean_logit_loss)
    check_bool("entropy_grad", entropy_grad)
    check_bool("check_token_sums", check_token_sums)
    name, cw = "fused_token_loss", mean_logit_weights
    _, h, setup = prologue(
        name, hidden, weight, labels, options, unexpected, bias=bias, mean_weights=cw
    )
    calls = _Calls(token_loss, entropy_grad, torch.is_grad_enabled(), lse_loss, mean_logit_loss)
    calls.sums = {} if check_token_sums else None
    run = functools.partial(_sweep, h, weight, setup, calls)
    loss, lp, entropy, lse, mean = FormedInForward.apply(
        h, weight, setup.bias, name, run, calls.grad
    )
    mean = mean if mean_logit_loss is not None else None
    if calls.sums is not None:
        _check_sums(calls, lp, entropy, lse, mean)
    return FusedLossResult(
        loss=calls.attach(loss), logprobs=lp, entropy=entropy, lse=lse, mean_logit=mean
    )

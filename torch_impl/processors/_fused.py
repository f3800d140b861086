"""A scalar loss of per-token logprobs and entropies whose gradients are formed in
the forward pass, tile by tile, so that no logits are recomputed.

It applies to losses that are sums of per-token terms with weights known in
advance (every aggregation of ``hookspec.conventions`` is one)::

    loss = sum_i token_loss_i(logprob_i, entropy_i)

Each tile holds ``rows`` tokens by the whole local vocabulary: its logits give
the tokens' logprobs and entropies exactly (one all-reduce max and one
all-reduce sum per tile under tensor parallel), hence ``d loss / d logprob_i``
and ``d loss / d entropy_i`` by autograd on those few numbers, hence the tile's
logit gradient, whose products with the weight and the hidden rows give ``dh``
and ``dW``. Three GEMMs per tile, on both backends, each a ``torch.mm``::

    z = h[rows] @ w.T                 # fp32 [rows, V_local]
    gz = d loss / d z                 # torch ops, or the Triton kernels, in place
    dh[rows] = gz @ w                 # each tile writes its own rows
    dw (+)= gz.T @ h[rows]            # fp32 accumulator, the first tile writes

instead of the four of a forward pass followed by a recomputing backward.
``backward`` scales the stored gradients by the incoming one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from hookspec import IGNORE_INDEX, Collectives, ContractError
from hookspec.arrays import format_shape

from ._checks import check_int
from ._setup import (
    Backend,
    TileSetup,
    check_hidden,
    gather_rows,
    logits_budget,
    make_setup,
    refuse_double_backward,
)
from ._tiles import (
    Stats,
    TileBuffers,
    combine,
    gemm_into,
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
"""Logits per tile of the fused pass on a CPU (32 MiB in fp32): ``rows = max(1, this //
V_local)``. The default per device is ``LOGITS_CHUNK_BYTES / 4``: this on a CPU,
``2**28`` (1 GiB, 1766 rows at V = 151936) on CUDA."""

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


_Grad = Callable[[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]], torch.Tensor]


def _torch_tile(
    hs: torch.Tensor, wc: torch.Tensor, setup: TileSetup, tiles: TileBuffers, rows: slice
) -> tuple[Stats, _Grad]:
    """The torch backend's tile: its statistics, and a function of the coefficients
    giving the tile's logit gradient (in place in the logits buffer)."""
    z = tiles.logits(hs, wc, rows)
    stats, e = _row_stats(z, tiles.exp, setup.labels_local[rows], setup.ignored[rows], setup.collectives)

    def grad(coef: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]) -> torch.Tensor:
        gz = tile_grad_(z, e, coef, setup.labels_local[rows], 0, tile_inv_t(setup, rows))
        return gz.to(setup.compute_dtype)

    return stats, grad


class _TritonTiles:
    """The Triton backend's tiles: cuBLAS logits into one reused fp32 buffer, the
    statistics and the in-place gradient by the kernels (per-token vectors ``[n]``,
    as the kernels index them)."""

    def __init__(self, n: int, setup: TileSetup, device: torch.device) -> None:
        self.setup = setup
        self.buf = torch.empty(setup.token_chunk * setup.vocab_chunk, dtype=torch.float32, device=device)
        self.state = (
            torch.full((n,), float("-inf"), dtype=torch.float32, device=device),
            torch.zeros(n, dtype=torch.float32, device=device),
            torch.zeros(n, dtype=torch.float32, device=device),
            torch.zeros(n, dtype=torch.float32, device=device),
        )
        self.coef = tuple(torch.empty(n, dtype=torch.float32, device=device) for _ in range(4))

    def tile(self, hs: torch.Tensor, wc: torch.Tensor, rows: slice) -> tuple[Stats, _Grad]:
        from ._triton_path import chunk_grad, chunk_logits, local_chunk_stats

        setup = self.setup
        z = chunk_logits(self.buf, hs[rows], wc)
        local_chunk_stats(z, setup, self.state, row0=rows.start, col0=0)
        m, s, t, zy = (x[rows] for x in self.state)
        stats = combine(m, s, t, zy, setup, rows)

        def grad(coef: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]) -> torch.Tensor:
            big_m, a, b, g = self.coef
            big_m[rows] = stats.max
            a[rows], g[rows] = coef[0], coef[2]
            if coef[1] is not None:
                b[rows] = coef[1]
            return chunk_grad(
                z, setup, big_m, (a, None if coef[1] is None else b, g), row0=rows.start, col0=0
            )

        return stats, grad


def _row_tiles(
    hs: torch.Tensor,
    w: torch.Tensor,
    setup: TileSetup,
    token_loss: TokenLoss,
    need: tuple[bool, bool],
) -> _Grads:
    """Tiles of ``setup.token_chunk`` whole-vocabulary rows, each tile's gradient formed
    from its logits: three GEMMs a tile, on either backend."""
    need_dh, need_dw = need
    n, local = hs.shape[0], w.shape[0]
    acc = setup.acc_dtype
    wc = weight_chunk(w, 0, local, setup)
    dh = torch.empty(hs.shape, dtype=acc, device=hs.device) if need_dh else None  # each tile writes its rows
    dw = torch.empty(w.shape, dtype=acc, device=w.device) if need_dw else None  # the first tile writes
    if dw is not None and n == 0:
        dw.zero_()
    logprobs = torch.empty(n, dtype=acc, device=hs.device)
    entropy = torch.empty(n, dtype=acc, device=hs.device)
    total = torch.zeros((), dtype=acc, device=hs.device)
    triton = _TritonTiles(n, setup, hs.device) if setup.kernel is not None else None
    tiles = TileBuffers(setup, hs.device)
    for i0 in range(0, n, setup.token_chunk):
        rows = slice(i0, min(i0 + setup.token_chunk, n))
        stats, grad = (
            triton.tile(hs, wc, rows) if triton is not None else _torch_tile(hs, wc, setup, tiles, rows)
        )
        assert stats.entropy is not None  # both backends form it for the fused loss
        logprobs[rows] = stats.logprobs
        entropy[rows] = stats.entropy
        loss, g_lp, g_h = _token_loss_grads(token_loss, stats, rows, need_dh or need_dw)
        total += loss.to(acc)
        if not (need_dh or need_dw):
            continue
        gz = grad(logit_grad_coefficients(stats, g_lp, g_h, setup.ignored[rows], acc))
        if dh is not None:
            mm_into(dh[rows], gz, wc)
        if dw is not None:
            gemm_into(dw, gz.T, hs[rows], first=i0 == 0)
    return dh, dw, total, logprobs, entropy


class _FusedTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        w: torch.Tensor,
        setup: TileSetup,
        token_loss: TokenLoss,
        need: tuple[bool, bool],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hs = scaled_hidden(h, setup)
        dh, dw, total, logprobs, entropy = _row_tiles(hs, w, setup, token_loss, need)
        ctx.grads = (
            unfold_dh_(dh, setup).to(h.dtype) if dh is not None else None,
            dw.to(w.dtype) if dw is not None else None,
        )
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
            return None, None, None, None, None
        if not bool(g_loss == 1):
            dh = dh.mul_(g_loss.to(dh.dtype)) if dh is not None else None
            dw = dw.mul_(g_loss.to(dw.dtype)) if dw is not None else None
        return dh, dw, None, None, None


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
    tile_elements: int | None = None,
    compute_dtype: torch.dtype | None = None,
    logit_scale: float = 1.0,
    check_values: bool = True,
    backend: Backend = "auto",
) -> FusedLossResult:
    """``loss = sum over row slices of token_loss(logprobs[rows], entropy[rows], rows)``
    with its gradients formed in this call (see the module docstring).

    Arguments as :func:`~torch_impl.processors.linear_logprobs`; ``logprobs`` and
    ``entropy`` are the same quantities. Tiles of ``max(1, tile_elements //
    V_local)`` rows (default per device: ``LOGITS_CHUNK_BYTES / 4`` logits, 2**23 on
    a CPU, 2**28 on CUDA); ``token_loss`` is called once a tile. ``backend`` as for
    ``linear_logprobs``: three GEMMs a tile on both. ``token_loss`` must return a
    0-dim floating tensor (a ``ContractError`` names it otherwise); one that does not
    depend on its arguments gives zero gradients. The gradients are formed only when
    autograd needs them (grad mode on and ``hidden`` or ``weight`` requiring grad);
    they are held until backward: ``dW`` (fp32 for bf16/fp16 weights) and ``dh``.
    Differentiable once (``create_graph=True`` raises).
    """
    check_hidden(hidden)
    if not callable(token_loss):
        raise ContractError(
            "token_loss", expected="a callable (logprobs, entropy, rows) -> scalar", actual=repr(token_loss)
        )
    if tile_elements is None:
        tile_elements = logits_budget(hidden.device)
    check_int("tile_elements", tile_elements, low=1)
    h = gather_rows(hidden, collectives)
    local = int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 1
    setup = make_setup(
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
    loss, logprobs, entropy = _FusedTokenLoss.apply(h, weight, setup, token_loss, need)
    return FusedLossResult(loss=loss, logprobs=logprobs, entropy=entropy)

"""Selected-token logprobs and entropy from hidden states and a vocab shard, without
materialising the ``[n, V]`` logits: the public function and its autograd.

Two backends compute the same statistics and gradients, each GEMM a ``torch.mm``
(cuBLAS on a GPU): the Triton backend does the memory-bound work on each logits
chunk in Triton kernels (:mod:`._triton_path`), the torch backend in torch ops
(:mod:`._tiles`; the CPU path and the in-repo reference). ``backend="auto"`` takes
the device class's entry of :mod:`._backends` (Triton on CUDA where nothing was
measured, torch on a CPU and for float64).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hookspec import IGNORE_INDEX, Collectives

from ._checks import resolve_vocab_chunk
from ._setup import (
    DEFAULT_TOKEN_CHUNK,
    DEFAULT_VOCAB_CHUNK,
    Backend,
    TileSetup,
    check_hidden,
    gather_rows,
    make_setup,
    refuse_double_backward,
)
from ._tiles import Stats, backward_tiles, forward_stats, logit_grad_coefficients, scaled_hidden

__all__ = [
    "DEFAULT_TOKEN_CHUNK",
    "DEFAULT_VOCAB_CHUNK",
    "LogprobResult",
    "linear_logprobs",
    "run_backward",
    "run_forward",
]


@dataclasses.dataclass(frozen=True)
class LogprobResult:
    """Per-token results of :func:`linear_logprobs`, fp32 (fp64 for fp64 inputs).

    ``logprobs``: ``[n]``, ``0.0`` where the label is the ignore index.
    ``entropy``: ``[n]`` (every token, whatever its label), or ``None`` when not
    requested.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None


def run_forward(hs: torch.Tensor, w: torch.Tensor, setup: TileSetup) -> Stats:
    """The global statistics of every token, on the setup's backend."""
    if setup.kernel is not None:
        from ._triton_path import triton_forward_stats

        return triton_forward_stats(hs, w, setup)
    return forward_stats(hs, w, setup)


def run_backward(
    hs: torch.Tensor,
    w: torch.Tensor,
    setup: TileSetup,
    stats: Stats,
    coef: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
    *,
    need_dh: bool,
    need_dw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dh, dw)`` from the logit-gradient coefficients, on the setup's backend."""
    if setup.kernel is not None:
        from ._triton_path import triton_backward

        return triton_backward(hs, w, setup, stats, coef, need_dh=need_dh, need_dw=need_dw)
    return backward_tiles(hs, w, setup, stats, coef, need_dh=need_dh, need_dw=need_dw)


# ---------------------------------------------------------------- autograd


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, w: torch.Tensor, setup: TileSetup
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hs = scaled_hidden(h, setup)
        stats = run_forward(hs, w, setup)
        ctx.set_materialize_grads(False)
        ctx.setup = setup
        ctx.stats = dataclasses.replace(stats, logprobs=stats.logprobs.detach())
        ctx.save_for_backward(h, w)
        entropy = stats.entropy if stats.entropy is not None else stats.logprobs.new_empty(0)
        if stats.entropy is None:
            ctx.mark_non_differentiable(entropy)
        return stats.logprobs, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_h: torch.Tensor | None) -> tuple[Any, ...]:
        refuse_double_backward("linear_logprobs")
        h, w = ctx.saved_tensors
        setup: TileSetup = ctx.setup
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_h is None) or not (need_dh or need_dw):
            return None, None, None
        stats: Stats = ctx.stats
        coef = logit_grad_coefficients(stats, g_lp, g_h, setup.ignored, setup.acc_dtype)
        hs = scaled_hidden(h, setup)
        dh, dw = run_backward(hs, w, setup, stats, coef, need_dh=need_dh, need_dw=need_dw)
        return (dh.to(h.dtype) if dh is not None else None), dw, None


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
    backend: Backend = "auto",
    vocab_chunk_size: int | None = None,
    token_chunk_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
    logit_scale: float = 1.0,
    check_values: bool = True,
    chunk_size: int | None = None,
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
            A shard that is not the whole vocabulary needs ``collectives``.
        collectives: the ``hookspec.Collectives`` of the vocab-parallel group;
            ``None`` for one process (then ``weight`` must be the whole vocabulary).
        backend: ``"triton"`` (cuBLAS GEMMs, Triton kernels for the passes over
            each logits chunk), ``"torch"`` (cuBLAS GEMMs, torch ops for the
            passes), or ``"auto"``: the device class's measured choice, else
            Triton on CUDA where Triton is installed, torch otherwise (CPU,
            fp64). ``"triton"`` on a CPU needs ``TRITON_INTERPRET=1``. fp32
            products use TF32 only where ``torch.backends.cuda.matmul.allow_tf32``
            asks for it.
        vocab_chunk_size, token_chunk_size: the logits chunk, vocab entries by
            tokens. Default per device: on the torch path ``TILES_BY_DEVICE``
            (4096 x 1024 on a CPU, 8192 x 4096 on CUDA); on the Triton path
            ``LOGITS_CHUNK_BYTES`` of fp32 logits (1 GiB on CUDA: every row,
            as many vocabulary entries as fit).
        compute_dtype: the matmul operands' dtype; default float32 on a CPU for
            the torch path, float64 where ``hidden`` or ``weight`` is float64
            (torch path), the input dtype elsewhere. Products accumulate in fp32
            (fp64) whatever it is.
        logit_scale: a constant factor on the logits (MuP's output multiplier).
        check_values: read the labels and a tensor temperature to check them.
        chunk_size: deprecated name of ``vocab_chunk_size`` (one release).

    Returns:
        :class:`LogprobResult`, fp32 (fp64 for fp64 compute). NaN or inf in
        ``hidden`` or ``weight`` gives NaN at the tokens they touch, never a
        finite number. Differentiable once: a backward with
        ``create_graph=True`` raises (its gradient would have no graph).
    """
    check_hidden(hidden)
    h = gather_rows(hidden, collectives)
    setup = make_setup(
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
        vocab_chunk_size=resolve_vocab_chunk(vocab_chunk_size, chunk_size, stacklevel=2),
        token_chunk_size=token_chunk_size,
        compute_dtype=compute_dtype,
        check_values=check_values,
        backend=backend,
    )
    logprobs, entropy = _LinearLogprobs.apply(h, weight, setup)
    return LogprobResult(logprobs=logprobs, entropy=entropy if with_entropy else None)

"""Selected-token logprobs and entropy: the engine's vocabulary sweep, forward and
recomputing backward (:func:`linear_logprobs`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Never

import torch

from ..value_checks import checked_call
from ._checks import check_bool
from ._engine import Engine, Recomputed, logit_grad_coefficients
from ._options import LinearOptions, prologue

__all__ = ["LogprobResult", "linear_logprobs"]


@dataclasses.dataclass(frozen=True)
class LogprobResult:
    """Per-token results of :func:`linear_logprobs`, fp32 (fp64 for fp64 inputs).

    ``logprobs``: ``[n]``, ``0.0`` where the label is the ignore index.
    ``entropy``: ``[n]`` (every token, whatever its label), or ``None`` when not
    requested.
    ``lse``: ``[n]``, ``logsumexp(z)`` of the tempered logits over the whole
    vocabulary (every shard), every token whatever its label; differentiable
    (``d lse / dz_j = softmax(z)_j``): a z-loss ``lse ** 2`` is a token loss.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    lse: torch.Tensor


def _run(with_entropy: bool, eng: Engine) -> tuple[Any, ...]:
    """:class:`~._engine.Recomputed`'s run: the sweep's statistics and their gradient's terms."""
    stats, setup = eng.forward_stats(with_entropy=with_entropy), eng.setup
    kept = stats.detached()
    entropy = stats.entropy if stats.entropy is not None else stats.logprobs.new_empty(0)

    def grad_of(g_lp: Any, g_h: Any, g_lse: Any) -> Any:
        if g_lp is None and g_h is None and g_lse is None:
            return None
        return (
            kept,
            logit_grad_coefficients(kept, g_lp, g_h, setup.ignored, setup.acc_dtype, g_lse=g_lse),
            None,
        )

    return (stats.logprobs, entropy, stats.lse), (() if with_entropy else (entropy,)), grad_of


@checked_call()
def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    /,
    *,
    options: LinearOptions | None = None,
    with_entropy: bool = False,
    bias: torch.Tensor | None = None,
    **unexpected: Never,
) -> LogprobResult:
    """Selected-token logprobs (and entropy) of ``hidden @ weight.T``, vocab-parallel,
    never materialising the logits. Equal to::

        z = (gather(hidden) @ weight_full.T + bias_full) * logit_scale / T   # [n, V], fp32
        logprobs = where(labels == ignore_index, 0, log_softmax(z)[arange(n), labels])
        entropy = logsumexp(z) - (softmax(z) * z).sum(-1)        # >= 0
        lse = logsumexp(z)                                       # every token

    where ``weight_full`` stacks every rank's shard and ``gather`` is
    ``collectives.gather_hidden_states`` (sequence parallel); ``T``,
    ``logit_scale``, the shard and the tiles are ``options``
    (:class:`LinearOptions`).

    Cost: four GEMM-equivalents ``2 n h V_local`` (the engine's vocabulary sweep: the
    logits, then the logits again, ``dh`` and ``dW``); one tile of fp32 logits.

    Args:
        hidden: ``[n_local, h]``: this rank's rows (``n / tp`` under sequence
            parallel), gathered here, so its gradient holds every shard's part.
        weight: ``[V_local, h]``, this rank's vocab shard (``options.vocab``).
        labels: ``[n]`` global token ids of the gathered rows, or ``ignore_index``.
        options: :class:`LinearOptions` (default: ``LinearOptions()``).
        with_entropy: also return the entropy of ``softmax(z)``.
        bias: ``[V_local]`` (``weight``'s dtype and device), this rank's part of
            ``bias_full`` (0 when ``None``); differentiable.

    Returns:
        :class:`LogprobResult`, fp32 (fp64 for fp64 compute). NaN or inf in
        ``hidden`` or ``weight`` gives NaN at the tokens they touch, never a finite
        number. Differentiable once: a backward with ``create_graph=True`` raises,
        and so does a call inside ``torch.func.vmap`` / ``grad`` (``ContractError``
        naming the transformed input; use ``torch.autograd.grad``, and rows for vmap).
    """
    check_bool("with_entropy", with_entropy)
    _, h, setup = prologue("linear_logprobs", hidden, weight, labels, options, unexpected, bias=bias)
    run = functools.partial(_run, with_entropy)
    logprobs, entropy, lse = Recomputed.apply(h, weight, setup.bias, "linear_logprobs", setup, run)
    return LogprobResult(logprobs=logprobs, entropy=entropy if with_entropy else None, lse=lse)

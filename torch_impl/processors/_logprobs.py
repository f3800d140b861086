"""Selected-token logprobs and entropy: the engine's vocabulary sweep, forward and
recomputing backward (:func:`linear_logprobs`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Never

import torch

from hookspec import ContractError

from ..value_checks import checked_call
from ._checks import check_bool
from ._engine import Engine, Recomputed, logit_grad_coefficients
from ._gemm import not_traced
from ._options import LinearOptions, prologue
from ._sampling import SamplingSupport, supported_logprobs

__all__ = ["LogprobResult", "linear_logprobs"]


@dataclasses.dataclass(frozen=True)
class LogprobResult:
    """Per-token results of :func:`linear_logprobs` (its docstring's maths), ``[n]`` each,
    fp32 (fp64 for fp64 inputs), differentiable (``d lse / dz_j = softmax(z)_j``, ``d
    mean_logit / dz_j = 1 / V``: a z-loss and label smoothing are token losses);
    ``entropy`` and ``mean_logit`` ``None`` unless requested."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    lse: torch.Tensor
    mean_logit: torch.Tensor | None = None


def _run(with_entropy: bool, with_mean: bool, eng: Engine) -> tuple[Any, ...]:
    """:class:`~._engine.Recomputed`'s run: the sweep's statistics and their gradient's terms."""
    stats, setup = eng.forward_stats(with_entropy=with_entropy, with_mean=with_mean), eng.setup
    kept = stats.detached()
    empty = stats.logprobs.new_empty(0)
    entropy = stats.entropy if stats.entropy is not None else empty
    mean = stats.mean_logit if stats.mean_logit is not None else empty

    def grad_of(g_lp: Any, g_h: Any, g_lse: Any, g_mean: Any) -> Any:
        if g_lp is None and g_h is None and g_lse is None and g_mean is None:
            return None
        terms = {"g_lse": g_lse, "g_mean": g_mean, "vocab": setup.vocab_size}
        coef = logit_grad_coefficients(kept, g_lp, g_h, setup.ignored, setup.acc_dtype, **terms)
        return kept, coef, None

    frozen = (() if with_entropy else (entropy,)) + (() if with_mean else (mean,))
    return (stats.logprobs, entropy, stats.lse, mean), frozen, grad_of


@not_traced
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
    with_mean_logit: bool = False,
    mean_logit_weights: torch.Tensor | None = None,
    support: SamplingSupport | None = None,
    **unexpected: Never,
) -> LogprobResult:
    """Selected-token logprobs (and entropy) of ``hidden @ weight.T``, vocab-parallel,
    never materialising the logits. Equal to::

        z = (gather(hidden) @ weight_full.T + bias_full) * logit_scale / T   # [n, V], fp32
        logprobs = where(labels == ignore_index, 0, log_softmax(z)[arange(n), labels])
        entropy = logsumexp(z) - (softmax(z) * z).sum(-1)        # >= 0
        lse = logsumexp(z)                                       # every token
        mean_logit = z.mean(-1)                                  # with_mean_logit

    ``weight_full`` stacks every rank's shard; ``gather`` is ``collectives.gather_hidden_states``
    (sequence parallel); ``T``, ``logit_scale``, the shard and the tiles are ``options``
    (:class:`LinearOptions`; default ``LinearOptions()``). ``hidden`` ``[n_local, h]``: this
    rank's rows, gathered here (its gradient holds every shard's part); ``weight``
    ``[V_local, h]``, the shard; ``labels`` ``[n]`` global ids of the gathered rows, or
    ``ignore_index``; ``bias`` ``[V_local]`` (``weight``'s dtype and device; ``None``: 0),
    differentiable; ``mean_logit_weights`` ``[V_local]`` column weights ``c`` (detached) of
    a weighted ``mean_logit = sum_j c_j z_j / V`` (label smoothing with class weights;
    ``None``: each 1). ``support``: a :class:`SamplingSupport`, the tokens the rollout
    sampler kept per row: ``logprobs``, ``entropy`` and ``lse`` are then of the softmax
    renormalised over them (``z_y - logsumexp(z[kept])``; ``-inf`` for a label not kept),
    the gradient at the kept columns only (:mod:`._sampling`).

    Cost: four GEMM-equivalents ``2 n h V_local`` (the logits, then the logits again,
    ``dh`` and ``dW``); one tile of fp32 logits. NaN or inf in ``hidden`` or ``weight``
    gives NaN at the tokens they touch. Differentiable once: a backward with
    ``create_graph=True`` raises, and so does a call inside ``torch.func.vmap`` /
    ``grad`` (``ContractError`` naming the transformed input).
    """
    check_bool("with_entropy", with_entropy)
    check_bool("with_mean_logit", with_mean_logit)
    name, cw = "linear_logprobs", mean_logit_weights
    _, h, setup = prologue(
        name, hidden, weight, labels, options, unexpected, bias=bias, mean_weights=cw
    )
    if support is not None:  # the sampler's renormalised distribution (:mod:`._sampling`)
        if with_mean_logit:
            expected = "with_mean_logit=False with a sampling support"
            raise ContractError("with_mean_logit", expected=expected, actual="True")
        logprobs, entropy, lse = supported_logprobs(h, weight, setup, support, name)
        return LogprobResult(logprobs, entropy if with_entropy else None, lse, None)
    run = functools.partial(_run, with_entropy, with_mean_logit)
    logprobs, entropy, lse, mean = Recomputed.apply(h, weight, setup.bias, name, setup, run)
    return LogprobResult(
        logprobs, entropy if with_entropy else None, lse, mean if with_mean_logit else None
    )

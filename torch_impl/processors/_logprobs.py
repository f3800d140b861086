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
from ._gemm import not_traced
from ._options import LinearOptions, prologue
from ._sampling import SamplingSupport, support_logprobs

__all__ = ["LogprobResult", "linear_logprobs"]


@dataclasses.dataclass(frozen=True)
class LogprobResult:
    """Per-token results of :func:`linear_logprobs` (its docstring's maths), ``[n]`` each,
    fp32 (fp64 for fp64 inputs), differentiable (``d lse / dz_j = softmax(z)_j``, ``d
    mean_logit / dz_j = 1 / V``: a z-loss and label smoothing are token losses);
    ``entropy`` and ``mean_logit`` ``None`` unless requested. With a ``support``
    (``kept``: a row's kept tokens)::

        logprobs = where(labels == ignore_index, 0, z[y] - logsumexp(z[kept]))  # -inf: not kept
        entropy = -sum(q * log(q)),  q = softmax(z[kept])      # the kept distribution
        lse = logsumexp(z)                                      # still the whole vocabulary
        kept_logmass = logsumexp(z[kept]) - lse                 # <= 0, detached
        vocab_logprobs = where(labels == ignore_index, 0, z[y] - lse)

    ``vocab_logprobs``, differentiable, is what a reference policy taken without the support
    is compared with; it and ``kept_logmass`` are ``None`` without a support. With a support
    (:class:`SamplingSupport`: ``kept_ids [n, K]``, or ``top_k``, ``top_p``, ``min_p`` on ``z``)
    the gradient is over the kept tokens (none at a label not kept) and ``with_mean_logit`` is
    refused; its cost: ``docs/processors.md``, "Sampling replay"."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    lse: torch.Tensor
    mean_logit: torch.Tensor | None = None
    kept_logmass: torch.Tensor | None = None
    vocab_logprobs: torch.Tensor | None = None


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

    Args:
        hidden: ``[n_local, h]``, this rank's rows, gathered here by ``gather`` (sequence
            parallel: ``collectives.gather_hidden_states``); its gradient holds every shard's part.
        weight: ``[V_local, h]``, this rank's shard (``weight_full`` stacks every rank's).
        labels: ``[n]`` global ids of the gathered rows, or ``ignore_index``.
        options: ``T``, ``logit_scale``, the shard, the tiles (``None``: ``LinearOptions()``).
        with_entropy, with_mean_logit: also ``entropy``, also ``mean_logit``.
        bias: ``[V_local]`` (``weight``'s dtype and device; ``None``: 0), differentiable.
        mean_logit_weights: ``[V_local]`` column weights ``c`` (detached) of a weighted
            ``mean_logit = sum_j c_j z_j / V`` (label smoothing with class weights; None: each 1).
        support: a :class:`SamplingSupport`: the results of the kept distribution instead.

    Returns:
        :class:`LogprobResult`, ``[n]`` each; its docstring has the dtypes, gradients, support.

    Cost: four GEMM-equivalents ``2 n h V_local`` (the logits, then the logits again,
    ``dh`` and ``dW``); one tile of fp32 logits. NaN or inf in ``hidden`` or ``weight``
    gives NaN at the tokens they touch. Differentiable once: a backward with
    ``create_graph=True`` raises, and so does a call inside ``torch.func.vmap`` /
    ``grad`` (``ContractError`` naming the transformed input).
    """
    check_bool("with_entropy", with_entropy)
    check_bool("with_mean_logit", with_mean_logit)
    name, cw = "linear_logprobs", mean_logit_weights
    if support is not None:  # the kept distribution: the _sampling module's sweeps
        mean = with_mean_logit or cw is not None
        outputs = support_logprobs(hidden, weight, labels, support, options, unexpected, bias=bias,
                                   with_entropy=with_entropy, with_mean=mean)  # fmt: skip
        return LogprobResult(*outputs[:3], kept_logmass=outputs[3], vocab_logprobs=outputs[4])
    _, h, setup = prologue(
        name, hidden, weight, labels, options, unexpected, bias=bias, mean_weights=cw
    )
    run = functools.partial(_run, with_entropy, with_mean_logit)
    logprobs, entropy, lse, mean = Recomputed.apply(h, weight, setup.bias, name, setup, run)
    return LogprobResult(
        logprobs, entropy if with_entropy else None, lse, mean if with_mean_logit else None
    )

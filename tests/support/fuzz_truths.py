"""The contract fuzzer's float64 truths: every quantity of ``hookspec.conventions``
computed from materialised float64 logits, written out independently of
``torch_impl`` (no import from it), and the tolerances a draw's dtypes allow.

Layout: ``z`` ``[..., V]`` (tokens first, any batch shape), labels ``[...]``.

Tolerance model. The implementation forms ``z = h @ W.T * c / T`` with GEMM
operands in a compute dtype (unit roundoff ``u_c``) accumulating in ``u_a`` (fp32 or
fp64); each logit is then off by at most::

    zerr = ((h + 2) * u_a + 3 * u_c) * (|h| @ |W|.T) * c / T

A log-softmax moves by at most ``2 * zerr``; a gradient by ``~zerr`` relative to the
magnitude of its terms (``|dL/dz| @ |W|`` for ``dh``). The bounds below take these with
a margin of 4 and add the output dtype's rounding: loose enough for rounding, tight
enough that the defects of the past rounds (errors of 1e-3 to 1) fail.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = [
    "Precision",
    "TAIL_FLOOR_64",
    "aggregation_weights64",
    "divergence64",
    "kl_estimate64",
    "masked_mean64",
    "sparse_sets64",
    "token_stats64",
]

TAIL_FLOOR_64 = 2.0**-126


def unit(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2


@dataclasses.dataclass(frozen=True)
class Precision:
    """How exactly a draw can be computed: ``zerr`` (the logits' error bound, per
    token ``[...]``), the accumulation's and the output's unit roundoff."""

    zerr: torch.Tensor  # [...] per token
    acc: float  # unit roundoff of the accumulation (fp32 or fp64)
    operand: float = 0.0  # unit roundoff of the GEMM operands (the compute dtype)

    @staticmethod
    def of(
        h_abs: torch.Tensor,
        w_abs: torch.Tensor,
        inv: Any,
        *,
        compute: torch.dtype,
        acc: torch.dtype,
    ) -> Precision:
        """``h_abs`` ``[..., h]``, ``w_abs`` ``[V, h]`` (absolute values, float64),
        ``inv`` the factor ``c / T`` (a number or ``[...]``)."""
        hdim = h_abs.shape[-1]
        mag = (h_abs @ w_abs.T).amax(-1) * torch.as_tensor(inv, dtype=torch.float64)
        zerr = ((hdim + 2) * unit(acc) + 3 * unit(compute)) * mag
        return Precision(zerr=zerr, acc=unit(acc), operand=unit(compute))

    @property
    def zmax(self) -> float:
        return float(self.zerr.detach().max()) if self.zerr.numel() else 0.0

    def value_tol(self, truth: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        """The bound for a value ``truth`` that moves by at most ``scale * zerr``."""
        return 8 * scale * self.zmax + 64 * self.acc * (1 + truth.detach().abs().double())

    def grad_tol(
        self, magnitude: torch.Tensor, out_dtype: torch.dtype, truth: torch.Tensor, *, floor: float
    ) -> torch.Tensor:
        """The bound for a gradient whose terms sum to ``magnitude`` (``|dL/dz| @ |W|``),
        returned in ``out_dtype``; ``floor``: the rounding of terms that cancel exactly."""
        u_out = unit(out_dtype) if unit(out_dtype) > self.acc else 0.0
        rel = 8 * self.zmax + 256 * self.acc + 4 * self.operand  # the backward GEMMs' operands
        mag = magnitude.double()
        # partial sums (tiles, ranks) may each be rounded to out_dtype; subnormals round
        # to a fixed spacing
        spacing = (
            float(torch.finfo(out_dtype).tiny) * float(torch.finfo(out_dtype).eps) if u_out else 0.0
        )
        rounded = (truth.detach().abs().double() + mag) * 2 * u_out + 2 * spacing
        return rel * mag + rounded + floor


def token_stats64(
    z: torch.Tensor, labels: torch.Tensor | None, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(log_softmax(z) [..., V], logprob of the label [...] (0 where ignored),
    entropy [...])``."""
    logp = torch.log_softmax(z, -1)
    entropy = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    if labels is None:
        return logp, None, entropy
    ignored = labels == ignore_index
    picked = logp.gather(-1, torch.where(ignored, 0, labels)[..., None]).squeeze(-1)
    return logp, torch.where(ignored, 0.0, picked), entropy


def aggregation_weights64(
    m: torch.Tensor,
    segments: torch.Tensor,
    count: int,
    how: str,
    *,
    global_tokens: float | None,
    global_sequences: float | None,
    totals: torch.Tensor | None = None,
) -> torch.Tensor:
    """``w`` with ``aggregate(L) = sum(w * L)`` (``hookspec.conventions``), written out
    sequence by sequence."""
    m = m.double()
    w = torch.zeros_like(m)
    if how == "token-mean":
        total = float(m.sum()) if global_tokens is None else float(global_tokens)
        return m / total if total != 0 else w
    n_k = (
        [float(m[segments == k].sum()) for k in range(count)] if totals is None else totals.tolist()
    )
    live = sum(1 for n in n_k if n != 0)
    k_count = float(global_sequences) if global_sequences is not None else float(max(live, 1))
    for k in range(count):
        sel = segments == k
        if how == "seq-mean-token-sum":
            w = torch.where(sel, m / k_count, w)
        elif n_k[k] != 0:
            w = torch.where(sel, m / (n_k[k] * k_count), w)
    return w


def masked_mean64(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``sum(x * m) / sum(m)`` over ``m > 0``, 0 for an empty mask."""
    m = m.double()
    total = m.sum()
    s = (torch.where(m > 0, x.double(), 0.0) * m).sum()
    return s / total if float(total) != 0 else s * 0


def kl_estimate64(
    logp: torch.Tensor, ref: torch.Tensor, estimator: str, clamp: float | None
) -> torch.Tensor:
    """k1, k2, k3 of ``r = clamp(ref - logp)``."""
    r = ref - logp
    if clamp is not None:
        r = r.clamp(-clamp, clamp)
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return 0.5 * r * r
    return torch.exp(r) - r - 1


def _xlogy(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(w * (a - b))``, a term of weight 0 being 0; the double ``where`` keeps an
    infinite ``a - b`` there (a teacher's probability 0) out of every gradient."""
    zero = w == 0
    return torch.where(zero, 0.0, w * torch.where(zero, 0.0, a - b)).sum(-1)


def divergence64(log_p: torch.Tensor, log_q: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """``D(P, Q)`` over the last dim (a term whose weight is 0 is 0)."""
    p, q = log_p.exp(), log_q.exp()
    if kind == "forward-kl":
        return _xlogy(p, log_p, log_q)
    if kind == "reverse-kl":
        return _xlogy(q, log_q, log_p)
    log_m = torch.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
    return beta * _xlogy(p, log_p, log_m) + (1 - beta) * _xlogy(q, log_q, log_m)


def sparse_sets64(
    lp_t: torch.Tensor, z: torch.Tensor, ids: torch.Tensor, tail: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log P, log Q, p_tail, q_tail)`` of a sparse teacher ``lp_t [..., k]`` at ``ids
    [..., k]`` and the student's tempered logits ``z [..., V]``; the tails are 0 for
    ``renormalize``. Each tail as the mass it is, in float64: the teacher's ``1 -
    sum(exp(lp_t))``, the student's the sum of its probabilities outside ``ids``
    (exactly 0 where they cover the vocabulary)."""
    lp_t = lp_t.double()
    u = z.gather(-1, ids)
    if tail == "renormalize":
        zero = torch.zeros(u.shape[:-1], dtype=torch.float64)
        return (
            lp_t - torch.logsumexp(lp_t, -1, keepdim=True),
            u - torch.logsumexp(u, -1, keepdim=True),
            zero,
            zero,
        )
    log_q = u - torch.logsumexp(z, -1, keepdim=True)
    outside = torch.ones_like(z).scatter(-1, ids, 0.0)
    p_tail = (1 - lp_t.exp().sum(-1)).clamp_min(TAIL_FLOOR_64)
    q_tail = (torch.softmax(z, -1) * outside).sum(-1).clamp_min(TAIL_FLOOR_64)
    log_p = torch.cat([lp_t, p_tail.log()[..., None]], -1)
    log_q = torch.cat([log_q, q_tail.log()[..., None]], -1)
    return log_p, log_q, p_tail, q_tail

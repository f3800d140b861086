"""Synthetic and adversarial torch contexts for the cross-check.

Each builds a ``hookspec.OutputContext`` by hand, with no Megatron model: hidden
states ``[s, b, h]``, a weight leaf ``[V, h]`` (``vocab_weight``, and the
``weight`` of a small stand-in output layer for upstream-style processors),
labels with a few ``ignore_index`` entries and a loss mask. The kinds:

- ``random``: unit-scale hidden states, logits of spread ~2.
- ``strongly-negative``: every logit near ``-150``: ``exp(z)`` underflows to 0
  in fp32 and bf16, so a softmax without the max shift (or a running max
  started at 0, veRL #7439) returns NaN or -inf.
- ``peaked``: one logit per token ~25 above the rest (softmax near one-hot),
  half of them on the label.
- ``masked``: a fully masked sequence and many ignored labels (empty
  aggregations, zero gradients).
- ``awkward``: sizes that divide nothing (b=3, s=7, h=13, V=67), with the
  masking of ``masked``.
- ``ties``: small integers in the hidden states and the weight (every logit
  exact in any dtype and summation order) and equal weight rows, so that
  tokens have equal logits, which a top-k must order by id.

The default sizes are the tiny GPT's (b=3, s=8, h=32, V=64), so that JAX
compiles the reference's operations once for both.
"""

from __future__ import annotations

from typing import Any

import torch

from hookspec import IGNORE_INDEX, OutputContext, VocabShard
from torch_impl.context import no_logit_scaling

__all__ = ["CASE_KINDS", "StandInOutputLayer", "synthetic_context"]

CASE_KINDS: tuple[str, ...] = ("random", "strongly-negative", "peaked", "masked", "awkward", "ties")


class StandInOutputLayer(torch.nn.Module):
    """Megatron's ``ColumnParallelLinear`` call at tp=1, for synthetic contexts:
    ``layer(x, weight=None) -> (x @ (weight or self.weight).T, None)``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor | None = None, **_: Any
    ) -> tuple[torch.Tensor, None]:
        return torch.matmul(x, (self.weight if weight is None else weight).t()), None


def _cross_entropy(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Megatron's ``compute_language_model_loss`` signature at tp=1: labels
    ``[b, s]``, logits ``[s, b, V]`` -> unreduced loss ``[b, s]`` (float32)."""
    s, b, v = logits.shape
    flat = torch.nn.functional.cross_entropy(
        logits.float().reshape(s * b, v),
        labels.t().reshape(-1),
        reduction="none",
        ignore_index=IGNORE_INDEX,
    )
    return flat.reshape(s, b).t()


def synthetic_context(
    kind: str = "random",
    /,
    *,
    batch: int = 3,
    seq: int = 8,
    hidden: int = 32,
    vocab: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    context: Any = None,
) -> OutputContext:
    """An ``OutputContext`` of the given ``kind`` (module docstring), in ``dtype``."""
    if kind not in CASE_KINDS:
        raise ValueError(f"kind must be one of {CASE_KINDS}, got {kind!r}")
    if kind == "awkward":
        batch, seq, hidden, vocab = 3, 7, 13, 67
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(seq, batch, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * (2.0 / hidden**0.5)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq)
    if kind == "strongly-negative":
        u = torch.randn(hidden, generator=g, dtype=torch.float64)
        u = u / u.norm()
        h = 12.0 * u + 0.05 * h  # every logit ~ -150 +- 1.5
        w = -12.5 * u + 0.1 * w / (2.0 / hidden**0.5)
    elif kind == "peaked":
        top = torch.randint(0, vocab, (seq, batch), generator=g)
        hit = torch.rand(batch, seq, generator=g) < 0.5
        labels = torch.where(hit, top.t(), labels)
        w = 0.2 * w
        h = 0.2 * h + 25.0 * w[top] / w[top].pow(2).sum(-1, keepdim=True)
    elif kind == "ties":
        h = torch.randint(-2, 3, (seq, batch, hidden), generator=g).double()
        w = torch.randint(-1, 2, (vocab, hidden), generator=g).double()
        w[1::4] = w[0::4][: w[1::4].shape[0]]  # rows 4j and 4j + 1 equal
    if kind in ("masked", "awkward"):
        mask[-1] = 0
        mask[0, ::2] = 0
        labels[0, 1::3] = IGNORE_INDEX
    labels[0, -1] = IGNORE_INDEX
    h = h.to(dtype)
    weight = w.to(dtype).requires_grad_()
    return OutputContext(
        hidden_states=h,
        output_layer=StandInOutputLayer(weight),
        output_weight=None,
        labels=labels,
        loss_mask=mask,
        input_ids=labels.clamp(min=0),
        position_ids=torch.arange(seq).expand(batch, seq),
        context=context,
        compute_language_model_loss=_cross_entropy,
        scale_logits=no_logit_scaling,
        vocab_weight=weight,
        vocab=VocabShard(0, vocab, vocab),
    )

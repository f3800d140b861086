"""A ``flax.nnx`` module mirroring Megatron's output layer, loadable from torch.

Megatron's GPT output layer is a ``ColumnParallelLinear`` without bias whose
weight is ``[V, h]`` (the word-embedding table when embeddings are tied), and
``_scale_logits`` multiplies the logits by ``mup_output_mult`` under MuP::

    logits = (hidden @ weight.T + bias) * logit_scale      # [..., h] -> [..., V]

:class:`OutputHead` is that, in JAX, with its weight (and optional bias) as
``nnx.Param`` s, so ``nnx.grad`` gives the weight gradient the reference's VJP
gives. :meth:`OutputHead.from_torch` and :meth:`OutputHead.from_megatron`
load it over DLPack (zero-copy for the exchange; ``dtype`` casts after it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hookspec import IGNORE_INDEX

from .references import LinearLogprobs, linear_logits, linear_logprobs

__all__ = ["OutputHead"]


class OutputHead(nnx.Module):
    """``logits = (hidden @ weight.T + bias) * logit_scale``, weight ``[V, h]``.

    ``tied``: the weight is the embedding table (informative: the maths is
    the same; it tells where the weight came from).
    """

    def __init__(
        self,
        weight: jax.Array,
        bias: jax.Array | None = None,
        *,
        tied: bool = False,
        logit_scale: float = 1.0,
    ) -> None:
        if weight.ndim != 2:
            raise ValueError(f"weight must be [V, h], got shape {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [V={weight.shape[0]}], got shape {tuple(bias.shape)}")
        self.weight = nnx.Param(weight)
        self.bias = nnx.Param(bias) if bias is not None else None
        self.tied = tied
        self.logit_scale = float(logit_scale)

    @property
    def vocab_size(self) -> int:
        return int(self.weight[...].shape[0])

    def __call__(self, hidden: jax.Array) -> jax.Array:
        """``[..., h] -> [..., V]`` logits, in float64 (inside ``jax_ref.float64``)."""
        bias = None if self.bias is None else self.bias[...]
        return linear_logits(hidden, self.weight[...], bias=bias, scale=self.logit_scale)

    def logprobs(
        self,
        hidden: jax.Array,
        labels: jax.Array,
        /,
        *,
        temperature: Any = 1.0,
        ignore_index: int = IGNORE_INDEX,
        with_entropy: bool = False,
    ) -> LinearLogprobs:
        """Selected-token logprobs (and entropy) of this head: ``[..., h]``, ``[...]``."""
        bias = None if self.bias is None else self.bias[...]
        return linear_logprobs(
            hidden,
            self.weight[...],
            labels,
            temperature=temperature,
            ignore_index=ignore_index,
            with_entropy=with_entropy,
            bias=bias,
            logit_scale=self.logit_scale,
        )

    @classmethod
    def from_torch(
        cls,
        weight: Any,
        bias: Any = None,
        /,
        *,
        tied: bool = False,
        logit_scale: float = 1.0,
        dtype: Any = None,
    ) -> OutputHead:
        """A head over torch tensors, exchanged over DLPack (shared buffers);
        ``dtype`` (e.g. ``jnp.float64``) casts after the exchange, a copy."""
        from .check.dlpack import to_jax

        w = to_jax(weight, field="weight")
        b = None if bias is None else to_jax(bias, field="bias")
        if dtype is not None:
            w = w.astype(dtype)
            b = None if b is None else b.astype(dtype)
        return cls(w, b, tied=tied, logit_scale=logit_scale)

    @classmethod
    def from_megatron(cls, model: Any, /, *, dtype: Any = jnp.float64) -> OutputHead:
        """The output head of a Megatron ``GPTModel`` (unwrapped from
        ``Float16Module``/DDP): its output weight, or the embedding table when
        embeddings are tied, the output layer's bias if any, and MuP's
        ``mup_output_mult`` when ``config.use_mup``."""
        from torch_impl import unwrap_model

        from ._x64 import float64

        inner: Any = unwrap_model(model)  # a GPTModel: its attributes, not nn.Module's __getattr__
        tied = bool(getattr(inner, "share_embeddings_and_output_weights", False))
        weight = inner.shared_embedding_or_output_weight() if tied else inner.output_layer.weight
        bias = getattr(inner.output_layer, "bias", None)
        config = inner.config
        scale = float(config.mup_output_mult) if getattr(config, "use_mup", False) else 1.0
        with float64():
            return cls.from_torch(weight, bias, tied=tied, logit_scale=scale, dtype=dtype)

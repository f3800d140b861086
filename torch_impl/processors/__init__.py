"""Production processors: selected-token logprobs, entropy, cross entropy and policy
losses from the hidden states and the vocab shard, never materialising the logits.

- :func:`linear_logprobs`: the tensor function underneath (vocab parallel,
  online logsumexp, logits recomputed in backward).
- :func:`fused_token_loss`: a scalar loss of per-token terms whose gradients
  are formed in the forward pass (no recomputation).
- Processors for ``enable_output_processor``: :func:`selected_logprobs`,
  :func:`cross_entropy_loss`, :func:`policy_loss` (with :class:`PolicyBatch`
  as the user context and :class:`PolicyLossConfig`).
"""

from ._fused import FUSED_TILE_ELEMENTS, FusedLossResult, TokenLoss, fused_token_loss
from ._logprobs import DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK, LogprobResult, linear_logprobs
from ._policy import PolicyBatch, policy_loss
from ._policy_math import PolicyLossConfig, RatioLevel, aggregation_weights, kl_penalty
from ._processors import cross_entropy_loss, selected_logprobs

__all__ = [
    "DEFAULT_TOKEN_CHUNK",
    "DEFAULT_VOCAB_CHUNK",
    "FUSED_TILE_ELEMENTS",
    "FusedLossResult",
    "LogprobResult",
    "PolicyBatch",
    "PolicyLossConfig",
    "RatioLevel",
    "TokenLoss",
    "aggregation_weights",
    "cross_entropy_loss",
    "fused_token_loss",
    "kl_penalty",
    "linear_logprobs",
    "policy_loss",
    "selected_logprobs",
]

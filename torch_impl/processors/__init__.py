"""Production processors: selected-token logprobs, entropy, cross entropy and policy
losses from the hidden states and the vocab shard, never materialising the logits.

- :func:`linear_logprobs`: the tensor function underneath (vocab parallel,
  online logsumexp, logits recomputed in backward).
- :func:`fused_token_loss`: a scalar loss of per-token terms whose gradients
  are formed in the forward pass (no recomputation).
- Processors for ``enable_output_processor``: :func:`selected_logprobs`,
  :func:`cross_entropy_loss`, :func:`policy_loss` (with :class:`PolicyBatch`
  as the user context and :class:`PolicyLossConfig`).
- :func:`linear_topk_logprobs` and its processor :func:`topk_logprobs`: the
  ``k`` largest logprobs per token and their ids, vocab parallel.
- :func:`distillation_loss` (:class:`DistillConfig`, with :class:`SparseTeacher`
  or :class:`DenseTeacher` as the user context): KL or JSD to a teacher.
"""

from ._distill import DenseTeacher, DistillConfig, SparseTeacher, distillation_loss
from ._fused import FUSED_TILE_ELEMENTS, FusedLossResult, TokenLoss, fused_token_loss
from ._logprobs import DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK, LogprobResult, linear_logprobs
from ._policy import PolicyBatch, policy_loss
from ._policy_math import PolicyLossConfig, RatioLevel, aggregation_weights, kl_penalty
from ._processors import cross_entropy_loss, selected_logprobs
from ._topk import TopkResult, linear_topk_logprobs, topk_logprobs

__all__ = [
    "DEFAULT_TOKEN_CHUNK",
    "DEFAULT_VOCAB_CHUNK",
    "DenseTeacher",
    "DistillConfig",
    "FUSED_TILE_ELEMENTS",
    "FusedLossResult",
    "LogprobResult",
    "PolicyBatch",
    "PolicyLossConfig",
    "RatioLevel",
    "SparseTeacher",
    "TokenLoss",
    "TopkResult",
    "aggregation_weights",
    "cross_entropy_loss",
    "distillation_loss",
    "fused_token_loss",
    "kl_penalty",
    "linear_logprobs",
    "linear_topk_logprobs",
    "policy_loss",
    "selected_logprobs",
    "topk_logprobs",
]

"""Production processors: selected-token logprobs, entropy, cross entropy and policy
losses from the hidden states and the vocab shard, never materialising the logits.

- :func:`linear_logprobs`: the tensor function underneath (vocab parallel,
  online logsumexp, logits recomputed in backward).
- :func:`fused_token_loss`: a scalar loss of per-token terms whose gradients
  are formed in the forward pass (no recomputation); the fused policy loss and
  ``cross_entropy_loss(reduction="sum" | "mean")`` run on it.
- Processors for ``enable_output_processor``: :func:`selected_logprobs`,
  :func:`cross_entropy_loss`, :func:`policy_loss` (with :class:`PolicyBatch`
  as the user context and :class:`PolicyLossConfig`).
- :func:`linear_topk_logprobs` and its processor :func:`topk_logprobs`: the
  ``k`` largest logprobs per token and their ids, vocab parallel.
- :func:`distillation_loss` (:class:`DistillConfig`, with :class:`SparseTeacher`
  or :class:`DenseTeacher` as the user context): KL or JSD to a teacher.
- Chunk sizes per device (:data:`LOGITS_CHUNK_BYTES`, :data:`TILES_BY_DEVICE`) and what
  ``backend="auto"`` runs on a device (:func:`auto_choice`, :data:`MEASURED_CHOICES`).
"""

from ._backends import MEASURED_CHOICES, BackendChoice, auto_choice, device_class
from ._distill import DenseTeacher, DistillConfig, SparseTeacher, distillation_loss
from ._fused import FusedLossResult, TokenLoss, fused_token_loss
from ._geometry import GRAD_BUFFER_BYTES, TILE_BYTES, TILES_BY_DEVICE
from ._logprobs import LogprobResult, linear_logprobs
from ._options import LinearOptions
from ._policy import PolicyBatch, policy_loss
from ._policy_math import PolicyLossConfig, RatioLevel, aggregation_weights, kl_penalty
from ._processors import cross_entropy_loss, selected_logprobs
from ._topk import TopkResult, linear_topk_logprobs, topk_logprobs

__all__ = [
    "BackendChoice",
    "DenseTeacher",
    "DistillConfig",
    "FusedLossResult",
    "GRAD_BUFFER_BYTES",
    "LinearOptions",
    "LogprobResult",
    "MEASURED_CHOICES",
    "PolicyBatch",
    "PolicyLossConfig",
    "RatioLevel",
    "SparseTeacher",
    "TILES_BY_DEVICE",
    "TILE_BYTES",
    "TokenLoss",
    "TopkResult",
    "aggregation_weights",
    "auto_choice",
    "cross_entropy_loss",
    "device_class",
    "distillation_loss",
    "fused_token_loss",
    "kl_penalty",
    "linear_logprobs",
    "linear_topk_logprobs",
    "policy_loss",
    "selected_logprobs",
    "topk_logprobs",
]

"""Production processors: logprobs, entropy, cross entropy, policy losses, top-k and
distillation from the hidden states and the vocab shard, never materialising the logits,
all epilogues on one tile engine (``docs/architecture.md``). Each processor for
``enable_output_processor`` has a tensor function underneath (``linear_*``,
:func:`fused_token_loss`) whose options are one :class:`LinearOptions`
(``docs/processors.md`` lists them all). A processor of one's own calls them on
:func:`context_rows` with ``LinearOptions.from_context`` and returns :func:`from_rows`
(``docs/writing-processors.md``).
"""

from ._backends import MEASURED_CHOICES, BackendChoice, auto_choice, device_class
from ._distill import (
    DenseTeacher,
    DistillConfig,
    DistillResult,
    SparseTeacher,
    distillation_loss,
    linear_distillation_loss,
)
from ._fused import FusedLossResult, LseLoss, MeanLogitLoss, TokenLoss, fused_token_loss
from ._geometry import GRAD_BUFFER_BYTES, TILE_BYTES, TILES_BY_DEVICE
from ._inputs import ContextRows, context_rows, from_rows, to_rows
from ._logprob_processors import cross_entropy_loss, selected_logprobs
from ._logprobs import LogprobResult, linear_logprobs
from ._loss_math import (
    PolicyLossConfig,
    PolicyLossMode,
    RatioLevel,
    aggregation_weights,
    kl_penalty,
)
from ._options import LinearOptions
from ._policy import PolicyBatch, policy_loss
from ._preference import PreferenceBatch, PreferenceConfig, PreferenceMethod, preference_loss
from ._rollout import (
    RejectionBounds,
    RolloutCorrection,
    RolloutCorrectionResult,
    WeightLevel,
    rollout_correction,
)
from ._sampling import SamplingSupport
from ._topk import TopkResult, linear_topk_logprobs, topk_logprobs

__all__ = [
    "BackendChoice",
    "ContextRows",
    "DenseTeacher",
    "DistillConfig",
    "DistillResult",
    "FusedLossResult",
    "GRAD_BUFFER_BYTES",
    "LinearOptions",
    "LogprobResult",
    "LseLoss",
    "MeanLogitLoss",
    "MEASURED_CHOICES",
    "PolicyBatch",
    "PolicyLossConfig",
    "PolicyLossMode",
    "PreferenceBatch",
    "PreferenceConfig",
    "PreferenceMethod",
    "RatioLevel",
    "RejectionBounds",
    "RolloutCorrection",
    "RolloutCorrectionResult",
    "SamplingSupport",
    "SparseTeacher",
    "TILES_BY_DEVICE",
    "TILE_BYTES",
    "TokenLoss",
    "TopkResult",
    "WeightLevel",
    "aggregation_weights",
    "auto_choice",
    "context_rows",
    "cross_entropy_loss",
    "device_class",
    "distillation_loss",
    "from_rows",
    "fused_token_loss",
    "kl_penalty",
    "linear_distillation_loss",
    "linear_logprobs",
    "linear_topk_logprobs",
    "policy_loss",
    "rollout_correction",
    "preference_loss",
    "selected_logprobs",
    "to_rows",
    "topk_logprobs",
]

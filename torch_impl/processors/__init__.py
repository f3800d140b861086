"""Production processors: logprobs, entropy, cross entropy, policy losses, top-k and
distillation from the hidden states and the vocab shard, never materialising the logits,
all epilogues on one tile engine (``docs/architecture.md``). Each processor for
``enable_output_processor`` has a tensor function underneath (``linear_*``,
:func:`fused_token_loss`) whose options are one :class:`LinearOptions`
(``docs/processors.md`` lists them all). A processor of one's own calls them on
:func:`context_rows` with :func:`context_options` and returns :func:`from_rows`
(``docs/writing-processors.md``).

Where to start reading: ``__all__`` below is the public surface (``docs/processors.md``
documents each name). Then follow one call down, a module a step
(``docs/architecture.md``, "One call, hook to kernel", draws it):

1. the processor the hook calls, made by a public factory: ``selected_logprobs``,
   ``cross_entropy_loss`` (``_logprob_processors``), ``policy_loss`` (``_policy``),
   ``topk_logprobs`` (``_topk``), ``distillation_loss`` (``_distill``); each reads the
   hook's context through ``_inputs.hook_inputs``;
2. its tensor function: ``linear_logprobs`` (``_logprobs``; with a support,
   ``_sampling``), ``fused_token_loss`` (``_fused``), ``linear_topk_logprobs``
   (``_topk``), ``linear_distillation_loss`` (``_distill``);
3. the prologue every tensor function opens with: ``_options.prologue``, which checks
   the inputs and builds the call's ``TileSetup`` (``_tiles``);
4. the engine: ``Recomputed`` or ``FormedInForward`` around ``Engine`` (``_engine``), its
   vocabulary sweep (``forward_stats``, ``backward``) or row sweep (``row_sweep``; the
   fused loss's ``_single_pass``; the gradient buffer ``_sink``) over ``Tiles``
   (``_tiles``);
5. the passes over a tile (``Engine.stats_pass``, ``Engine.grad_pass``) and the kernels:
   the GEMMs (``_gemm.gemm_into``), the torch ops in ``_engine``, the Triton kernels in
   ``_triton_kernels`` (tile sizes and launch shapes: ``_geometry``).
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
from ._inputs import ContextRows, context_options, context_rows, from_rows, to_rows
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
    "context_options",
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

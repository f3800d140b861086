"""hookspec: the framework-neutral contract between RL training loops and the
output hook of Megatron Core.

It imports neither torch nor jax: a typed :class:`OutputContext`, the processor
protocols, the :class:`Collectives` a processor may call, the conventions of the
standard quantities (``hookspec.conventions``) and validation that raises
:class:`ContractError`.
"""

from ._version import SPEC_VERSION
from .arrays import Array
from .collectives import Collectives, SingleProcessCollectives
from .context import OutputContext, ParallelLayout, VocabShard
from .conventions import IGNORE_INDEX, UPSTREAM_HOOK_KEYWORDS, Aggregation, KLEstimator
from .errors import ContractError
from .processor import (
    OutputProcessor,
    Processor,
    ProcessorResult,
    UpstreamOutputProcessor,
    is_hookspec_processor,
    processor,
)
from .validation import check_labels, validate_context, validate_result

__all__ = [
    "IGNORE_INDEX",
    "SPEC_VERSION",
    "UPSTREAM_HOOK_KEYWORDS",
    "Aggregation",
    "Array",
    "Collectives",
    "ContractError",
    "KLEstimator",
    "OutputContext",
    "OutputProcessor",
    "ParallelLayout",
    "Processor",
    "ProcessorResult",
    "SingleProcessCollectives",
    "UpstreamOutputProcessor",
    "VocabShard",
    "check_labels",
    "is_hookspec_processor",
    "processor",
    "validate_context",
    "validate_result",
]

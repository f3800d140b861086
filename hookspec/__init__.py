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
from .conventions import (
    IGNORE_INDEX,
    TAIL_FLOOR,
    UPSTREAM_HOOK_KEYWORDS,
    UPSTREAM_HOOK_SOURCES,
    Aggregation,
    DistillDivergence,
    KLEstimator,
    TeacherTail,
    UpstreamHookSources,
)
from .errors import ContractError
from .processor import Processor, check_upstream_processor, is_hookspec_processor, processor
from .validation import (
    INT64_MAX,
    INT64_MIN,
    check_int64,
    check_labels,
    validate_collectives,
    validate_context,
    validate_mtp_result,
    validate_result,
)

__all__ = [
    "IGNORE_INDEX",
    "TAIL_FLOOR",
    "INT64_MAX",
    "INT64_MIN",
    "SPEC_VERSION",
    "UPSTREAM_HOOK_KEYWORDS",
    "UPSTREAM_HOOK_SOURCES",
    "Aggregation",
    "Array",
    "Collectives",
    "ContractError",
    "DistillDivergence",
    "KLEstimator",
    "OutputContext",
    "ParallelLayout",
    "Processor",
    "SingleProcessCollectives",
    "TeacherTail",
    "UpstreamHookSources",
    "VocabShard",
    "check_int64",
    "check_labels",
    "check_upstream_processor",
    "is_hookspec_processor",
    "processor",
    "validate_collectives",
    "validate_context",
    "validate_mtp_result",
    "validate_result",
]

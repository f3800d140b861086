"""torch_impl: the PyTorch / Megatron Core implementation of the hookspec contract."""

from .collectives import TorchCollectives
from .context import build_output_context, parallel_layout
from .enable import (
    HookOptions,
    disable_output_processor,
    enable_output_processor,
    has_native_hook,
    is_output_processor_enabled,
    require_output_processor,
    unwrap_model,
)
from .mtp import default_mtp_loss, detached_head
from .schedule_plan import build_schedule_plan, plan_loss_func

__all__ = [
    "HookOptions",
    "TorchCollectives",
    "build_output_context",
    "build_schedule_plan",
    "default_mtp_loss",
    "detached_head",
    "disable_output_processor",
    "enable_output_processor",
    "has_native_hook",
    "is_output_processor_enabled",
    "parallel_layout",
    "plan_loss_func",
    "require_output_processor",
    "unwrap_model",
]

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
from .mtp import chunked_mtp_loss, default_mtp_loss, mtp_loss_processor
from .schedule_plan import build_schedule_plan, plan_loss_func

__all__ = [
    "HookOptions",
    "TorchCollectives",
    "build_output_context",
    "build_schedule_plan",
    "chunked_mtp_loss",
    "default_mtp_loss",
    "disable_output_processor",
    "enable_output_processor",
    "has_native_hook",
    "is_output_processor_enabled",
    "mtp_loss_processor",
    "parallel_layout",
    "plan_loss_func",
    "require_output_processor",
    "unwrap_model",
]

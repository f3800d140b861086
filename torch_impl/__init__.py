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

__all__ = [
    "HookOptions",
    "TorchCollectives",
    "build_output_context",
    "disable_output_processor",
    "enable_output_processor",
    "has_native_hook",
    "is_output_processor_enabled",
    "parallel_layout",
    "require_output_processor",
    "unwrap_model",
]

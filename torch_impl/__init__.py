"""torch_impl: the PyTorch / Megatron Core implementation of the hookspec contract.

The names below load on first use (PEP 562): ``import torch_impl.processors``
imports torch alone, never Megatron Core. The call layer (the adapter, ``enable``,
``mtp``, the schedule plan) and the processors do not import each other: a
processor reaches the model through the hook's ``OutputContext`` only (the doctor,
a tool above both, imports the processors to check them).

Where to start reading:

1. The public surface: ``__all__`` below (``enable_output_processor`` in ``enable.py``
   wraps a model; ``HookOptions``, ``MTPOptions``) and ``torch_impl.processors``' own
   ``__all__`` (the processors and their tensor functions).
2. The call layer, one forward: ``enable`` wraps the model in the adapter
   (``_adapter``), whose forward makes one ``_call.ForwardCall``; Megatron's
   ``_postprocess`` (on a release without the hook, ``_postprocess.finish_postprocess``) calls
   ``ForwardCall.main``, which builds the ``OutputContext`` (``context``) and calls the
   processor (``docs/architecture.md``, "The path of ``hidden_states``").
3. The processors, one call: the processor -> its tensor function -> the prologue ->
   the engine's sweep, pass and kernel: ``torch_impl.processors``' docstring and
   ``docs/architecture.md``, "One call, hook to kernel", which names each step's file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hookspec.lazy import LazyNames

if TYPE_CHECKING:
    from ._compat import InstalledMegatron, installed_megatron
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
    from .mtp import MTPOptions, default_mtp_loss, detached_head, scaled_mtp_gradient
    from .schedule_plan import build_schedule_plan, plan_loss_func

__all__ = [
    "HookOptions",
    "InstalledMegatron",
    "MTPOptions",
    "TorchCollectives",
    "build_output_context",
    "build_schedule_plan",
    "default_mtp_loss",
    "detached_head",
    "disable_output_processor",
    "enable_output_processor",
    "has_native_hook",
    "installed_megatron",
    "is_output_processor_enabled",
    "parallel_layout",
    "plan_loss_func",
    "require_output_processor",
    "scaled_mtp_gradient",
    "unwrap_model",
]

_LAZY = LazyNames(
    __name__,
    {
        "HookOptions": ".enable",
        "InstalledMegatron": "._compat",
        "MTPOptions": ".mtp",
        "TorchCollectives": ".collectives",
        "build_output_context": ".context",
        "build_schedule_plan": ".schedule_plan",
        "default_mtp_loss": ".mtp",
        "detached_head": ".mtp",
        "disable_output_processor": ".enable",
        "enable_output_processor": ".enable",
        "has_native_hook": ".enable",
        "installed_megatron": "._compat",
        "is_output_processor_enabled": ".enable",
        "parallel_layout": ".context",
        "plan_loss_func": ".schedule_plan",
        "require_output_processor": ".enable",
        "scaled_mtp_gradient": ".mtp",
        "unwrap_model": ".enable",
    },
)
"""The module each public name lives in (a test keeps it equal to ``__all__``)."""


def __getattr__(name: str) -> Any:
    return _LAZY.load(name)


def __dir__() -> list[str]:
    return _LAZY.names()

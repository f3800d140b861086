"""``enable_output_processor``: the output hook on any supported Megatron Core.

The model instance (never its class) gets a subclass of its own, the way
``torch.nn.utils.parametrize`` does it: ``model.__class__`` becomes
``OutputHook<GPTModel>``, whose ``forward`` accepts keyword-only
``output_processor=`` and ``output_processor_context=``. Nothing of Megatron's
is reassigned, and :func:`disable_output_processor` restores the class.

- Where the installed Megatron has the native hook (0.18+), the adapter hands
  the native hook a bridge and Megatron's ``_postprocess`` runs unchanged.
- Where it has none (0.14 to 0.17), the adapter's ``_postprocess`` calls the
  stock one when no processor is given; with one, it runs the same steps
  (tied weight, MTP block, MTP losses through Megatron's own functions) and
  then the processor in place of the output layer and loss.
- An ``mtp_processor=`` (``torch_impl.mtp``) takes the adapter's own
  ``_postprocess`` path on every release; a ``HybridModel``, which has no
  ``_postprocess``, gets ``torch_impl.hybrid``'s adapter.
- The adapter class lives in ``torch_impl._adapter``; one
  ``torch_impl._call.ForwardCall`` per forward carries the processors down to
  where Megatron's code reaches the hook (see ``docs/architecture.md``).

The choice keys on the signature of the installed ``forward``, never on a
version string.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from hookspec import IGNORE_INDEX, ContractError, check_int64

from ._adapter import (
    OutputHookAdapter,
    adapted_class,
    forward_has_native_hook,
    original_class,
    set_options,
)
from ._call import HookOptions, MTPOptions, clear_stash
from .hybrid import HybridOutputHookAdapter
from .mtp import adapt_mtp_layers

__all__ = [
    "HookOptions",
    "MTPOptions",
    "disable_output_processor",
    "enable_output_processor",
    "has_native_hook",
    "is_output_processor_enabled",
    "require_output_processor",
    "unwrap_model",
]

M = TypeVar("M", bound=torch.nn.Module)


def has_native_hook(model_or_class: Any) -> bool:
    """True when the class's ``forward`` takes ``output_processor`` (Megatron Core 0.18+)."""
    return forward_has_native_hook(original_class(model_or_class))


def _is_language_model(module: object) -> bool:
    """A Megatron ``LanguageModule`` with a decoder: GPTModel, HybridModel."""
    return (
        isinstance(module, torch.nn.Module)
        and hasattr(module, "decoder")
        and hasattr(module, "compute_language_model_loss")
    )


_WRAPPER_ATTRIBUTES = ("module", "language_model")
"""Where a wrapper holds the next module: ``.module`` (Megatron's and torch's DDP,
``Float16Module``), ``.language_model`` (Megatron's multimodal models, such as
``LLaVAModel``, and user wrappers that follow them)."""


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The language model (GPTModel or HybridModel) inside ``model``.

    Follows ``.module`` (Megatron's ``DistributedDataParallel`` and
    ``Float16Module``, torch's DDP) and ``.language_model`` (Megatron's
    multimodal pattern) in any order, e.g. DDP -> Float16Module -> wrapper ->
    ``.language_model``. A wrapper must pass ``output_processor=``,
    ``output_processor_context=`` and ``mtp_processor=`` on to its language
    model's ``forward``.
    """
    inner: Any = model
    path = [type(model).__name__]
    while not _is_language_model(inner):
        nxt = None
        for name in _WRAPPER_ATTRIBUTES:
            candidate = getattr(inner, name, None)
            if isinstance(candidate, torch.nn.Module):
                nxt = candidate
                path.append(f".{name}: {type(candidate).__name__}")
                break
        if nxt is None or len(path) > 9:
            raise ContractError(
                "model",
                expected="a Megatron GPTModel or HybridModel (a module with .decoder and "
                ".compute_language_model_loss), itself or under .module (Float16Module, DDP) "
                "or .language_model (multimodal wrappers)",
                actual=" -> ".join(path) + " (no language model found)",
            )
        inner = nxt
    return inner


def is_output_processor_enabled(model: torch.nn.Module) -> bool:
    """True when :func:`enable_output_processor` was applied (through any wrapper)."""
    return isinstance(unwrap_model(model), OutputHookAdapter)


def enable_output_processor(
    model: M,
    *,
    ignore_index: int = IGNORE_INDEX,
    check_values: bool = True,
    mtp: MTPOptions | None = None,
) -> M:
    """Give ``model`` keyword-only ``output_processor=`` and ``output_processor_context=``.

    Returns ``model`` itself (a wrapper stays the wrapper; the language model
    inside it is adapted). Idempotent: enabling an enabled model only updates
    its options. Without a processor, outputs and gradients are bitwise the
    stock model's.

    ``output_processor`` is either a hookspec processor (made by
    ``hookspec.processor``: it receives a ``hookspec.OutputContext`` whose
    extras come from the model's process groups) or an upstream-style callable
    taking the native hook's sixteen keywords, which runs unchanged on every
    release. Its result is returned from ``forward`` unchanged. An
    upstream-style callable's parameters are checked against
    ``hookspec.UPSTREAM_HOOK_KEYWORDS`` when a forward receives it, before the
    model runs (``hookspec.check_upstream_processor``).

    ``mtp_processor`` (keyword-only, models with MTP layers) replaces the
    per-depth MTP loss while Megatron keeps rolling, logging and scaling; see
    ``torch_impl.mtp``. A ``HybridModel`` (0.19+) gets the same keywords.

    ``ignore_index`` (an int) is the label that selects no token.
    ``check_values``: check the labels' range once per call in the hook, without
    a host read on a GPU (see :class:`HookOptions`); ``False`` does no value check
    anywhere. ``mtp``: the :class:`~torch_impl.mtp.MTPOptions` of a model with
    MTP layers (detached encoder, per-token normalisation, the micro-batch's CP
    group); ``None`` is upstream Megatron's behaviour. All are checked here,
    before the model is touched.
    """
    inner = unwrap_model(model)
    if isinstance(ignore_index, int) and not isinstance(ignore_index, bool):
        check_int64("ignore_index", ignore_index)  # compared with int64 labels in the forward
    options = HookOptions(
        ignore_index=ignore_index,
        check_values=check_values,
        mtp=MTPOptions() if mtp is None else mtp,
    )
    if not isinstance(inner, OutputHookAdapter):
        cls = type(inner)
        mixin = OutputHookAdapter if hasattr(cls, "_postprocess") else HybridOutputHookAdapter
        inner.__class__ = adapted_class(cls, mixin)
    set_options(inner, options)
    adapt_mtp_layers(inner, options.mtp)
    return model


def disable_output_processor(model: M) -> M:
    """Undo :func:`enable_output_processor`: the model's class is its own again."""
    inner = unwrap_model(model)
    if isinstance(inner, OutputHookAdapter):
        inner.__class__ = original_class(inner)
        set_options(inner, None)
        clear_stash(inner)
        adapt_mtp_layers(inner, None)
    return model


def require_output_processor(model: torch.nn.Module) -> torch.nn.Module:
    """The unwrapped model, or a :class:`ContractError` saying how to enable it."""
    inner = unwrap_model(model)
    if not isinstance(inner, OutputHookAdapter):
        hint = (
            "This Megatron Core has no native output hook"
            if not has_native_hook(inner)
            else "A hookspec processor needs the adapter even where Megatron has a native hook"
        )
        raise ContractError(
            "model",
            expected="a model enabled for output processors",
            actual=f"a stock {type(inner).__name__}",
            hint=f"{hint}; call model = torch_impl.enable_output_processor(model) first",
        )
    return inner

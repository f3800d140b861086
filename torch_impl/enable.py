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

The choice keys on the signature of the installed ``forward``, never on a
version string.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any, TypeVar

import torch

from hookspec import (
    IGNORE_INDEX,
    ContractError,
    is_hookspec_processor,
    validate_context,
    validate_result,
)

from .context import build_output_context

__all__ = [
    "HookOptions",
    "disable_output_processor",
    "enable_output_processor",
    "has_native_hook",
    "is_output_processor_enabled",
    "unwrap_model",
]

M = TypeVar("M", bound=torch.nn.Module)

_STATE = "_hookspec_state"
_CALL = "_hookspec_call"


@dataclasses.dataclass(frozen=True)
class HookOptions:
    """Options of an enabled model.

    ``ignore_index``: the label that selects no token. ``check_values``: read
    the labels to check their range at every call (one synchronisation on a
    GPU); shape checks always run.
    """

    ignore_index: int = IGNORE_INDEX
    check_values: bool = True


def has_native_hook(model_or_class: Any) -> bool:
    """True when the class's ``forward`` takes ``output_processor`` (Megatron Core 0.18+)."""
    cls: type[Any] = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    cls = getattr(cls, "_hookspec_original_class", cls)
    return "output_processor" in inspect.signature(cls.forward).parameters


def _is_language_model(module: object) -> bool:
    """A Megatron ``LanguageModule`` with a decoder: GPTModel, HybridModel."""
    return (
        isinstance(module, torch.nn.Module)
        and hasattr(module, "decoder")
        and hasattr(module, "compute_language_model_loss")
    )


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The language model inside Megatron's ``Float16Module``, DDP or torch DDP."""
    inner: Any = model
    seen = 0
    while not _is_language_model(inner):
        nxt = getattr(inner, "module", None)
        if nxt is None or seen > 8:
            raise ContractError(
                "model",
                expected="a Megatron GPTModel or HybridModel, or one wrapped by Float16Module or DDP",
                actual=type(model).__name__,
            )
        inner, seen = nxt, seen + 1
    return inner


class _HookCall:
    """The upstream-style callable the hook calls: validates, builds the typed
    context, and runs either kind of processor."""

    def __init__(
        self,
        model: torch.nn.Module,
        processor: Any,
        user_context: Any,
        padding_mask: torch.Tensor | None,
        options: HookOptions,
    ) -> None:
        if not callable(processor):
            raise ContractError(
                "output_processor",
                expected="a callable or a hookspec processor",
                actual=type(processor).__name__,
            )
        self.model = model
        self.processor = processor
        self.user_context = user_context
        self.padding_mask = padding_mask
        self.options = options

    def context(self, hook_kwargs: dict[str, Any], *, mtp_depth: int = 0) -> Any:
        ctx = build_output_context(
            self.model,
            hook_kwargs,
            padding_mask=self.padding_mask,
            ignore_index=self.options.ignore_index,
            mtp_depth=mtp_depth,
        )
        validate_context(ctx, check_values=self.options.check_values)
        return ctx

    def __call__(self, **hook_kwargs: Any) -> Any:
        hook_kwargs["context"] = self.user_context
        ctx = self.context(hook_kwargs)
        if not is_hookspec_processor(self.processor):
            return self.processor(**hook_kwargs)
        result = self.processor(ctx)
        validate_result(
            result, batch=ctx.batch_size, seq=ctx.seq_len, field=f"processor {self.processor.name!r} result"
        )
        return result


class _OutputHookAdapter:
    """Mixed in before the model's own class; see the module docstring."""

    _hookspec_original_class: type[Any]
    _hookspec_native: bool
    _hookspec_postprocess_signature: inspect.Signature | None  # None on a HybridModel (no _postprocess)

    def forward(
        self,
        *args: Any,
        output_processor: Any = None,
        output_processor_context: Any = None,
        mtp_processor: Any = None,
        **kwargs: Any,
    ) -> Any:
        native = self._hookspec_native
        if output_processor is None and mtp_processor is None:
            if native:
                kwargs["output_processor_context"] = output_processor_context
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        call, mtp_call = _bridges(
            self,  # type: ignore[arg-type]
            output_processor,
            output_processor_context,
            mtp_processor,
            kwargs.get("padding_mask"),
        )
        if native and mtp_call is None:
            return super().forward(  # type: ignore[misc]
                *args, output_processor=call, output_processor_context=output_processor_context, **kwargs
            )
        return self._hookspec_run(args, kwargs, call, mtp_call)

    def _hookspec_run(self, args: tuple[Any, ...], kwargs: dict[str, Any], call: Any, mtp_call: Any) -> Any:
        """The model's own ``forward``; its ``_postprocess`` (below) picks the bridges up."""
        with _stashed(self, call, mtp_call):  # type: ignore[arg-type]
            return super().forward(*args, **kwargs)  # type: ignore[misc]

    def _postprocess(self, *args: Any, **kwargs: Any) -> Any:
        pending = self.__dict__.get(_CALL)
        if pending is None:
            return super()._postprocess(*args, **kwargs)  # type: ignore[misc]
        from ._postprocess import postprocess_with_processor

        signature = self._hookspec_postprocess_signature
        assert signature is not None  # only a class with _postprocess reaches its override
        bound = signature.bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        call, mtp_call = pending
        return postprocess_with_processor(self, call, mtp_call=mtp_call, **arguments)  # type: ignore[arg-type]


def _bridges(
    model: torch.nn.Module, output_processor: Any, user_context: Any, mtp_processor: Any, padding_mask: Any
) -> tuple[_HookCall | None, Any]:
    """The main hook's bridge (``None`` for the stock head) and the MTP bridge
    (``None`` for the stock MTP loss). Validates both before the model runs."""
    from ._postprocess import default_output

    hook = _HookCall(
        model,
        output_processor if output_processor is not None else default_output,
        user_context,
        padding_mask,
        model.__dict__[_STATE],
    )
    mtp_call = None
    if mtp_processor is not None:
        from .mtp import MTPCall

        mtp_call = MTPCall(model, mtp_processor, hook)
    return (hook if output_processor is not None else None), mtp_call


@contextlib.contextmanager
def _stashed(model: torch.nn.Module, call: Any, mtp_call: Any) -> Iterator[None]:
    """The bridges on the instance for the adapter's ``_postprocess`` to find."""
    model.__dict__[_CALL] = (call, mtp_call)
    try:
        yield
    finally:
        model.__dict__.pop(_CALL, None)


_ADAPTED_CLASSES: dict[type, type] = {}


def _adapted_class(cls: type) -> type:
    adapted = _ADAPTED_CLASSES.get(cls)
    if adapted is None:
        mixin: type = _OutputHookAdapter
        if not hasattr(cls, "_postprocess"):
            from .hybrid import HybridOutputHookAdapter

            mixin = HybridOutputHookAdapter
        adapted = type(
            f"OutputHook{cls.__name__}",
            (mixin, cls),
            {
                "__module__": __name__,
                "__doc__": cls.__doc__,
                "_hookspec_original_class": cls,
                "_hookspec_native": has_native_hook(cls),
                # Read once per class: inspect.signature costs ~50 us a call.
                "_hookspec_postprocess_signature": (
                    inspect.signature(cls._postprocess) if hasattr(cls, "_postprocess") else None
                ),
            },
        )
        _ADAPTED_CLASSES[cls] = adapted
    return adapted


def is_output_processor_enabled(model: torch.nn.Module) -> bool:
    """True when :func:`enable_output_processor` was applied (through any wrapper)."""
    return isinstance(unwrap_model(model), _OutputHookAdapter)


def enable_output_processor(model: M, *, ignore_index: int = IGNORE_INDEX, check_values: bool = True) -> M:
    """Give ``model`` keyword-only ``output_processor=`` and ``output_processor_context=``.

    Returns ``model`` itself (a wrapper stays the wrapper; the language model
    inside it is adapted). Idempotent: enabling an enabled model only updates
    its options. Without a processor, outputs and gradients are bitwise the
    stock model's.

    ``output_processor`` is either a hookspec processor (made by
    ``hookspec.processor``: it receives a ``hookspec.OutputContext`` whose
    extras come from the model's process groups) or an upstream-style callable
    taking the native hook's sixteen keywords, which runs unchanged on every
    release. Its result is returned from ``forward`` unchanged.

    ``mtp_processor`` (keyword-only, models with MTP layers) replaces the
    per-depth MTP loss while Megatron keeps rolling, logging and scaling; see
    ``torch_impl.mtp``. A ``HybridModel`` (0.19+) gets the same keywords.
    """
    inner = unwrap_model(model)
    options = HookOptions(ignore_index=ignore_index, check_values=check_values)
    if not isinstance(inner, _OutputHookAdapter):
        inner.__class__ = _adapted_class(type(inner))
    inner.__dict__[_STATE] = options
    return model


def disable_output_processor(model: M) -> M:
    """Undo :func:`enable_output_processor`: the model's class is its own again."""
    inner = unwrap_model(model)
    if isinstance(inner, _OutputHookAdapter):
        inner.__class__ = inner._hookspec_original_class
        inner.__dict__.pop(_STATE, None)
        inner.__dict__.pop(_CALL, None)
    return model


def require_output_processor(model: torch.nn.Module) -> torch.nn.Module:
    """The unwrapped model, or a :class:`ContractError` saying how to enable it."""
    inner = unwrap_model(model)
    if not isinstance(inner, _OutputHookAdapter):
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

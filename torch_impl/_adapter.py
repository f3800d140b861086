"""The adapter class an enabled model's class is made of, and the one place
that reads what it sets on a model.

``enable_output_processor`` gives the instance a class of its own,
``OutputHook<Class>(OutputHookAdapter, Class)`` (:func:`adapted_class`); a
``HybridModel`` gets ``torch_impl.hybrid``'s subclass of
:class:`OutputHookAdapter` instead. The adapter's ``forward`` makes one
:class:`~torch_impl._call.ForwardCall` per forward with a processor
(:func:`forward_call`) and hands it down:

- to Megatron's native hook as ``output_processor`` (0.18+, no MTP processor);
- with an MTP processor, where the model's ``forward`` also takes
  ``mtp_output_processor`` (Megatron with the patch series in ``upstream/``),
  to both native hooks: Megatron's ``process_mtp_loss`` rolls, scales and logs,
  and the adapter's own ``_postprocess`` and MTP loop stand aside;
- else stashed on the instance (``ForwardCall.stashed``) for the adapter's
  ``_postprocess`` below, which runs the stock ``_postprocess`` as an inner
  stage and then ``finish_postprocess``.

The class attributes set here (the original class, whether the installed
``forward`` has the native hook, the ``_postprocess`` signature) and the
options on the instance are read through :func:`original_class`,
:func:`uses_native_hook` and :func:`options_of` only.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hookspec import ContractError

from ._call import ForwardCall, HookOptions, stashed_call
from ._compat import check_mtp_processor
from ._postprocess import as_inner_stage, finish_postprocess
from .mtp import default_mtp_loss, has_mtp_layers

__all__ = [
    "OutputHookAdapter",
    "adapted_class",
    "forward_call",
    "forward_has_native_hook",
    "native_mtp_applies",
    "options_of",
    "original_class",
    "set_options",
    "uses_native_hook",
]

_OPTIONS = "_hookspec_state"  # instance attribute: the HookOptions of an enabled model


def forward_has_native_hook(cls: type[Any]) -> bool:
    """True when ``cls.forward`` takes ``output_processor`` (Megatron Core 0.18+)."""
    return "output_processor" in inspect.signature(cls.forward).parameters


class OutputHookAdapter:
    """Mixed in before the model's own class; see the module docstring."""

    _hookspec_original_class: type[Any]
    _hookspec_native: bool
    _hookspec_native_mtp: bool  # forward takes mtp_output_processor (upstream/ patch series)
    _hookspec_postprocess_signature: (
        inspect.Signature | None
    )  # None on a HybridModel (no _postprocess)

    def forward(
        self,
        *args: Any,
        output_processor: Any = None,
        output_processor_context: Any = None,
        mtp_processor: Any = None,
        **kwargs: Any,
    ) -> Any:
        native = self._hookspec_native
        if (
            mtp_processor is None
            and has_mtp_layers(self)
            and options_of(self).mtp.rolls_or_scales_itself  # type: ignore[arg-type]
        ):
            mtp_processor = (
                default_mtp_loss  # these MTP options act where the adapter computes the losses
            )
        if output_processor is None and mtp_processor is None:
            if native:
                kwargs["output_processor_context"] = output_processor_context
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        call = forward_call(
            self,  # type: ignore[arg-type]
            output_processor=output_processor,
            output_processor_context=output_processor_context,
            mtp_processor=mtp_processor,
            padding_mask=kwargs.get("padding_mask"),
        )
        if native and mtp_processor is None:
            return super().forward(  # type: ignore[misc]
                *args,
                output_processor=call,
                output_processor_context=output_processor_context,
                **kwargs,
            )
        if native and native_mtp_applies(self):  # type: ignore[arg-type]
            return super().forward(  # type: ignore[misc]
                *args,
                output_processor=None if output_processor is None else call,
                output_processor_context=output_processor_context,
                mtp_output_processor=call.mtp_hook,
                **kwargs,
            )
        return self._hookspec_run(args, kwargs, call)

    def _hookspec_run(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], call: ForwardCall
    ) -> Any:
        """The model's own ``forward``; its ``_postprocess`` (below) finds the call."""
        with call.stashed():
            return super().forward(*args, **kwargs)  # type: ignore[misc]

    def _postprocess(self, *args: Any, **kwargs: Any) -> Any:
        call = stashed_call(self)  # type: ignore[arg-type]
        if call is None:
            return super()._postprocess(*args, **kwargs)  # type: ignore[misc]
        signature = self._hookspec_postprocess_signature
        assert signature is not None  # only a class with _postprocess reaches its override
        arguments = signature.bind(self, *args, **kwargs).arguments
        with as_inner_stage(self):
            hidden_states = super()._postprocess(*args, **kwargs)  # type: ignore[misc]
        if not self.post_process:  # type: ignore[attr-defined]
            return hidden_states
        return finish_postprocess(self, call, hidden_states, arguments)


_ADAPTED_CLASSES: dict[tuple[type, type], type] = {}


def adapted_class(cls: type[Any], mixin: type[OutputHookAdapter] = OutputHookAdapter) -> type[Any]:
    """``OutputHook<cls>(mixin, cls)``, made once per class."""
    adapted = _ADAPTED_CLASSES.get((cls, mixin))
    if adapted is None:
        adapted = type(
            f"OutputHook{cls.__name__}",
            (mixin, cls),
            {
                "__module__": __name__,
                "__doc__": cls.__doc__,
                "_hookspec_original_class": cls,
                "_hookspec_native": forward_has_native_hook(cls),
                "_hookspec_native_mtp": "mtp_output_processor"
                in inspect.signature(cls.forward).parameters,
                # Read once per class: inspect.signature costs ~50 us a call.
                "_hookspec_postprocess_signature": (
                    inspect.signature(cls._postprocess) if hasattr(cls, "_postprocess") else None
                ),
            },
        )
        _ADAPTED_CLASSES[(cls, mixin)] = adapted
    return adapted


def original_class(model_or_class: Any) -> type[Any]:
    """The model's own class: for an adapted one, the class it was adapted from."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return getattr(cls, "_hookspec_original_class", cls)


def uses_native_hook(model: Any) -> bool:
    """True when the adapted model's own ``forward`` has the native hook."""
    return bool(type(model)._hookspec_native)


def native_mtp_applies(model: Any) -> bool:
    """True when the adapted model's own ``forward`` takes ``mtp_output_processor``
    and its MTP options leave the MTP losses to Megatron (``per_token_normalization``
    ``"rolled"`` and ``cp_group_from_packed`` need the adapter's own MTP loop)."""
    return (
        bool(type(model)._hookspec_native_mtp) and not options_of(model).mtp.rolls_or_scales_itself
    )


def set_options(model: torch.nn.Module, options: HookOptions | None) -> None:
    """Store (or, with ``None``, drop) an enabled model's options on the instance."""
    if options is None:
        model.__dict__.pop(_OPTIONS, None)
    else:
        model.__dict__[_OPTIONS] = options


def options_of(model: torch.nn.Module) -> HookOptions:
    """The options :func:`set_options` stored on ``model``."""
    options: HookOptions = model.__dict__[_OPTIONS]
    return options


def forward_call(
    model: torch.nn.Module,
    *,
    output_processor: Any,
    output_processor_context: Any,
    mtp_processor: Any,
    padding_mask: torch.Tensor | None,
) -> ForwardCall:
    """The :class:`ForwardCall` of one forward of an enabled ``model``, its
    processors checked before the model runs. Where the model has MTP layers
    and no MTP processor is given, the stock MTP loss (``default_mtp_loss``)
    runs through the same call."""
    if mtp_processor is not None and callable(mtp_processor) and not has_mtp_layers(model):
        layers = getattr(model.config, "mtp_num_layers", None)
        raise ContractError(
            "mtp_processor",
            expected="a model with MTP layers (config.mtp_num_layers and an MTP block)",
            actual=f"{type(model).__name__} with mtp_num_layers={layers}",
            hint="Pass mtp_processor only to models built with multi-token prediction",
        )
    check_mtp_processor(mtp_processor)  # where the MTP block computes the losses itself
    if mtp_processor is None and has_mtp_layers(model):
        mtp_processor = default_mtp_loss
    return ForwardCall(
        model,
        options_of(model),
        processor=output_processor,
        user_context=output_processor_context,
        mtp_processor=mtp_processor,
        padding_mask=padding_mask,
    )

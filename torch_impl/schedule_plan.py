"""The output hook on Megatron's combined-1F1B schedule plan (see ``docs/schedule_plan.md``).

``build_schedule_plan(model, ...)`` builds the model's own plan
(``GPTModel.build_schedule_plan``; 0.16 has it without the hook, 0.18+ with
it) and adapts the plan's post-process node, that instance only:

- the hook runs inside the node on every release, with the hookspec context,
  the MTP processor and the adapter's options (through the native hooks where
  they suffice, the MTP one where Megatron has the patch series of
  ``upstream/``, else through the adapter's ``_postprocess``);
- the hook sees the chunk's original ``input_ids`` and ``position_ids``: the
  MTP layers' pre-dispatch overwrites both in the chunk state with ids rolled
  once per MTP layer, which plain ``forward`` never does (and which made
  0.19's ``process_mtp_loss`` derive RL labels from ids rolled twice);
- a mapping result crosses the schedule packed: the node returns the values
  that require grad as a tuple of tensors (the schedule's loss node and
  backward take tensors only), and :func:`plan_loss_func` restores the mapping
  for the loss function. Without that wrapper a mapping result is refused with
  a ``ContractError`` before anything reaches the loss function.

Without processors the stock plan is returned with only the final-norm fix.

The decoder's final norm, which Megatron's plan leaves out when the chunk's
last decoder layer is dense, is added to the plan (``apply_final_norm=True``,
the default; ``False`` keeps Megatron's plan bitwise): see
``torch_impl/_plan_final_norm.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from megatron.core.transformer.module import float16_to_fp32

from hookspec import ContractError

from ._adapter import forward_call, native_mtp_applies, original_class, uses_native_hook
from ._call import ForwardCall
from ._compat import installed_megatron
from ._plan_final_norm import add_missing_final_norm, check_apply_final_norm
from .enable import require_output_processor

__all__ = [
    "PlanOutputs",
    "attach_plan_hook",
    "build_schedule_plan",
    "plan_loss_func",
    "plan_outputs",
    "prepare_plan_hook",
]

_OUTPUTS = "hookspec_outputs"  # attribute of the plan's ModelChunkState (a plain attribute bag)


@dataclasses.dataclass
class PlanOutputs:
    """How one plan's result crosses the schedule: the layout of a packed mapping.

    ``keys``: the mapping's keys in order (``None`` for a tensor or tuple
    result); ``packed``: the keys travelling as tensors (those that require
    grad); ``carried``: the other values, handed to the loss function as they
    are. ``loss_wrapped``: :func:`plan_loss_func` was applied.
    """

    keys: tuple[str, ...] | None = None
    packed: tuple[str, ...] = ()
    carried: dict[str, Any] = dataclasses.field(default_factory=dict)
    loss_wrapped: bool = False

    def pack(self, result: Any) -> Any:
        """The node's output: a tensor or tuple result unchanged, a mapping as a tuple."""
        if isinstance(result, torch.Tensor) or (
            isinstance(result, tuple) and all(isinstance(v, torch.Tensor) for v in result)
        ):
            self.keys = None
            return result
        if not isinstance(result, Mapping):
            raise ContractError(
                "schedule plan output",
                expected="a tensor, a tuple of tensors or a mapping of tensors",
                actual=type(result).__name__,
            )
        if not self.loss_wrapped:
            raise ContractError(
                "schedule plan output",
                expected="a tensor (the combined-1F1B schedule hands tensors to the loss node)",
                actual=f"a mapping with keys {sorted(result)}",
                hint="Return (plan, torch_impl.plan_loss_func(plan, loss_func)) from "
                "forward_step_func: the mapping then crosses the schedule packed and reaches "
                "loss_func whole",
            )
        packed = tuple(
            k for k, v in result.items() if isinstance(v, torch.Tensor) and v.requires_grad
        )
        if not packed and torch.is_grad_enabled():
            raise ContractError(
                "schedule plan output",
                expected="a mapping with at least one value that requires grad (the schedule "
                "runs backward)",
                actual=f"keys {sorted(result)}, none requiring grad",
            )
        self.keys = tuple(result)
        self.packed = packed
        self.carried = {k: v for k, v in result.items() if k not in packed}
        return tuple(float16_to_fp32(result[k]) for k in packed)

    def unpack(self, tensors: tuple[Any, ...]) -> Any:
        """What the loss function receives: the mapping back, or the tensor result."""
        if self.keys is None:
            return tensors[0] if len(tensors) == 1 else tensors
        if len(tensors) != len(self.packed):
            raise ContractError(
                "schedule plan loss inputs",
                expected=f"{len(self.packed)} tensors",
                actual=len(tensors),
            )
        values = dict(self.carried)
        values.update(zip(self.packed, tensors))
        return {k: values[k] for k in self.keys}


@dataclasses.dataclass
class _PlanHook:
    """What the adapted post-process node needs: the model, the forward's call to
    stash (``None`` where the native hook carries it), the original ids."""

    model: Any
    stash: ForwardCall | None
    input_ids: Any
    position_ids: Any
    outputs: PlanOutputs


class _HookPostProcessNode:
    """Mixed in before the plan's ``PostProcessNode`` class, on one instance."""

    _hookspec_plan: _PlanHook

    def forward_impl(self, hidden_states: torch.Tensor) -> Any:
        hook = self.__dict__["_hookspec_plan"]
        state = self.chunk_state  # type: ignore[attr-defined]
        rolled = (state.input_ids, state.position_ids)
        state.input_ids, state.position_ids = hook.input_ids, hook.position_ids
        try:
            if hook.stash is None:
                result = super().forward_impl(hidden_states)  # type: ignore[misc]
            else:
                with hook.stash.stashed():
                    result = super().forward_impl(hidden_states)  # type: ignore[misc]
        finally:
            state.input_ids, state.position_ids = rolled
        return hook.outputs.pack(result)

    def _hookspec_backward(
        self, outputs: tuple[torch.Tensor, ...], output_grad: tuple[Any, ...]
    ) -> Any:
        """The stock backward, with zeros for packed values the loss did not use
        (the loss node hands back ``None`` for them; autograd needs a tensor)."""
        grads = tuple(torch.zeros_like(o) if g is None else g for o, g in zip(outputs, output_grad))
        return super().default_backward_func(outputs, grads)  # type: ignore[misc]


_NODE_CLASSES: dict[type, type] = {}


def _weak(method: Any) -> Callable[..., Any]:
    """``method``, bound without a strong reference to its node (as Megatron's
    nodes hold their own ``forward_impl``)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        return ref()(*args)  # type: ignore[misc]

    return call


def attach_plan_hook(node: Any, hook: _PlanHook) -> None:
    """Adapt one post-process node instance: its class becomes a subclass of its own
    whose ``forward_impl`` runs the hook (see the module docstring)."""
    cls = type(node)
    if not issubclass(cls, _HookPostProcessNode):
        adapted = _NODE_CLASSES.get(cls)
        if adapted is None:
            adapted = type(
                f"OutputHook{cls.__name__}", (_HookPostProcessNode, cls), {"__module__": __name__}
            )
            _NODE_CLASSES[cls] = adapted
        node.__class__ = adapted
    node.__dict__["_hookspec_plan"] = hook
    node.forward_func = _weak(node.forward_impl)
    node.backward_func = _weak(node._hookspec_backward)
    node.chunk_state.__dict__[_OUTPUTS] = hook.outputs


def build_schedule_plan(
    model: torch.nn.Module,
    *args: Any,
    output_processor: Any = None,
    output_processor_context: Any = None,
    mtp_processor: Any = None,
    apply_final_norm: bool = True,
    **kwargs: Any,
) -> Any:
    """``model.build_schedule_plan(*args, **kwargs)`` with the output hook.

    ``model`` must be enabled (``enable_output_processor``); ``args`` and
    ``kwargs`` are those of the installed ``GPTModel.build_schedule_plan``
    (input_ids, position_ids, attention_mask, ..., labels=, loss_mask=,
    padding_mask=). The processors are those of the enabled ``forward``. When
    the processor may return a mapping, return ``plan_loss_func(plan,
    loss_func)`` as the loss function.
    """
    inner = require_output_processor(model)
    apply_final_norm = check_apply_final_norm(apply_final_norm)
    original = original_class(inner)
    if not hasattr(original, "build_schedule_plan"):
        raise ContractError(
            "model",
            expected="a model with build_schedule_plan (GPTModel)",
            actual=f"{original.__name__}, which has no schedule plan in this Megatron Core",
            hint="Run it through forward and the ordinary pipeline schedules",
        )
    if output_processor is None and mtp_processor is None:
        if uses_native_hook(inner):
            kwargs["output_processor_context"] = output_processor_context
        plan = inner.build_schedule_plan(*args, **kwargs)  # type: ignore[operator]
    else:
        arguments = (
            inspect.signature(original.build_schedule_plan).bind(inner, *args, **kwargs).arguments
        )
        native_kwargs, hook = prepare_plan_hook(
            inner,
            arguments,
            output_processor=output_processor,
            output_processor_context=output_processor_context,
            mtp_processor=mtp_processor,
        )
        plan = inner.build_schedule_plan(*args, **native_kwargs, **kwargs)  # type: ignore[operator]
        if plan.post_process is not None:
            attach_plan_hook(plan.post_process, hook)
    if apply_final_norm:
        add_missing_final_norm(plan, inner)  # after the hook: it wraps the node's forward_func last
    return plan


def prepare_plan_hook(
    model: Any,
    arguments: Mapping[str, Any],
    *,
    output_processor: Any = None,
    output_processor_context: Any = None,
    mtp_processor: Any = None,
) -> tuple[dict[str, Any], _PlanHook]:
    """The keywords for the model's own ``build_schedule_plan`` (the native hook's,
    where it carries the processor) and the hook for :func:`attach_plan_hook`.
    ``arguments``: the plan's inputs by name (input_ids, position_ids, padding_mask).
    Validates the processors before anything runs."""
    call = forward_call(
        model,
        output_processor=output_processor,
        output_processor_context=output_processor_context,
        mtp_processor=mtp_processor,
        padding_mask=arguments.get("padding_mask"),
    )
    native_kwargs: dict[str, Any] = {}
    stash: ForwardCall | None = call
    if uses_native_hook(model) and mtp_processor is None:
        native_kwargs = {
            "output_processor": call,
            "output_processor_context": output_processor_context,
        }
        stash = None
    elif (
        uses_native_hook(model)
        and installed_megatron().plan_native_mtp_hook
        and native_mtp_applies(model)
    ):
        native_kwargs = {
            "output_processor": None if output_processor is None else call,
            "output_processor_context": output_processor_context,
            "mtp_output_processor": call.mtp_hook,
        }
        stash = None
    hook = _PlanHook(
        model=model,
        stash=stash,
        input_ids=arguments.get("input_ids"),
        position_ids=arguments.get("position_ids"),
        outputs=PlanOutputs(),
    )
    return native_kwargs, hook


def plan_outputs(plan: Any) -> PlanOutputs | None:
    """The :class:`PlanOutputs` of a plan built by :func:`build_schedule_plan`
    with a processor (``None`` for a stock plan or a stage without post-process)."""
    return plan.state.__dict__.get(_OUTPUTS)


def plan_loss_func(plan: Any, loss_func: Callable[..., Any]) -> Callable[..., Any]:
    """``loss_func`` for the combined-1F1B schedule: it receives the processor's
    result as plain ``forward`` returns it (a mapping stays a mapping).

    Use it in ``forward_step_func``: ``return plan, plan_loss_func(plan,
    partial(loss_func, ...))``. On stages without post-process, and for plans
    without a processor, ``loss_func`` is returned as it is.
    """
    if not hasattr(getattr(plan, "state", None), "__dict__"):
        raise ContractError(
            "plan",
            expected="a schedule plan (from torch_impl.build_schedule_plan or the model's own)",
            actual=type(plan).__name__,
        )
    if not callable(loss_func):
        raise ContractError("loss_func", expected="a callable", actual=type(loss_func).__name__)
    outputs = plan_outputs(plan)
    if outputs is None:
        return loss_func
    outputs.loss_wrapped = True

    def unpacking_loss_func(*tensors: Any, **kwargs: Any) -> Any:
        return loss_func(outputs.unpack(tensors), **kwargs)

    return unpacking_loss_func

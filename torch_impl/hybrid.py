"""The output hook on ``HybridModel`` (Megatron Core 0.19+), which has none upstream.

``HybridModel`` computes its logits and loss inline in ``forward``; it has no
``_postprocess`` to hand a hook to. With a processor, the adapter runs the
model's own ``forward`` as a non-final pipeline stage would (``post_process``
reads ``False`` for the call, see ``torch_impl._postprocess.as_inner_stage``):
embedding, decoder and MTP block are Megatron's, unchanged, and the call
returns right where the last stage would start its MTP losses and output layer.
The adapter then attaches the MTP losses and calls the hook exactly as it does
for a GPTModel (``finish_postprocess``). Without a processor the stock
``forward`` runs, so outputs and gradients are bitwise stock.

HybridModel offers no ``build_schedule_plan`` in 0.19.2;
``torch_impl.build_schedule_plan`` refuses it with a ``ContractError``.
"""

from __future__ import annotations

import inspect
from typing import Any

from ._postprocess import _HOOK_INPUTS, as_inner_stage, finish_postprocess
from .enable import _OutputHookAdapter

__all__ = ["HybridOutputHookAdapter"]


class HybridOutputHookAdapter(_OutputHookAdapter):
    """Mixed in before ``HybridModel`` by ``enable_output_processor``."""

    def _hookspec_run(self, args: tuple[Any, ...], kwargs: dict[str, Any], call: Any, mtp_call: Any) -> Any:
        original = self._hookspec_original_class
        bound = inspect.signature(original.forward).bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        with as_inner_stage(self):
            hidden_states = original.forward(self, *args, **kwargs)
        if not self.post_process:  # type: ignore[attr-defined]
            return hidden_states
        inputs = {k: arguments.get(k) for k in _HOOK_INPUTS}
        if inputs["inference_context"] is None:
            inputs["inference_context"] = arguments.get("inference_params")
        user_context = (call if call is not None else mtp_call.hook).user_context
        return finish_postprocess(
            self, call, hidden_states, mtp_call=mtp_call, user_context=user_context, **inputs
        )

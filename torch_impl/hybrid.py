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

from ._adapter import OutputHookAdapter, original_class
from ._call import ForwardCall
from ._postprocess import as_inner_stage, finish_postprocess

__all__ = ["HybridOutputHookAdapter"]


class HybridOutputHookAdapter(OutputHookAdapter):
    """Mixed in before ``HybridModel`` by ``enable_output_processor``."""

    def _hookspec_run(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], call: ForwardCall
    ) -> Any:
        """``HybridModel.forward`` (0.19.2) as an inner stage, then the hook.

        Its inputs reach the hook as ``GPTModel._postprocess``'s do, with
        ``inference_params``, the older name ``HybridModel.forward`` still
        takes, standing in for ``inference_context``."""
        original = original_class(self)
        arguments = dict(inspect.signature(original.forward).bind(self, *args, **kwargs).arguments)
        with as_inner_stage(self):
            hidden_states = original.forward(self, *args, **kwargs)
        if not self.post_process:  # type: ignore[attr-defined]
            return hidden_states
        if arguments.get("inference_context") is None:
            arguments["inference_context"] = arguments.get("inference_params")
        return finish_postprocess(self, call, hidden_states, arguments)

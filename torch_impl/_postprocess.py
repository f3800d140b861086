"""The adapter's post-processing: Megatron's own steps up to the output layer,
then the MTP processor and the output processor in place of logits and loss.

The model's own code runs everything a non-final pipeline stage runs (for a
GPTModel: ``_postprocess`` up to its ``if not self.post_process: return``,
which includes the MTP block; for a HybridModel: ``forward`` up to the same
point). :func:`as_inner_stage` presents the instance as such a stage for the
length of that call; then :func:`finish_postprocess` builds the hook's sixteen
keywords, attaches the MTP losses (``torch_impl.mtp``) and hands the keywords
to the forward's :class:`~torch_impl._call.ForwardCall`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from hookspec import UPSTREAM_HOOK_KEYWORDS, UPSTREAM_HOOK_SOURCES, ContractError

from ._call import ForwardCall
from ._compat import mtp_loss_in_block
from .context import no_logit_scaling
from .mtp import attach_mtp_losses, has_mtp_layers

__all__ = ["as_inner_stage", "finish_postprocess", "hook_keywords"]


@contextlib.contextmanager
def as_inner_stage(model: Any) -> Iterator[None]:
    """``model.post_process`` reads ``False`` inside the block (restored after),
    so that the model's own code stops where a last stage would compute logits."""
    saved = model.post_process
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = saved


def hook_keywords(
    model: Any, hidden_states: torch.Tensor, call_inputs: Mapping[str, Any], user_context: Any
) -> dict[str, Any]:
    """The native hook's sixteen keywords, in ``UPSTREAM_HOOK_KEYWORDS`` order,
    each taken from its ``UPSTREAM_HOOK_SOURCES`` group; ``call_inputs``: the
    model's own call's arguments by name.

    Mirrors ``GPTModel._postprocess`` (megatron-core 0.19.2): the tied output
    weight (``shared_embedding_or_output_weight()`` when
    ``share_embeddings_and_output_weights``, else ``None``) and the keywords of
    its ``output_processor(...)`` call; pinned by ``tests/releases/test_upstream_mirror.py``.
    """
    output_weight = None
    if model.share_embeddings_and_output_weights:
        output_weight = model.shared_embedding_or_output_weight()
    from_model = {
        "output_layer": model.output_layer,
        "output_weight": output_weight,
        "compute_language_model_loss": model.compute_language_model_loss,
        # Megatron's own MuP scaling where the release has it (0.19), else none.
        "scale_logits": getattr(model, "_scale_logits", no_logit_scaling),
        "config": model.config,
    }
    values: dict[str, Any] = {
        **{name: hidden_states for name in UPSTREAM_HOOK_SOURCES.decoder},
        **{name: call_inputs.get(name) for name in UPSTREAM_HOOK_SOURCES.call},
        **{name: from_model[name] for name in UPSTREAM_HOOK_SOURCES.model},
        **{name: user_context for name in UPSTREAM_HOOK_SOURCES.caller},
    }
    return {name: values[name] for name in UPSTREAM_HOOK_KEYWORDS}


def finish_postprocess(
    model: Any, call: ForwardCall, hidden_states: torch.Tensor, call_inputs: Mapping[str, Any]
) -> Any:
    """From the hidden states a non-final stage would return to the hook's result.

    ``hidden_states``: the decoder's output, with the MTP block's depths
    concatenated along the sequence where the model has MTP layers;
    ``call_inputs``: the model's own call's arguments by name (labels,
    loss_mask, input_ids, ...). Mirrors the MTP branch of
    ``GPTModel._postprocess`` (``if self.config.mtp_num_layers:``, 0.16.1 and
    0.19.2, training and evaluation path).
    """
    hook_kwargs = hook_keywords(model, hidden_states, call_inputs, call.user_context)
    if has_mtp_layers(model) and not mtp_loss_in_block():  # else the MTP block attached them
        if hook_kwargs["inference_context"] is not None:
            raise ContractError(
                "inference_context",
                expected="None when an output or MTP processor runs on a model with MTP layers",
                actual=type(hook_kwargs["inference_context"]).__name__,
                hint="MTP losses are a training and evaluation path; run inference without "
                "processors",
            )
        hook_kwargs["hidden_states"] = attach_mtp_losses(
            model, hidden_states, call=call, hook_kwargs=hook_kwargs
        )
    return call.main(hook_kwargs)

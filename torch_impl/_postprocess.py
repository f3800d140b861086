"""The adapter's post-processing: Megatron's own steps up to the output layer,
then the MTP processor and the output processor in place of logits and loss.

The model's own code runs everything a non-final pipeline stage runs (for a
GPTModel: ``_postprocess`` up to its ``if not self.post_process: return``,
which includes the MTP block; for a HybridModel: ``forward`` up to the same
point). :func:`as_inner_stage` presents the instance as such a stage for the
length of that call; then :func:`finish_postprocess` resolves the output
weight, attaches the MTP losses (``torch_impl.mtp``) and calls the hook. The
stock paths run whenever no processor is given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from hookspec import UPSTREAM_HOOK_KEYWORDS, ContractError

__all__ = ["as_inner_stage", "default_output", "finish_postprocess", "postprocess_with_processor"]


def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


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


def default_output(
    *,
    hidden_states: torch.Tensor,
    output_layer: Any,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor | None,
    runtime_gather_output: bool | None,
    compute_language_model_loss: Any,
    scale_logits: Any,
    **_: Any,
) -> torch.Tensor:
    """The stock head, as an upstream-style processor (used when only an MTP
    processor is given)::

        logits = scale_logits(output_layer(h, weight=output_weight)[0])   # [s, b, V/tp]
        return logits.transpose(0, 1) if labels is None else compute_language_model_loss(labels, logits)
    """
    logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
    logits = scale_logits(logits)
    if labels is None:
        return logits.transpose(0, 1).contiguous()
    return compute_language_model_loss(labels, logits)


def finish_postprocess(
    model: Any,
    call: Any,
    hidden_states: torch.Tensor,
    *,
    mtp_call: Any = None,
    user_context: Any = None,
    **hook_inputs: Any,
) -> Any:
    """From the hidden states a non-final stage would return to the hook's result.

    ``call``: the main hook's bridge, or ``None`` for the stock head
    (:func:`default_output`); ``mtp_call``: a ``torch_impl.mtp.MTPCall``, or
    ``None`` for the stock MTP loss (then ``call`` is not ``None``). ``hook_inputs``: labels, loss_mask,
    input_ids, position_ids, attention_mask, decoder_input,
    inference_context, packed_seq_params, runtime_gather_output.
    """
    output_weight = None
    if model.share_embeddings_and_output_weights:
        output_weight = model.shared_embedding_or_output_weight()
    hook_kwargs: dict[str, Any] = dict(
        hidden_states=hidden_states,
        output_layer=model.output_layer,
        output_weight=output_weight,
        labels=hook_inputs.get("labels"),
        loss_mask=hook_inputs.get("loss_mask"),
        input_ids=hook_inputs.get("input_ids"),
        position_ids=hook_inputs.get("position_ids"),
        attention_mask=hook_inputs.get("attention_mask"),
        decoder_input=hook_inputs.get("decoder_input"),
        inference_context=hook_inputs.get("inference_context"),
        packed_seq_params=hook_inputs.get("packed_seq_params"),
        runtime_gather_output=hook_inputs.get("runtime_gather_output"),
        context=user_context,
        compute_language_model_loss=model.compute_language_model_loss,
        scale_logits=getattr(model, "_scale_logits", _identity),
        config=model.config,
    )
    if model.config.mtp_num_layers and getattr(model, "mtp", None) is not None:
        if hook_kwargs["inference_context"] is not None:
            raise ContractError(
                "inference_context",
                expected="None when an output or MTP processor runs on a model with MTP layers",
                actual=type(hook_kwargs["inference_context"]).__name__,
                hint="MTP losses are a training and evaluation path; run inference without processors",
            )
        if mtp_call is None:
            from .mtp import MTPCall, default_mtp_loss

            mtp_call = MTPCall(model, default_mtp_loss, call)
        from .mtp import attach_mtp_losses

        hook_kwargs["hidden_states"] = attach_mtp_losses(
            model, hidden_states, mtp_call=mtp_call, hook_kwargs=hook_kwargs
        )
    if call is None:
        return default_output(**hook_kwargs)
    return call(**hook_kwargs)


def postprocess_with_processor(model: Any, call: Any, *, mtp_call: Any = None, **arguments: Any) -> Any:
    """``GPTModel._postprocess`` with ``call`` (a ``_HookCall`` or ``None``) as the
    output hook and ``mtp_call`` as the MTP loss; ``arguments`` are the stock
    ``_postprocess`` arguments of the installed release, by name."""
    with as_inner_stage(model):
        hidden_states = model._hookspec_original_class._postprocess(model, **arguments)
    if not model.post_process:
        return hidden_states
    user_context = (call if call is not None else mtp_call.hook).user_context
    inputs = {k: arguments.get(k) for k in _HOOK_INPUTS}
    return finish_postprocess(
        model, call, hidden_states, mtp_call=mtp_call, user_context=user_context, **inputs
    )


_HOOK_INPUTS = UPSTREAM_HOOK_KEYWORDS[3:12]
"""The upstream keywords from ``labels`` to ``runtime_gather_output``: what the
model's own call hands over; the rest come from the model or the caller."""

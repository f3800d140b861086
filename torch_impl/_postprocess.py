"""The processor path of ``_postprocess`` on releases without the native hook.

It runs the steps Megatron's ``_postprocess`` runs before its output layer, each
by calling Megatron's own pieces, then the hook in place of the output layer and
loss. The stock ``_postprocess`` still runs whenever no processor is given.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["postprocess_with_processor"]


def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


def postprocess_with_processor(
    model: Any,
    call: Any,
    *,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    labels: torch.Tensor | None,
    rotary_pos_emb: Any = None,
    rotary_pos_cos: Any = None,
    rotary_pos_sin: Any = None,
    mtp_in_postprocess: bool | None = None,
    loss_mask: torch.Tensor | None = None,
    decoder_input: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    inference_params: Any = None,
    packed_seq_params: Any = None,
    sequence_len_offset: Any = None,
    runtime_gather_output: bool | None = None,
    extra_block_kwargs: dict[str, Any] | None = None,
    inference_context: Any = None,
    **unknown: Any,
) -> Any:
    """``model._postprocess`` with ``call`` (a ``_HookCall``) as the output hook."""
    output_weight = None
    if model.share_embeddings_and_output_weights:
        output_weight = model.shared_embedding_or_output_weight()
    if mtp_in_postprocess:
        hidden_states = model.mtp(
            input_ids=input_ids,
            position_ids=position_ids,
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            inference_params=inference_params,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            embedding=model.embedding,
            **(extra_block_kwargs or {}),
        )
    if not model.post_process:
        return hidden_states
    if model.config.mtp_num_layers:
        from .mtp import attach_mtp_losses

        hidden_states = attach_mtp_losses(
            model,
            hidden_states,
            labels=labels,
            loss_mask=loss_mask,
            output_weight=output_weight,
            runtime_gather_output=runtime_gather_output,
            packed_seq_params=packed_seq_params,
            input_ids=input_ids,
        )
    return call(
        hidden_states=hidden_states,
        output_layer=model.output_layer,
        output_weight=output_weight,
        labels=labels,
        loss_mask=loss_mask,
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        decoder_input=decoder_input,
        inference_context=inference_context,
        packed_seq_params=packed_seq_params,
        runtime_gather_output=runtime_gather_output,
        context=None,
        compute_language_model_loss=model.compute_language_model_loss,
        scale_logits=getattr(model, "_scale_logits", _identity),
        config=model.config,
    )

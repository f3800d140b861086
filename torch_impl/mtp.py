"""Multi-token prediction under the output hook (see ``docs/mtp.md``).

Megatron Core computes the MTP losses inside the model's post-processing, with
the default output layer and cross entropy, before the output hook runs. Here
the per-depth loss becomes a narrow callable, the *MTP processor*, while
Megatron keeps everything around it, imported and called:

- ``roll_tensor`` shifts labels and loss mask for each depth (per sequence for
  packed input, with neighbour exchange under context parallel);
- ``MTPLossLoggingHelper`` logs the per-depth loss in training;
- ``MTPLossAutoScaler`` attaches each depth's scaled loss to the main hidden
  states (identity forward, injects the MTP gradient in backward).

For depth ``k`` (1-based) the MTP processor receives an ``OutputContext`` with
``mtp_depth=k``, ``hidden_states`` ``[s, b, h]`` of depth ``k``, ``labels`` and
``loss_mask`` ``[b, s]`` rolled ``k`` times, the output weight (detached when
the head is detached) and the main hook's extras; it returns the per-token
loss ``[b, s]`` before masking, or a mapping ``{"loss": [b, s], "accepted":
[b, s] bool}`` where ``accepted`` says whether the head's top-1 token equals
the label (used only for Megatron's acceptance-rate logging)::

    for k in 1..K:
        labels_k, mask_k = roll(labels_{k-1}), roll(mask_{k-1})    # [b, s]
        loss_k = mask_k * mtp_processor(ctx_k)                      # [b, s]
        main = MTPLossAutoScaler.apply(main, scale * loss_k / sum(mask_k))

with ``scale = mtp_loss_scaling_factor / K``. The formulas of scaling and
logging follow the installed release (:func:`mtp_semantics`), so that
:data:`default_mtp_loss` reproduces the stock MTP losses and gradients bitwise.
Any per-token loss processor fits, e.g. the fused
``torch_impl.processors.cross_entropy_loss()``, which never materialises the
MTP logits; :func:`detached_head` detaches the output weight for any of them.

Where RL recipes depart from upstream (veRL's ``mtp_patch.py``), an
:class:`MTPOptions` given to ``enable_output_processor(model, mtp=...)`` turns
each departure on: a detached encoder for the MTP layers (through
:class:`MTPLayerAdapter`, an instance-level subclass of each MTP layer), the
0.17+ per-token normalisation on every release, and the micro-batch's CP group
from ``packed_seq_params``; :func:`scaled_mtp_gradient` scales one micro-batch's
MTP gradient without changing the logged loss.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from megatron.core import parallel_state
from megatron.core.transformer import multi_token_prediction as _mtp

from hookspec import ContractError, OutputContext, Processor, processor

from ._call import ForwardCall, MTPOptions, check_mtp_callable
from ._compat import installed_megatron, mtp_cp_group, roll_tensor

__all__ = [
    "MTPLayerAdapter",
    "MTPOptions",
    "MTPSemantics",
    "adapt_mtp_layers",
    "attach_mtp_losses",
    "default_mtp_loss",
    "detached_head",
    "has_mtp_layers",
    "mtp_roll_group",
    "mtp_semantics",
    "scale_gradient",
    "scaled_mtp_gradient",
]


@dataclasses.dataclass(frozen=True)
class MTPSemantics:
    """What the installed Megatron Core does around the MTP loss.

    ``mup_scaling``: MTP logits go through
    ``_scale_logits`` when ``config.use_mup``. ``clamped_counts``: token counts
    are clamped to >= 1 and ``calculate_per_token_loss`` rescales by the
    original over the rolled token count. ``logs_acceptance``: the tracker
    also takes acceptance counts (``save_metrics_to_tracker``).
    """

    mup_scaling: bool
    clamped_counts: bool
    logs_acceptance: bool


def has_mtp_layers(model: Any) -> bool:
    """True for a model built with multi-token prediction (``config.mtp_num_layers``
    and an MTP block), the condition of ``GPTModel._postprocess``'s MTP branch."""
    return (
        bool(getattr(model.config, "mtp_num_layers", None))
        and getattr(model, "mtp", None) is not None
    )


@functools.cache
def mtp_semantics() -> MTPSemantics:
    """The :class:`MTPSemantics` of the installed release, as
    ``_compat.installed_megatron()`` read them from its functions."""
    facts = installed_megatron()
    return MTPSemantics(
        mup_scaling=facts.mtp_mup_scaling,
        clamped_counts=facts.mtp_clamped_counts,
        logs_acceptance=facts.mtp_logs_acceptance,
    )


# ---------------------------------------------------------------------------
# MTP processors
# ---------------------------------------------------------------------------


def _top1_accepted(ctx: OutputContext, logits: torch.Tensor) -> torch.Tensor:
    """``argmax_v z[s, b, v] == labels[b, s]`` as ``[b, s]`` bool, over the global
    vocabulary: the first index wins ties, as in Megatron's acceptance count.

    Mirrors ``multi_token_prediction._compute_mtp_acceptance_counts`` (with
    ``_mtp_logits_are_vocab_sharded`` and ``_vocab_parallel_argmax``,
    megatron-core 0.19.2); pinned by ``tests/releases/test_upstream_mirror.py``."""
    with torch.no_grad():
        gathered = ctx.runtime_gather_output
        sharded = (
            (not gathered)
            if gathered is not None
            else not getattr(ctx.output_layer, "gather_output", False)
        )
        if sharded and ctx.parallel.tp_size > 1 and ctx.vocab is not None:
            local_max, local_arg = logits.max(dim=-1)  # [s, b]
            top = ctx.collectives.all_reduce_max(local_max)
            candidate = torch.where(local_max == top, local_arg + ctx.vocab.start, ctx.vocab.size)
            pred = -ctx.collectives.all_reduce_max(-candidate)  # the smallest global id at the max
        else:
            pred = logits.argmax(dim=-1)
        return pred.transpose(0, 1) == cast(torch.Tensor, ctx.labels)


def _default_mtp_loss(ctx: OutputContext) -> dict[str, torch.Tensor]:
    # Both are always set: Megatron passes them and build_output_context
    # defaults scale_logits to the identity.
    assert ctx.scale_logits is not None and ctx.compute_language_model_loss is not None
    logits, _ = ctx.output_layer(
        ctx.hidden_states, weight=ctx.output_weight, runtime_gather_output=ctx.runtime_gather_output
    )
    if mtp_semantics().mup_scaling and getattr(ctx.config, "use_mup", False):
        logits = ctx.scale_logits(logits)
    loss = ctx.compute_language_model_loss(ctx.labels, logits)
    return {"loss": loss, "accepted": _top1_accepted(ctx, logits)}


default_mtp_loss: Processor = processor(_default_mtp_loss, name="default_mtp_loss")
"""The stock MTP loss as an MTP processor (bitwise Megatron's own)::

    logits = output_layer(h_k, weight=ctx.output_weight)   # [s, b, V/tp]
    logits = scale_logits(logits)                          # only with config.use_mup (0.19)
    loss = compute_language_model_loss(labels_k, logits)   # [b, s]
    accepted = argmax(logits) == labels_k                  # [b, s], for acceptance logging
"""


def detached_head(mtp_processor: Any, /) -> Processor:
    """``mtp_processor`` with the output head detached: it sees
    ``ctx.vocab_weight.detach()`` as both ``vocab_weight`` and ``output_weight``,
    so the MTP loss trains the MTP layers but not the shared output weight (or
    tied embedding). Works with any MTP processor and on any release (0.19's
    ``config.mtp_detach_heads`` does the same for every processor).
    ``mtp_processor`` is checked here as the forward checks an unwrapped one."""
    check_mtp_callable(mtp_processor)

    def fn(ctx: OutputContext) -> Any:
        if ctx.vocab_weight is None:
            return mtp_processor(ctx)
        weight = cast(torch.Tensor, ctx.vocab_weight).detach()
        return mtp_processor(ctx.replace(vocab_weight=weight, output_weight=weight))

    name = getattr(mtp_processor, "name", getattr(mtp_processor, "__name__", "mtp_processor"))
    return processor(fn, name=f"detached_head({name})")


class _ScaleGradient(torch.autograd.Function):
    """``x`` forward; ``factor * dx`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` unchanged in the forward pass; ``factor * dx`` in the backward pass."""
    return _ScaleGradient.apply(x, factor)


def scaled_mtp_gradient(mtp_processor: Any, /, factor: float) -> Processor:
    """``mtp_processor`` whose loss carries ``factor`` times its gradient; the
    value (and so Megatron's logged MTP loss) is unchanged::

        loss_k = mtp_processor(ctx_k)["loss"]      # forward: the same values
        d loss_k = factor * d loss_k               # backward

    That is what veRL does per micro-batch under ``calculate_per_token_loss``
    when Megatron's ``finalize_model_grads`` divides by a count other than the
    loss tokens (``mtp_loss_scaling_factor * routed_tokens / batch_tokens``, set
    on ``packed_seq_params``): make one such processor per micro-batch. ``factor``
    is a real number (``int``, ``float``, NumPy's, ``Fraction``; not ``bool``),
    finite as a float and > 0. ``mtp_processor`` is checked here as the forward
    checks an unwrapped one; its result may be any ``Mapping`` with a ``"loss"``
    (as ``hookspec.validate_mtp_result`` takes), returned as a ``dict``."""
    check_mtp_callable(mtp_processor)
    scale = _positive_factor(factor)

    def fn(ctx: OutputContext) -> Any:
        out = mtp_processor(ctx)
        if isinstance(out, torch.Tensor):
            return scale_gradient(out, scale)
        if isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor):
            return {**out, "loss": scale_gradient(out["loss"], scale)}
        return out  # the forward's result check names what is wrong

    name = getattr(mtp_processor, "name", getattr(mtp_processor, "__name__", "mtp_processor"))
    return processor(fn, name=f"scaled_mtp_gradient({name}, {scale:g})")


def _positive_factor(factor: Any) -> float:
    expected = "a finite number > 0"
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise ContractError("factor", expected=expected, actual=repr(factor))
    try:
        scale = float(factor)
    except OverflowError:  # an int or Fraction beyond the float range (10**400)
        raise ContractError(
            "factor", expected=expected, actual=f"{factor!r:.40} (beyond the float range)"
        ) from None
    if not (math.isfinite(scale) and scale > 0):
        raise ContractError("factor", expected=expected, actual=repr(factor))
    return scale


# ---------------------------------------------------------------------------
# The MTP layers: detached encoder, the micro-batch's CP group
# ---------------------------------------------------------------------------

_LAYER_OPTIONS = "_hookspec_mtp_options"  # instance attribute of an adapted MTP layer


def mtp_roll_group(model: Any, packed_seq_params: Any, options: MTPOptions) -> Any:
    """The CP group the MTP rolls use: ``packed_seq_params.cp_group`` where
    ``options.cp_group_from_packed`` and the micro-batch carries one (megatron-core
    0.16+ ``PackedSeqParams`` has the field), else the model's
    (``GPTModel._postprocess``'s ``cp_group``, upstream)."""
    if options.cp_group_from_packed:
        group = getattr(packed_seq_params, "cp_group", None)
        if group is not None:
            return group
    return mtp_cp_group(model)


class MTPLayerAdapter:
    """Mixed in before ``MultiTokenPredictionLayer`` by :func:`adapt_mtp_layers`
    (an instance-level subclass; the class itself is untouched).

    Its ``_get_embeddings`` runs Megatron's own and then, with
    ``detach_encoder``, detaches the last two values it returns, the token
    embeddings and the input hidden states: ``(..., decoder_input, hidden_states)``
    in megatron-core 0.16.1 (four values) and 0.19.2 (five, with ``padding_mask``),
    pinned by ``tests/hook/test_mtp.py::test_detach_encoder_*``. The hidden states stay
    a tensor that requires grad, as Megatron's own ``mtp_detach_heads`` path keeps
    them (activation checkpointing needs one such input). With
    ``cp_group_from_packed`` the layer's ``cp_group`` reads the micro-batch's group
    for the length of that call (its rolls of input and position ids)."""

    _hookspec_mtp_original_class: type[Any]
    _hookspec_mtp_embeddings_signature: inspect.Signature

    def _get_embeddings(self, *args: Any, **kwargs: Any) -> Any:
        options: MTPOptions = self.__dict__[_LAYER_OPTIONS]
        own = super()._get_embeddings  # type: ignore[misc]
        group = None
        if options.cp_group_from_packed:
            bound = self._hookspec_mtp_embeddings_signature.bind(self, *args, **kwargs)
            group = getattr(bound.arguments.get("packed_seq_params"), "cp_group", None)
        if group is None:
            out = own(*args, **kwargs)
        else:
            layer: Any = self
            saved = layer.cp_group
            layer.cp_group = group
            try:
                out = own(*args, **kwargs)
            finally:
                layer.cp_group = saved
        if not options.detach_encoder:
            return out
        *rest, decoder_input, hidden_states = out
        return (*rest, decoder_input.detach(), hidden_states.detach().requires_grad_(True))


_ADAPTED_LAYERS: dict[type, type] = {}


def _mtp_layers(model: Any) -> list[torch.nn.Module]:
    block = getattr(model, "mtp", None)
    return list(getattr(block, "layers", None) or [])


def adapt_mtp_layers(model: Any, options: MTPOptions | None) -> None:
    """Give each MTP layer of ``model`` :class:`MTPLayerAdapter` where ``options``
    need it, or (``None``, or options that do not) its own class back."""
    for layer in _mtp_layers(model):
        cls: Any = type(layer)
        if options is not None and options.adapts_layers:
            if not isinstance(layer, MTPLayerAdapter):
                adapted = _ADAPTED_LAYERS.get(cls)
                if adapted is None:
                    adapted = type(
                        f"OutputHook{cls.__name__}",
                        (MTPLayerAdapter, cls),
                        {
                            "__module__": __name__,
                            "_hookspec_mtp_original_class": cls,
                            "_hookspec_mtp_embeddings_signature": inspect.signature(
                                cls._get_embeddings
                            ),
                        },
                    )
                    _ADAPTED_LAYERS[cls] = adapted
                layer.__class__ = adapted
            layer.__dict__[_LAYER_OPTIONS] = options
        elif isinstance(layer, MTPLayerAdapter):
            layer.__class__ = layer._hookspec_mtp_original_class
            layer.__dict__.pop(_LAYER_OPTIONS, None)


# ---------------------------------------------------------------------------
# The loss loop
# ---------------------------------------------------------------------------


def attach_mtp_losses(
    model: Any,
    hidden_states: torch.Tensor,
    *,
    call: ForwardCall,
    hook_kwargs: dict[str, Any],
) -> torch.Tensor:
    """The main hidden states ``[s, b, h]`` with every depth's MTP loss attached.

    ``hidden_states`` is the MTP block's output ``[(1 + K) * s, b, h]``;
    ``hook_kwargs`` the main hook's sixteen keywords (labels, loss mask,
    output weight, ...) before any rolling; ``call.mtp(kwargs, k)`` runs the
    MTP processor at depth ``k``.

    Mirrors the MTP block of ``GPTModel._postprocess`` (megatron-core 0.16.1)
    and ``multi_token_prediction.process_mtp_loss`` (0.19.2): the rolls, the
    mask multiply, the scaling by ``mtp_loss_scaling_factor / K`` and the token
    counts (:func:`mtp_semantics` picks between them), the logging; labels
    ``None`` are derived from ``input_ids`` as 0.19.2 does, on every release.
    Pinned by ``tests/releases/test_upstream_mirror.py``.
    """
    config = model.config
    semantics = mtp_semantics()
    options = call.options.mtp
    depths = config.mtp_num_layers
    chunks = torch.chunk(hidden_states, 1 + depths, dim=0)
    hidden = chunks[0]
    packed = hook_kwargs.get("packed_seq_params")
    roll = functools.partial(
        roll_tensor, cp_group=mtp_roll_group(model, packed, options), packed_seq_params=packed
    )
    found = _mtp_labels(hook_kwargs, roll)
    if found is None:
        return hidden
    mtp_labels, loss_mask = found
    weight = hook_kwargs.get("output_weight")
    if getattr(config, "mtp_detach_heads", False):
        weight = (weight if weight is not None else model.output_layer.weight).detach()
    original_num_tokens = loss_mask.sum()
    avg_group = parallel_state.get_data_parallel_group(with_context_parallel=True)

    for layer in range(depths):
        mtp_labels, _ = roll(mtp_labels)
        loss_mask, num_tokens = roll(loss_mask)
        kwargs = dict(
            hook_kwargs,
            hidden_states=chunks[layer + 1],
            labels=mtp_labels,
            loss_mask=loss_mask,
            output_weight=weight,
        )
        loss, accepted = call.mtp(kwargs, layer + 1)
        mtp_loss = loss_mask * loss
        if model.training:
            _log(mtp_loss, num_tokens, accepted, loss_mask, layer, depths, avg_group, semantics)
        scaled = _scaled_mtp_loss(mtp_loss, num_tokens, original_num_tokens, config, options)
        hidden = _mtp.MTPLossAutoScaler.apply(hidden, scaled)
    return hidden


def _mtp_labels(
    hook_kwargs: dict[str, Any], roll: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The labels and loss mask the MTP depths roll from, as ``GPTModel._postprocess``
    (megatron-core 0.16.1) and ``process_mtp_loss`` (0.19.2) form them: labels ``None``
    derived from ``input_ids`` rolled once, as 0.19.2 does (on every release), and then
    the loss mask rolled with them; a mask ``None`` is ones. ``None`` where there are
    neither labels nor ``input_ids`` (no MTP loss)."""
    labels: torch.Tensor | None = hook_kwargs.get("labels")
    loss_mask: torch.Tensor | None = hook_kwargs.get("loss_mask")
    derived = labels is None
    if labels is None:
        input_ids = hook_kwargs.get("input_ids")
        if input_ids is None:
            return None
        labels, _ = roll(input_ids)
    mtp_labels = labels.clone()
    if loss_mask is None:
        loss_mask = torch.ones_like(mtp_labels)
    if derived:
        loss_mask, _ = roll(loss_mask)
    return mtp_labels, loss_mask


def _scaled_mtp_loss(
    mtp_loss: torch.Tensor,
    num_tokens: torch.Tensor,
    original_num_tokens: torch.Tensor,
    config: Any,
    options: MTPOptions,
) -> torch.Tensor:
    """One depth's masked loss scaled by ``mtp_loss_scaling_factor / K`` and normalised as
    ``GPTModel._postprocess`` (megatron-core 0.16.1) and ``process_mtp_loss`` (0.19.2) do,
    in their order of operations (the same bits): with ``calculate_per_token_loss`` times
    ``original_num_tokens / num_tokens`` (the rolled counts, clamped at 1) where
    :func:`mtp_semantics` or the options ask for it, else as it is; without it over
    ``num_tokens`` (clamped at 1 on 0.19.2)."""
    semantics = mtp_semantics()
    scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
    rolled_per_token = semantics.clamped_counts or options.per_token_normalization == "rolled"
    if config.calculate_per_token_loss and rolled_per_token:
        safe = num_tokens.clamp(min=1)
        return scale * mtp_loss * (original_num_tokens / safe)
    if semantics.clamped_counts and not config.calculate_per_token_loss:
        return scale * mtp_loss / num_tokens.clamp(min=1)
    if config.calculate_per_token_loss:
        return scale * mtp_loss
    return scale * mtp_loss / num_tokens


def _log(
    mtp_loss: torch.Tensor,
    num_tokens: torch.Tensor,
    accepted: torch.Tensor | None,
    loss_mask: torch.Tensor,
    layer: int,
    depths: int,
    avg_group: Any,
    semantics: MTPSemantics,
) -> None:
    """The per-depth loss (and acceptance counts) into Megatron's MTP tracker.

    Without ``accepted`` from the processor, acceptance is logged as 0 of 0.
    Mirrors the logging in ``process_mtp_loss`` (0.19.2) and in
    ``GPTModel._postprocess`` (0.16.1).
    """
    helper = _mtp.MTPLossLoggingHelper
    if not semantics.logs_acceptance:
        helper.save_loss_to_tracker(
            torch.sum(mtp_loss) / num_tokens, layer, depths, avg_group=avg_group
        )
        return
    value = (torch.sum(mtp_loss) * (num_tokens > 0).to(mtp_loss.dtype)) / num_tokens.clamp(min=1)
    with torch.no_grad():
        valid = loss_mask.bool()
        if accepted is None:
            correct = total = torch.zeros((), device=mtp_loss.device)
        else:
            correct = (accepted.bool() & valid).sum().float()
            total = valid.sum().float()
    helper.save_metrics_to_tracker(value, correct, total, layer, depths, avg_group=avg_group)

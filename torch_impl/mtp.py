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
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.transformer import multi_token_prediction as _mtp

from hookspec import ContractError, OutputContext, Processor, processor
from hookspec.arrays import format_shape

__all__ = [
    "MTPCall",
    "MTPSemantics",
    "attach_mtp_losses",
    "chunked_mtp_loss",
    "default_mtp_loss",
    "mtp_loss_processor",
    "mtp_semantics",
]


@dataclasses.dataclass(frozen=True)
class MTPSemantics:
    """What the installed Megatron Core does around the MTP loss.

    ``derives_labels``: labels ``None`` are derived from ``input_ids`` (0.19;
    applied here on every release). ``mup_scaling``: MTP logits go through
    ``_scale_logits`` when ``config.use_mup``. ``clamped_counts``: token counts
    are clamped to >= 1 and ``calculate_per_token_loss`` rescales by the
    original over the rolled token count. ``logs_acceptance``: the tracker
    also takes acceptance counts (``save_metrics_to_tracker``).
    """

    derives_labels: bool
    mup_scaling: bool
    clamped_counts: bool
    logs_acceptance: bool


@functools.cache
def mtp_semantics() -> MTPSemantics:
    """The :class:`MTPSemantics` of the installed release, read from its functions."""
    process = getattr(_mtp, "process_mtp_loss", None)
    params = inspect.signature(process).parameters if process is not None else {}
    return MTPSemantics(
        derives_labels="input_ids" in params,
        mup_scaling="scale_logits_fn" in params,
        clamped_counts=process is not None,
        logs_acceptance=hasattr(_mtp.MTPLossLoggingHelper, "save_metrics_to_tracker"),
    )


# ---------------------------------------------------------------------------
# MTP processors
# ---------------------------------------------------------------------------


def _top1_accepted(ctx: OutputContext, logits: torch.Tensor) -> torch.Tensor:
    """``argmax_v z[s, b, v] == labels[b, s]`` as ``[b, s]`` bool, over the global
    vocabulary: the first index wins ties, as in Megatron's acceptance count."""
    with torch.no_grad():
        gathered = ctx.runtime_gather_output
        sharded = (
            (not gathered) if gathered is not None else not getattr(ctx.output_layer, "gather_output", False)
        )
        if sharded and ctx.parallel.tp_size > 1 and ctx.vocab is not None:
            local_max, local_arg = logits.max(dim=-1)  # [s, b]
            top = ctx.collectives.all_reduce_max(local_max)
            candidate = torch.where(local_max == top, local_arg + ctx.vocab.start, ctx.vocab.size)
            pred = -ctx.collectives.all_reduce_max(-candidate)  # the smallest global id at the max
        else:
            pred = logits.argmax(dim=-1)
        return pred.transpose(0, 1) == ctx.labels


def mtp_loss_processor(*, detach_head: bool = False) -> Processor:
    """The stock MTP loss as an MTP processor::

        logits = output_layer(h_k, weight=ctx.output_weight)   # [s, b, V/tp]
        logits = scale_logits(logits)                          # only with config.use_mup (0.19)
        loss = compute_language_model_loss(labels_k, logits)   # [b, s]

    ``detach_head=True`` detaches the output weight (tied embedding or output
    layer) so that the MTP loss trains the MTP layers but not the head, on any
    release (Megatron 0.19's ``config.mtp_detach_heads`` does the same and is
    honoured whatever this processor says).
    """

    def mtp_loss(ctx: OutputContext) -> dict[str, torch.Tensor]:
        weight = ctx.output_weight
        if detach_head:
            weight = (weight if weight is not None else ctx.vocab_weight).detach()
        logits, _ = ctx.output_layer(
            ctx.hidden_states, weight=weight, runtime_gather_output=ctx.runtime_gather_output
        )
        if mtp_semantics().mup_scaling and getattr(ctx.config, "use_mup", False):
            logits = ctx.scale_logits(logits)
        loss = ctx.compute_language_model_loss(ctx.labels, logits)
        return {"loss": loss, "accepted": _top1_accepted(ctx, logits)}

    return processor(mtp_loss, name="mtp_loss_detached_head" if detach_head else "mtp_loss")


default_mtp_loss: Processor = mtp_loss_processor()
"""The MTP processor that reproduces Megatron's own MTP loss (bitwise)."""


class _ChunkedCrossEntropy(torch.autograd.Function):
    """``loss[n] = logsumexp_v(x[n] @ w.T) - (x[n] @ w.T)[y[n]]`` over the global
    vocabulary, ``chunk`` rows of logits at a time in forward and in backward.

    Forward keeps ``lse [N]`` only; backward recomputes each chunk's logits and
    uses ``d loss / d z = softmax(z) - onehot(y)``. Under tensor parallelism
    ``w`` is the local shard: the forward's max and sums go through ``coll``;
    ``grad_x`` is this shard's part, which the caller's
    ``gather_hidden_states`` sums over the shards in its backward.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, coll: Any, start: int, chunk: int
    ) -> torch.Tensor:
        n = x.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        loss = torch.empty(n, dtype=torch.float32, device=x.device)
        for i in range(0, n, chunk):
            z = (x[i : i + chunk] @ w.t()).float()  # [c, V/tp]
            local, idx = _local_targets(y[i : i + chunk], start, z.shape[-1])
            m = coll.all_reduce_max(z.max(dim=-1).values)
            lse[i : i + chunk] = m + torch.log(coll.all_reduce_sum(torch.exp(z - m[:, None]).sum(-1)))
            picked = z.gather(-1, idx[:, None]).squeeze(-1) * local
            loss[i : i + chunk] = lse[i : i + chunk] - coll.all_reduce_sum(picked)
        ctx.save_for_backward(x, w, y, lse)
        ctx.start, ctx.chunk = start, chunk
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, w, y, lse = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(w.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
        )
        for i in range(0, x.shape[0], ctx.chunk):
            xs = x[i : i + ctx.chunk]
            g = (xs @ w.t()).float().sub_(lse[i : i + ctx.chunk, None]).exp_()  # softmax [c, V/tp]
            local, idx = _local_targets(y[i : i + ctx.chunk], ctx.start, g.shape[-1])
            g.scatter_add_(-1, idx[:, None], -local.to(g.dtype)[:, None])  # - onehot(y) on this shard
            g.mul_(grad_loss[i : i + ctx.chunk, None].float())
            if grad_x is not None:
                grad_x[i : i + ctx.chunk] = (g.to(w.dtype) @ w).to(x.dtype)
            if grad_w is not None:
                grad_w += g.t() @ xs.float()
        return grad_x, (grad_w.to(w.dtype) if grad_w is not None else None), None, None, None, None


def _local_targets(y: torch.Tensor, start: int, local_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which labels live on this vocab shard, and their local rows (0 elsewhere)."""
    local = (y >= start) & (y < start + local_size)
    return local, torch.where(local, y - start, torch.zeros_like(y))


def chunked_mtp_loss(*, chunk_tokens: int = 1024, detach_head: bool = False) -> Processor:
    """Per-token cross entropy of depth ``k`` without materialising its logits::

        z = h @ W.T                           # never whole: chunk_tokens rows at a time
        loss = logsumexp(z) - z[label]        # [b, s], float32, vocab-parallel

    Forward and backward each hold one chunk's logits ``[chunk_tokens, V/tp]``
    at a time (backward recomputes them), never ``[s, b, V/tp]``. Works under
    tensor and sequence parallelism through ``ctx.collectives``. It multiplies
    the vocab weight directly, so it skips the output layer's forward hooks,
    does not report acceptance, and refuses MuP (``config.use_mup``).
    """
    if not (isinstance(chunk_tokens, int) and chunk_tokens >= 1):
        raise ContractError("chunk_tokens", expected="an int >= 1", actual=repr(chunk_tokens))

    def mtp_chunked_loss(ctx: OutputContext) -> torch.Tensor:
        if ctx.labels is None or ctx.vocab_weight is None or ctx.vocab is None:
            raise ContractError("labels", expected="labels and a vocab weight for the MTP loss", actual=None)
        if getattr(ctx.config, "use_mup", False):
            raise ContractError(
                "config.use_mup",
                expected="False for chunked_mtp_loss",
                actual=True,
                hint="use default_mtp_loss",
            )
        weight = ctx.vocab_weight.detach() if detach_head else ctx.vocab_weight
        hidden = ctx.collectives.gather_hidden_states(ctx.hidden_states)  # [s, b, h]
        s, b, h = hidden.shape
        x = hidden.transpose(0, 1).reshape(b * s, h)
        y = ctx.labels.reshape(b * s)
        loss = _ChunkedCrossEntropy.apply(x, weight, y, ctx.collectives, ctx.vocab.start, chunk_tokens)
        return loss.reshape(b, s)

    return processor(mtp_chunked_loss, name=f"chunked_mtp_loss[{chunk_tokens}]")


# ---------------------------------------------------------------------------
# The bridge and the loss loop
# ---------------------------------------------------------------------------


class MTPCall:
    """Runs an MTP processor for one depth: builds and validates the context,
    validates the result. ``hook`` is the main hook's bridge (``_HookCall``),
    whose ``context`` method builds a typed context for any depth."""

    def __init__(self, model: Any, mtp_processor: Any, hook: Any) -> None:
        if not callable(mtp_processor):
            raise ContractError(
                "mtp_processor",
                expected="a hookspec processor or a callable (ctx) -> loss [b, s]",
                actual=type(mtp_processor).__name__,
            )
        if not getattr(model.config, "mtp_num_layers", None) or getattr(model, "mtp", None) is None:
            raise ContractError(
                "mtp_processor",
                expected="a model with MTP layers (config.mtp_num_layers and an MTP block)",
                actual=f"{type(model).__name__} with mtp_num_layers={model.config.mtp_num_layers}",
                hint="Pass mtp_processor only to models built with multi-token prediction",
            )
        self.processor = mtp_processor
        self.hook = hook
        self.name = getattr(
            mtp_processor, "name", getattr(mtp_processor, "__name__", type(mtp_processor).__name__)
        )

    def __call__(self, hook_kwargs: dict[str, Any], depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx = self.hook.context(hook_kwargs, mtp_depth=depth)
        result = self.processor(ctx)
        field = f"mtp_processor {self.name!r} result at depth {depth}"
        accepted = None
        if isinstance(result, Mapping):
            if "loss" not in result:
                raise ContractError(
                    field, expected="a mapping with a 'loss' [b, s]", actual=f"keys {sorted(result)}"
                )
            loss, accepted = result["loss"], result.get("accepted")
        else:
            loss = result
        want = (ctx.batch_size, ctx.seq_len)
        for name, value in (("loss", loss), ("accepted", accepted)):
            if value is None and name == "accepted":
                continue
            if not isinstance(value, torch.Tensor):
                raise ContractError(
                    f"{field}[{name!r}]", expected="a torch.Tensor [b, s]", actual=type(value).__name__
                )
            if tuple(value.shape) != want:
                raise ContractError(
                    f"{field}[{name!r}]",
                    expected=f"per-token shape [b={want[0]}, s={want[1]}]",
                    actual=format_shape(value.shape),
                )
        if not loss.is_floating_point():
            raise ContractError(f"{field}['loss']", expected="a floating dtype", actual=str(loss.dtype))
        return loss, accepted


def attach_mtp_losses(
    model: Any,
    hidden_states: torch.Tensor,
    *,
    mtp_call: MTPCall,
    hook_kwargs: dict[str, Any],
) -> torch.Tensor:
    """The main hidden states ``[s, b, h]`` with every depth's MTP loss attached.

    ``hidden_states`` is the MTP block's output ``[(1 + K) * s, b, h]``;
    ``hook_kwargs`` the main hook's sixteen keywords (labels, loss mask,
    output weight, ...) before any rolling.
    """
    config = model.config
    semantics = mtp_semantics()
    depths = config.mtp_num_layers
    chunks = torch.chunk(hidden_states, 1 + depths, dim=0)
    hidden = chunks[0]
    cp_group = model.pg_collection.cp
    packed = hook_kwargs.get("packed_seq_params")

    def roll(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _mtp.roll_tensor(x, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed)

    labels, loss_mask = hook_kwargs.get("labels"), hook_kwargs.get("loss_mask")
    derived = labels is None
    if derived:
        input_ids = hook_kwargs.get("input_ids")
        if input_ids is None:
            return hidden
        labels, _ = roll(input_ids)
    weight = hook_kwargs.get("output_weight")
    if getattr(config, "mtp_detach_heads", False):
        weight = (weight if weight is not None else model.output_layer.weight).detach()

    mtp_labels = labels.clone()
    if loss_mask is None:
        loss_mask = torch.ones_like(mtp_labels)
    if derived:
        loss_mask, _ = roll(loss_mask)
    original_num_tokens = loss_mask.sum()
    scale = config.mtp_loss_scaling_factor / depths
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
        loss, accepted = mtp_call(kwargs, layer + 1)
        mtp_loss = loss_mask * loss
        if model.training:
            _log(mtp_loss, num_tokens, accepted, loss_mask, layer, depths, avg_group, semantics)
        if semantics.clamped_counts:
            safe = num_tokens.clamp(min=1)
            if config.calculate_per_token_loss:
                hidden = _mtp.MTPLossAutoScaler.apply(hidden, scale * mtp_loss * (original_num_tokens / safe))
            else:
                hidden = _mtp.MTPLossAutoScaler.apply(hidden, scale * mtp_loss / safe)
        elif config.calculate_per_token_loss:
            hidden = _mtp.MTPLossAutoScaler.apply(hidden, scale * mtp_loss)
        else:
            hidden = _mtp.MTPLossAutoScaler.apply(hidden, scale * mtp_loss / num_tokens)
    return hidden


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
    """
    helper = _mtp.MTPLossLoggingHelper
    if not semantics.logs_acceptance:
        helper.save_loss_to_tracker(torch.sum(mtp_loss) / num_tokens, layer, depths, avg_group=avg_group)
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

"""The hookspec processors: selected-token logprobs, Megatron's cross entropy, and
the policy-loss family, each computed from the hidden states and the vocab shard.

Layout (Megatron's): ``ctx.hidden_states`` ``[s, b, h]`` (``[s/tp, b, h]`` under
sequence parallel), ``ctx.labels`` and every per-token input ``[b, s]``, every
per-token output ``[b, s]``. Inside, tokens are the rows of
``hidden_states.reshape(-1, h)``, i.e. ``s``-major.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

import torch

from hookspec import (
    Aggregation,
    ContractError,
    KLEstimator,
    OutputContext,
    Processor,
    processor,
    validate_context,
)
from hookspec.arrays import format_shape

from ._checks import (
    check_bool,
    check_finite_number,
    check_floating,
    check_int,
    check_temperature,
    context_field,
)
from ._fused import FUSED_TILE_ELEMENTS, fused_token_loss
from ._logprobs import DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK, linear_logprobs
from ._policy_math import (
    PolicyLossConfig,
    kl_terms,
    ppo_token_loss,
    sequence_log_ratio,
    weights_of,
)

__all__ = [
    "PolicyBatch",
    "cross_entropy_loss",
    "policy_loss",
    "selected_logprobs",
]


# ---------------------------------------------------------------- layout helpers


def to_tokens(x: torch.Tensor) -> torch.Tensor:
    """``[b, s] -> [n]`` in the hidden states' row order (``s``-major)."""
    return x.transpose(0, 1).reshape(-1)


def from_tokens(v: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """``[n] -> [b, s]``, the inverse of :func:`to_tokens`."""
    return v.view(s, b).transpose(0, 1).contiguous()


@dataclasses.dataclass(frozen=True)
class _HookInputs:
    hidden: torch.Tensor  # [n_local, h]
    weight: torch.Tensor  # [V_local, h]
    labels: torch.Tensor  # [n] global ids
    b: int
    s: int
    kwargs: dict[str, Any]  # vocab_start, vocab_size, collectives, ignore_index, logit_scale


def _logit_scale(ctx: OutputContext) -> float:
    """MuP's output multiplier where the model applies it (``scale_logits``):
    a finite number > 0."""
    config = ctx.config
    if config is not None and getattr(config, "use_mup", False):
        mult = getattr(config, "mup_output_mult", 1.0)
        return check_finite_number("config.mup_output_mult", mult, low=0.0, low_open=True)
    return 1.0


def _check_chunks(chunk_size: Any, token_chunk_size: Any) -> None:
    check_int("chunk_size", chunk_size, low=1)
    check_int("token_chunk_size", token_chunk_size, low=1)


def _hook_inputs(ctx: OutputContext, name: str) -> _HookInputs:
    if not isinstance(ctx, OutputContext):
        raise ContractError(
            f"processor {name!r}", expected="a hookspec.OutputContext", actual=type(ctx).__name__
        )
    if ctx.labels is None:
        raise ContractError(
            "labels", expected=f"token ids [b, s] (processor {name!r} needs them)", actual="None"
        )
    if ctx.vocab_weight is None or ctx.vocab is None:
        raise ContractError("vocab_weight", expected="the output weight shard [V/tp, h]", actual="None")
    hs = check_floating("hidden_states", ctx.hidden_states)
    # A direct call (not through the hook) gets the hook's shape checks too: shapes
    # only, no values read; the label values are checked by linear_logprobs.
    validate_context(ctx, check_values=False)
    if isinstance(ctx.ignore_index, bool) or not isinstance(ctx.ignore_index, int):
        raise ContractError("ignore_index", expected="an int", actual=repr(ctx.ignore_index))
    b, s = int(ctx.labels.shape[0]), int(ctx.labels.shape[1])
    return _HookInputs(
        hidden=hs.reshape(-1, hs.shape[-1]),
        weight=typing.cast(torch.Tensor, ctx.vocab_weight),
        labels=to_tokens(typing.cast(torch.Tensor, ctx.labels)),
        b=b,
        s=s,
        kwargs=dict(
            ignore_index=ctx.ignore_index,
            vocab_start=ctx.vocab.start,
            vocab_size=ctx.vocab.size,
            collectives=ctx.collectives,
            logit_scale=_logit_scale(ctx),
        ),
    )


def _temperature(given: float | None, ctx: OutputContext, b: int, s: int) -> float | torch.Tensor:
    """The processor's ``temperature``, else the user context's ``temperature``
    (a number or ``[b, s]``; a mapping's key or an object's attribute), else 1."""
    from_context = context_field(ctx.context, "temperature")
    if given is not None and from_context is not None:
        raise ContractError(
            "temperature",
            expected="one source: the processor's temperature= or the context's .temperature",
            actual=f"both ({given!r} and a {type(from_context).__name__})",
        )
    if from_context is None:
        return 1.0 if given is None else given
    if isinstance(from_context, torch.Tensor) and from_context.dim() > 0:
        if tuple(from_context.shape) != (b, s):
            raise ContractError(
                "context.temperature",
                expected=f"a number or shape [b={b}, s={s}]",
                actual=format_shape(from_context.shape),
            )
        return check_temperature(to_tokens(from_context), b * s, field="context.temperature")
    return check_temperature(from_context, b * s, field="context.temperature")


# ---------------------------------------------------------------- logprobs and cross entropy


def selected_logprobs(
    *,
    temperature: float | None = None,
    entropy: bool = False,
    chunk_size: int = DEFAULT_VOCAB_CHUNK,
    token_chunk_size: int = DEFAULT_TOKEN_CHUNK,
) -> Processor:
    """A processor returning ``{"logprobs": [b, s], "entropy": [b, s]}`` (fp32)::

        z = hidden_states @ vocab_weight.T / T          # never materialised
        logprobs = log_softmax(z)[labels]               # 0 where labels == ignore_index
        entropy = logsumexp(z) - sum(softmax(z) * z)    # only with entropy=True

    ``T``: ``temperature`` if given, else the user context's ``temperature``
    when it has one that is not ``None`` (a number or ``[b, s]`` per token; the
    key of a mapping such as veRL's, or the attribute of an object such as
    :class:`PolicyBatch`), else 1. Both given is an error.
    """
    if temperature is not None:
        check_temperature(temperature, 1)
    check_bool("entropy", entropy)
    _check_chunks(chunk_size, token_chunk_size)

    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        x = _hook_inputs(ctx, "selected_logprobs")
        res = linear_logprobs(
            x.hidden,
            x.weight,
            x.labels,
            temperature=_temperature(temperature, ctx, x.b, x.s),
            with_entropy=entropy,
            chunk_size=chunk_size,
            token_chunk_size=token_chunk_size,
            **x.kwargs,
        )
        out = {"logprobs": from_tokens(res.logprobs, x.b, x.s)}
        if res.entropy is not None:
            out["entropy"] = from_tokens(res.entropy, x.b, x.s)
        return out

    return processor(fn, name="selected_logprobs")


def cross_entropy_loss(
    *, chunk_size: int = DEFAULT_VOCAB_CHUNK, token_chunk_size: int = DEFAULT_TOKEN_CHUNK
) -> Processor:
    """A processor returning the per-token loss ``[b, s]`` (fp32) of Megatron's
    ``compute_language_model_loss``, unreduced and without the loss mask, like
    Megatron's (apply ``loss_mask`` as you do to Megatron's output)::

        loss = -log_softmax(scale_logits(hidden_states @ vocab_weight.T))[labels]

    One difference: where ``labels == ctx.ignore_index`` the loss is ``0`` with a
    zero gradient (Megatron returns the logsumexp there, which the loss mask
    then removes).

    It takes no temperature (Megatron's loss has none): a user context holding
    a ``temperature`` that is not ``None`` raises rather than being ignored.
    """
    _check_chunks(chunk_size, token_chunk_size)

    def fn(ctx: OutputContext) -> torch.Tensor:
        x = _hook_inputs(ctx, "cross_entropy_loss")
        t = context_field(ctx.context, "temperature")
        if t is not None:
            raise ContractError(
                "context.temperature",
                expected="none (cross_entropy_loss is Megatron's loss, which takes no temperature; "
                "use selected_logprobs for tempered logprobs)",
                actual=f"a {type(t).__name__}",
            )
        res = linear_logprobs(
            x.hidden, x.weight, x.labels, chunk_size=chunk_size, token_chunk_size=token_chunk_size, **x.kwargs
        )
        return from_tokens(-res.logprobs, x.b, x.s)

    return processor(fn, name="cross_entropy_loss")


# ---------------------------------------------------------------- policy loss


@dataclasses.dataclass(frozen=True)
class PolicyBatch:
    """The user context of :func:`policy_loss` (pass it as ``output_processor_context``).

    Per-token fields are ``[b, s]``, like ``labels``:

    - ``old_logprobs``: the behaviour policy's logprobs (ratio denominator).
    - ``advantages``: per token (broadcast a per-sequence advantage yourself).
    - ``mask``: which tokens count (bool or float); ``None``: the model's
      ``loss_mask``, else every token. Tokens labelled ``ignore_index`` never count.
    - ``ref_logprobs``: the reference policy's logprobs, needed when ``kl_coef != 0``.
    - ``temperature``: the sampling temperature, a number or ``[b, s]``.
    - ``global_tokens`` / ``global_sequences``: the token / sequence counts of
      the whole loss when it is split over ranks (context or data parallel):
      they replace the local ``sum(mask)`` / number of sequences in the
      aggregation, so that the ranks' losses sum to the global loss.
    """

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    temperature: float | torch.Tensor | None = None
    global_tokens: float | None = None
    global_sequences: float | None = None

    def validate(self, b: int, s: int, *, need_ref: bool) -> None:
        """Shapes ``[b, s]``, floating dtypes; ``ref_logprobs`` when ``need_ref``."""
        for name in ("old_logprobs", "advantages", "ref_logprobs"):
            value = getattr(self, name)
            if value is None:
                if name == "ref_logprobs" and need_ref:
                    raise ContractError(
                        "context.ref_logprobs", expected="a tensor [b, s] (kl_coef != 0)", actual="None"
                    )
                continue
            check_floating(f"context.{name}", value)
            if tuple(value.shape) != (b, s):
                raise ContractError(
                    f"context.{name}",
                    expected=f"shape [b={b}, s={s}] like labels",
                    actual=format_shape(value.shape),
                )
        if self.mask is not None:
            if not isinstance(self.mask, torch.Tensor):
                raise ContractError(
                    "context.mask", expected="a tensor [b, s]", actual=type(self.mask).__name__
                )
            if tuple(self.mask.shape) != (b, s):
                raise ContractError(
                    "context.mask",
                    expected=f"shape [b={b}, s={s}] like labels",
                    actual=format_shape(self.mask.shape),
                )
        for name in ("global_tokens", "global_sequences"):
            value = getattr(self, name)
            if value is not None:
                check_finite_number(f"context.{name}", value, low=0.0, low_open=True)


def _policy_batch(ctx: OutputContext) -> PolicyBatch:
    batch = ctx.context
    if not isinstance(batch, PolicyBatch):
        raise ContractError(
            "context",
            expected="a torch_impl.processors.PolicyBatch (output_processor_context=)",
            actual=type(batch).__name__,
            hint="A mapping is not read as one: pass PolicyBatch(**mapping)"
            if isinstance(batch, Mapping)
            else "",
        )
    return batch


def sequence_ids(ctx: OutputContext, b: int, s: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """``(segments [b, s], count)``: each token's sequence. A row per sequence,
    or, for packed (THD) input, the sequences of ``packed_seq_params``
    (``cu_seqlens_q_padded``, else ``cu_seqlens_q``, divided by the context
    parallel size: each rank holds ``1/cp`` of every sequence); tokens past the
    last boundary form one more segment."""
    psp = ctx.packed_seq_params
    if psp is None:
        return torch.arange(b, device=device)[:, None].expand(b, s), b
    cu = getattr(psp, "cu_seqlens_q_padded", None)
    if cu is None:
        cu = getattr(psp, "cu_seqlens_q", None)
    if cu is None or b != 1:
        raise ContractError(
            "packed_seq_params",
            expected="cu_seqlens_q with batch 1 (THD)",
            actual=f"batch {b}, cu_seqlens {cu}",
        )
    bounds = (cu.to(device=device, dtype=torch.long) // ctx.parallel.cp_size)[1:]
    seg = torch.bucketize(torch.arange(s, device=device), bounds, right=True)
    return seg[None, :], int(bounds.numel()) + 1


def _check_cp(config: PolicyLossConfig, batch: PolicyBatch, cp: int) -> None:
    if cp == 1:
        return
    if config.ratio == "sequence" or config.aggregation == Aggregation.SEQ_MEAN_TOKEN_MEAN:
        raise ContractError(
            "parallel.cp_size",
            expected="1 for GSPO and seq-mean-token-mean (they need whole sequences)",
            actual=cp,
        )
    need = "global_tokens" if config.aggregation == Aggregation.TOKEN_MEAN else "global_sequences"
    if getattr(batch, need) is None:
        raise ContractError(
            f"context.{need}",
            expected=f"the count over the context-parallel ranks (cp={cp}), so that their losses sum",
            actual="None",
        )


def _token_terms(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    ref: torch.Tensor | None,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    log_ratio: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Per-token terms of the loss ``L = pg + kl_coef * kl - entropy_coef * entropy``."""
    live = mask > 0
    if log_ratio is None:
        log_ratio = torch.where(live, logp - old.to(logp.dtype), 0.0)
        if config.log_ratio_clamp is not None:
            log_ratio = log_ratio.clamp(-config.log_ratio_clamp, config.log_ratio_clamp)
    pg, clipped, dual = ppo_token_loss(log_ratio, adv.to(logp.dtype), config)
    total = pg
    kl = None
    if ref is not None:
        kl = kl_terms(
            logp,
            torch.where(live, ref.to(logp.dtype), logp.detach()),
            config.kl_estimator,
            clamp=config.log_ratio_clamp,
        )
        if config.kl_coef != 0.0:
            total = total + config.kl_coef * kl
    if config.entropy_coef != 0.0:
        total = total - config.entropy_coef * entropy
    return {"loss": total, "pg": pg, "kl": kl, "clipped": clipped, "dual": dual, "log_ratio": log_ratio}


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``sum(x * m) / sum(m)`` over ``m > 0``; ``0`` when ``sum(m)`` is exactly 0.
    ``x`` where ``m == 0`` is not read; NaN at a counted token, or in ``m``, gives NaN."""
    total = m.sum()
    x = torch.where(m > 0, x.to(m.dtype), 0.0)
    return (x * m).sum() / torch.where(total == 0, 1.0, total)


def _counted(
    given: torch.Tensor | None, labels: torch.Tensor, ignore_index: int, dtype: torch.dtype
) -> torch.Tensor:
    """The mask ``M`` ``[b, s]``: ``given`` (every token when ``None``), 0 where the
    label is the ignore index. An entry that is not a finite number ``>= 0`` becomes
    NaN, wherever it is (also at an ignored label), so that the loss shows it."""
    if given is None:
        return torch.where(
            labels == ignore_index, 0.0, torch.ones(labels.shape, dtype=dtype, device=labels.device)
        )
    m = given.to(device=labels.device, dtype=dtype)
    m = torch.where(torch.isfinite(m) & (m >= 0), m, float("nan"))
    return torch.where(labels == ignore_index, m * 0.0, m)


def policy_loss(
    config: PolicyLossConfig | None = None,
    /,
    *,
    chunk_size: int = DEFAULT_VOCAB_CHUNK,
    token_chunk_size: int = DEFAULT_TOKEN_CHUNK,
    fused_tile_elements: int = FUSED_TILE_ELEMENTS,
) -> Processor:
    """A processor returning the policy loss and its metrics, each a scalar::

        {"loss", "pg_loss", "kl", "entropy", "clip_fraction", "dual_clip_fraction",
         "approx_kl"}

    ``loss`` is :class:`PolicyLossConfig`'s formula aggregated with its
    ``aggregation``, over the tokens of ``PolicyBatch.mask`` (the user context)
    whose label is not the ignore index. ``pg_loss`` and ``kl`` are its terms,
    aggregated the same way (``kl`` only with ``ref_logprobs``). The metrics are
    token means over the mask, detached: ``entropy``; ``clip_fraction`` (the
    clipped branch taken); ``dual_clip_fraction`` (with ``dual_clip``);
    ``approx_kl`` = k3 between the old and the current policy,
    ``exp(old - logp) - (old - logp) - 1``.

    With ``config.fused`` and a token ratio, the gradients are formed in the
    forward pass (no logits recomputed, see ``_fused``); otherwise logprobs and
    entropy come from :func:`linear_logprobs` and autograd goes through them.
    """
    config = PolicyLossConfig() if config is None else config
    if not isinstance(config, PolicyLossConfig):
        raise ContractError("config", expected="a PolicyLossConfig", actual=type(config).__name__)
    _check_chunks(chunk_size, token_chunk_size)
    check_int("fused_tile_elements", fused_tile_elements, low=1)

    def fn(ctx: OutputContext) -> dict[str, torch.Tensor]:
        x = _hook_inputs(ctx, "policy_loss")
        batch = _policy_batch(ctx)
        batch.validate(x.b, x.s, need_ref=config.kl_coef != 0.0)
        _check_cp(config, batch, ctx.parallel.cp_size)
        device = x.hidden.device
        given = batch.mask if batch.mask is not None else typing.cast("torch.Tensor | None", ctx.loss_mask)
        labels_bs = typing.cast(torch.Tensor, ctx.labels).to(device)
        acc = torch.float64 if x.hidden.dtype == torch.float64 else torch.float32
        mask = _counted(given, labels_bs, ctx.ignore_index, acc)
        segments, count = sequence_ids(ctx, x.b, x.s, device)
        weights = to_tokens(
            weights_of(
                mask,
                segments,
                count,
                config.aggregation,
                global_tokens=batch.global_tokens,
                global_sequences=batch.global_sequences,
            )
        )
        mask_t = to_tokens(mask)
        old = to_tokens(batch.old_logprobs).detach().to(device)
        # Batch values at uncounted tokens are never read (NaN there changes nothing).
        adv = torch.where(mask_t > 0, to_tokens(batch.advantages).detach().to(device), 0.0)
        ref = to_tokens(batch.ref_logprobs).detach().to(device) if batch.ref_logprobs is not None else None
        temperature = _temperature(None, ctx, x.b, x.s)
        fused = config.fused and config.ratio == "token"
        if fused:

            def token_loss(lp: torch.Tensor, ent: torch.Tensor, rows: slice) -> torch.Tensor:
                terms = _token_terms(
                    lp, ent, old[rows], adv[rows], None if ref is None else ref[rows], mask_t[rows], config
                )
                return (terms["loss"] * weights[rows].to(lp.dtype)).sum()

            res = fused_token_loss(
                x.hidden,
                x.weight,
                x.labels,
                token_loss,
                temperature=temperature,
                tile_elements=fused_tile_elements,
                **x.kwargs,
            )
            loss, logp, entropy = res.loss, res.logprobs, res.entropy
            terms = _token_terms(logp, entropy, old, adv, ref, mask_t, config)
        else:
            lr = linear_logprobs(
                x.hidden,
                x.weight,
                x.labels,
                temperature=temperature,
                with_entropy=True,
                chunk_size=chunk_size,
                token_chunk_size=token_chunk_size,
                **x.kwargs,
            )
            logp, entropy = lr.logprobs, typing.cast(torch.Tensor, lr.entropy)
            log_ratio = None
            if config.ratio == "sequence":
                log_ratio = to_tokens(
                    sequence_log_ratio(
                        from_tokens(logp, x.b, x.s),
                        batch.old_logprobs.to(device=device, dtype=logp.dtype),
                        mask,
                        segments,
                        count,
                        clamp=config.log_ratio_clamp,
                    )
                )
            terms = _token_terms(logp, entropy, old, adv, ref, mask_t, config, log_ratio=log_ratio)
            loss = (terms["loss"] * weights.to(logp.dtype)).sum()
        w = weights.to(logp.dtype)
        m = mask_t.to(logp.dtype)
        out = {
            "loss": loss,
            "pg_loss": (terms["pg"].detach() * w).sum(),
            "entropy": _masked_mean(entropy.detach(), m),
            "clip_fraction": _masked_mean(terms["clipped"], m),
            "approx_kl": _masked_mean(
                kl_terms(logp.detach(), old.to(logp.dtype), KLEstimator.K3, clamp=config.log_ratio_clamp), m
            ),
        }
        if terms["kl"] is not None:
            out["kl"] = (terms["kl"].detach() * w).sum()
        if terms["dual"] is not None:
            out["dual_clip_fraction"] = _masked_mean(terms["dual"], m)
        return out

    return processor(fn, name="policy_loss")

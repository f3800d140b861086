"""One forward's call: what an enabled model hands the hook, and the one place
that builds contexts, runs processors and validates their results.

A :class:`ForwardCall` is made once per forward (by the adapter or the
schedule plan) and carries the model, its options, the processors, the
caller's context and the padding mask. Data flows down through it once::

    adapter.forward -> ForwardCall -> Megatron's forward / _postprocess
        -> ForwardCall.mtp(kwargs, depth)   per MTP depth  -> mtp processor
        -> ForwardCall.main(kwargs)         the main head  -> output processor

Megatron reaches it either as the native hook's ``output_processor`` (0.18+:
``ForwardCall.__call__(**kwargs)``), as ``mtp_output_processor`` where Megatron
has the per-depth MTP hook of ``upstream/`` (:meth:`ForwardCall.mtp_hook`), or,
where the adapter runs its own ``_postprocess``, through
:meth:`ForwardCall.stashed` and :func:`stashed_call`.
Nothing here calls back up into the modules that made the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch

from hookspec import (
    IGNORE_INDEX,
    ContractError,
    OutputContext,
    check_int64,
    check_upstream_processor,
    is_hookspec_processor,
    validate_context,
    validate_mtp_result,
    validate_result,
)

from .context import build_output_context
from .value_checks import check_labels_deferred, checked_call

__all__ = [
    "ForwardCall",
    "HookOptions",
    "MTPOptions",
    "check_mtp_callable",
    "default_output",
    "stashed_call",
]

_STASH = "_hookspec_call"  # the instance attribute set by ForwardCall.stashed, read by stashed_call


PER_TOKEN_NORMALIZATIONS = ("release", "rolled")


@dataclasses.dataclass(frozen=True)
class MTPOptions:
    """How an enabled model trains its MTP layers where RL recipes depart from
    upstream; the defaults are upstream Megatron's (see ``docs/mtp.md``).

    ``detach_encoder``: each MTP layer sees the token embeddings and its input
    hidden states (the main decoder's, or the previous depth's) detached, so the
    MTP losses train the MTP layers (and the output head, unless it is detached
    too) but not the embedding or the main decoder (veRL's ``detach_encoder``)::

        decoder_input_k, hidden_k = embedding(ids_k).detach(), hidden_{k-1}.detach()

    ``per_token_normalization`` (read under ``config.calculate_per_token_loss``):
    ``"release"`` applies the installed release's rule (0.16: ``scale * loss_k``;
    0.17+: ``scale * loss_k * n_0 / max(n_k, 1)``, ``n_k`` the rolled mask's token
    count); ``"rolled"`` applies the 0.17+ rule on every release, as veRL's patch
    does on releases without ``process_mtp_loss``.

    ``cp_group_from_packed``: roll labels, loss mask and the MTP layers' input ids
    over ``packed_seq_params.cp_group`` when the micro-batch carries one (dynamic
    context parallel, as veRL does), instead of the model's CP group (upstream).

    A model (or pipeline stage) without MTP layers ignores them, so one call can
    enable every model chunk of a pipeline.
    """

    detach_encoder: bool = False
    per_token_normalization: Literal["release", "rolled"] = "release"
    cp_group_from_packed: bool = False

    def __post_init__(self) -> None:
        for name in ("detach_encoder", "cp_group_from_packed"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ContractError(f"mtp.{name}", expected="a bool", actual=repr(value))
        if self.per_token_normalization not in PER_TOKEN_NORMALIZATIONS:
            raise ContractError(
                "mtp.per_token_normalization",
                expected=f"one of {list(PER_TOKEN_NORMALIZATIONS)}",
                actual=repr(self.per_token_normalization),
            )

    @property
    def rolls_or_scales_itself(self) -> bool:
        """True when the MTP losses must be computed by the adapter (not by
        Megatron's native path) for these options to take effect."""
        return self.per_token_normalization != "release" or self.cp_group_from_packed

    @property
    def adapts_layers(self) -> bool:
        """True when the MTP layers need ``torch_impl.mtp``'s layer adapter."""
        return self.detach_encoder or self.cp_group_from_packed


@dataclasses.dataclass(frozen=True)
class HookOptions:
    """Options of an enabled model.

    ``ignore_index``: the label that selects no token. ``mtp``: the
    :class:`MTPOptions` of a model with MTP layers. ``check_values``: check
    the labels' range at every call, once, in the hook (on a GPU without a host
    read: :mod:`torch_impl.value_checks` raises at the entry of a later call or at
    ``raise_pending_errors``); ``False`` does no value check at all, in the hook
    or in the built-in processors. Shape checks always run.
    """

    ignore_index: int = IGNORE_INDEX
    check_values: bool = True
    mtp: MTPOptions = MTPOptions()

    def __post_init__(self) -> None:
        if not isinstance(self.mtp, MTPOptions):
            raise ContractError(
                "mtp", expected="a torch_impl.mtp.MTPOptions", actual=type(self.mtp).__name__
            )
        # checked where they enter (enable_output_processor), not at the first forward
        # the label that selects no token (Megatron's is -100); it meets int64 label tensors
        object.__setattr__(self, "ignore_index", check_int64("ignore_index", self.ignore_index))
        if not isinstance(self.check_values, bool):
            raise ContractError("check_values", expected="a bool", actual=repr(self.check_values))


def default_output(
    *,
    hidden_states: torch.Tensor,
    output_layer: Any,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor | None,
    runtime_gather_output: bool | None,
    compute_language_model_loss: Callable[..., torch.Tensor],
    scale_logits: Callable[[torch.Tensor], torch.Tensor],
    **_: Any,
) -> torch.Tensor:
    """The stock head, as an upstream-style processor (used when only an MTP
    processor is given)::

        logits = scale_logits(output_layer(h, weight=output_weight)[0])   # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1)
        return compute_language_model_loss(labels, logits)

    Mirrors the tail of ``GPTModel._postprocess`` (megatron-core 0.16.1 and
    0.19.2, training path), pinned by ``tests/releases/test_upstream_mirror.py``.
    """
    logits, _ = output_layer(
        hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output
    )
    logits = scale_logits(logits)
    if labels is None:
        return logits.transpose(0, 1).contiguous()
    return compute_language_model_loss(labels, logits)


_CHECKED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
"""Callables and the signature checks they passed (a signature read costs tens of
microseconds; a training loop passes the same function every step)."""


def _check_once(check: Callable[[Callable[..., Any]], None], fn: Callable[..., Any]) -> None:
    """``check(fn)``, once per callable (every time for one that cannot be weakly keyed)."""
    try:
        if check.__name__ in _CHECKED.get(fn, ()):
            return
    except TypeError:  # not hashable
        pass
    check(fn)
    with contextlib.suppress(TypeError):  # not weakly referable
        _CHECKED.setdefault(fn, set()).add(check.__name__)


def _check_upstream_keywords(fn: Callable[..., Any]) -> None:
    check_upstream_processor(fn, field="output_processor")


def check_mtp_callable(fn: Any, /) -> None:
    """An MTP processor as the forward takes it: a hookspec processor, or a callable
    that can be called with the typed context alone. Anything else (not callable,
    or keyword-style like the upstream hook's processors) raises ``ContractError``
    naming ``mtp_processor``, before the model runs; the MTP wrappers
    (``detached_head``, ``scaled_mtp_gradient``) check what they wrap with it."""
    expected = "a hookspec processor or a callable (ctx) -> loss [b, s], such as default_mtp_loss"
    _check_callable(fn, "mtp_processor", expected, _check_takes_the_context)


def _check_callable(
    fn: Any, field: str, expected: str, check_signature: Callable[[Callable[..., Any]], None]
) -> None:
    """``fn`` callable (else ``ContractError`` naming ``field``), and its signature
    checked once unless it is a hookspec processor."""
    if not callable(fn):
        raise ContractError(field, expected=expected, actual=type(fn).__name__)
    if not is_hookspec_processor(fn):
        _check_once(check_signature, fn)


def _check_takes_the_context(fn: Callable[..., Any]) -> None:
    """An MTP processor is called with the typed context alone: one whose parameters
    cannot take it (the upstream hook's keywords, say) is refused before the model runs."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    try:
        signature.bind(object())
    except TypeError:
        raise ContractError(
            "mtp_processor",
            expected="a callable (ctx) -> loss [b, s]: MTP processors receive the typed context",
            actual=f"a callable with parameters {signature}",
            hint="Write it as def f(ctx) and decorate it with @hookspec.processor",
        ) from None


def _processor_name(fn: object) -> str:
    name = getattr(fn, "name", getattr(fn, "__name__", None))
    return name if isinstance(name, str) else type(fn).__name__


class ForwardCall:
    """One forward's hook: builds, validates and runs (see the module docstring).

    ``processor``: the output processor, a hookspec processor or an
    upstream-style callable, or ``None`` for the stock head.
    ``mtp_processor``: the per-depth MTP loss processor, or ``None`` where the
    model has no MTP layers. Both are checked here, before the model runs.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        options: HookOptions,
        *,
        processor: Any,
        user_context: Any,
        mtp_processor: Any,
        padding_mask: torch.Tensor | None,
    ) -> None:
        if processor is not None:
            expected = "a callable or a hookspec processor"
            _check_callable(processor, "output_processor", expected, _check_upstream_keywords)
        if mtp_processor is not None:
            check_mtp_callable(mtp_processor)
        self.model = model
        self.options = options
        self.processor = processor
        self.user_context = user_context
        self.mtp_processor = mtp_processor
        self.padding_mask = padding_mask

    def context(self, hook_kwargs: Mapping[str, Any], depth: int) -> OutputContext:
        """The validated typed context of the hook's sixteen keywords at MTP depth ``depth``."""
        ctx = build_output_context(
            self.model,
            hook_kwargs,
            padding_mask=self.padding_mask,
            ignore_index=self.options.ignore_index,
            mtp_depth=depth,
            check_values=self.options.check_values,
            # checked below, once: processors do not again
            labels_checked=self.options.check_values,
        )
        validate_context(ctx, check_values=False)
        if self.options.check_values and ctx.labels is not None and ctx.vocab is not None:
            check_labels_deferred(ctx.labels, ctx.vocab.size, ignore_index=ctx.ignore_index)
        return ctx

    @checked_call()
    def main(self, hook_kwargs: dict[str, Any]) -> Any:
        """The main head's result from the hook's sixteen keywords: the output
        processor's (a hookspec result validated), or the stock head's."""
        hook_kwargs["context"] = self.user_context
        if self.processor is None:
            return default_output(**hook_kwargs)
        ctx = self.context(hook_kwargs, 0)
        if not is_hookspec_processor(self.processor):
            return self.processor(**hook_kwargs)
        result = self.processor(ctx)
        validate_result(
            result,
            batch=ctx.batch_size,
            seq=ctx.seq_len,
            field=f"processor {_processor_name(self.processor)!r} result",
        )
        return result

    def __call__(self, **hook_kwargs: Any) -> Any:
        """What Megatron's native hook calls (its sixteen keywords): :meth:`main`."""
        return self.main(hook_kwargs)

    @checked_call()
    def mtp(
        self, hook_kwargs: Mapping[str, Any], depth: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MTP processor's ``(loss [b, s], accepted [b, s] or None)`` at depth ``depth``
        >= 1."""
        ctx = self.context(hook_kwargs, depth)
        result = self.mtp_processor(ctx)
        field = f"mtp_processor {_processor_name(self.mtp_processor)!r} result at depth {depth}"
        loss, accepted = validate_mtp_result(
            result, batch=ctx.batch_size, seq=ctx.seq_len, field=field, array_kind="a torch.Tensor"
        )
        return loss, accepted

    def mtp_hook(self, *, mtp_depth: int, **hook_kwargs: Any) -> Any:
        """What Megatron's native ``mtp_output_processor`` calls at each MTP depth
        (``process_mtp_loss``'s keywords at that depth, and ``mtp_depth``; the user
        context is this call's, as Megatron passes none): :meth:`mtp`'s result as
        Megatron takes it, the loss ``[b, s]`` or ``{"loss", "accepted"}``."""
        hook_kwargs["context"] = self.user_context
        loss, accepted = self.mtp(hook_kwargs, mtp_depth)
        return loss if accepted is None else {"loss": loss, "accepted": accepted}

    @contextlib.contextmanager
    def stashed(self) -> Iterator[None]:
        """This call on the model for the adapter's ``_postprocess`` to find
        (:func:`stashed_call`), for the length of the block."""
        self.model.__dict__[_STASH] = self
        try:
            yield
        finally:
            self.model.__dict__.pop(_STASH, None)


def stashed_call(model: torch.nn.Module) -> ForwardCall | None:
    """The :class:`ForwardCall` stashed on ``model`` by :meth:`ForwardCall.stashed`, if any."""
    return model.__dict__.get(_STASH)


def clear_stash(model: torch.nn.Module) -> None:
    """Drop a stashed call (when the adapter is removed)."""
    model.__dict__.pop(_STASH, None)
